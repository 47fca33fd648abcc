"""LoRA adapters on disk: `adapter_model.safetensors` and `adapter_config.json`, only the adapter.

For a model with a per-projection Hugging Face layout (a GPT in the Llama layout, a BERT) the files are
PEFT's own format and names (`base_model.model.{module}.lora_A.weight`, `target_modules` in Hugging Face's
names), so `peft.PeftModel.from_pretrained(hf_model, DIR)` loads what `save_lora` writes and `load_lora`
reads what `PeftModel.save_pretrained` writes. A model without one (GPT-2's fused `c_attn` holds W_q, W_k
and W_v in one tensor, so PEFT cannot adapt them apart; the encoder-decoder) is saved in plainformer's
names (`{module}.lora_A`), which `load_lora` reads too. Nothing is pickled.

A BERT classifier's adapter is PEFT's SEQ_CLS task: besides A and B it holds the classifier it trains
(`modules_to_save`: `base_model.model.classifier.weight` and `.bias`), which PEFT puts in place of the
classifier of the BertForSequenceClassification it loads the adapter onto.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import cast

from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..files.atomic import atomic_path
from ..files.json_file import read_json_object
from ..models.bert import BertForSequenceClassification, BertModel
from ..models.gpt import GPT
from ..nn.lora import LoRALinear, add_lora
from .bert import bert_name_map
from .gpt import weight_map
from .gpt_layouts import LLAMA, MIXTRAL, field_without_layout, layout_for

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
# PEFT's task types, and the modules it saves whole beside the adapter, by the model's class.
_CLASSIFIER_HEAD = ("classifier",)


def _hf_modules(model: nn.Module) -> dict[str, str] | None:
    """Our module name -> Hugging Face's, for every linear layer a LoRA may adapt; None when the model has
    no per-projection Hugging Face layout."""
    if isinstance(model, GPT):
        if (model.config.pos_encoding != "rope" or field_without_layout(model.config) is not None
                or layout_for(model.config) not in (LLAMA, MIXTRAL)):
            return None
        pairs = [(w.ours[0], w.hf) for w in weight_map(model.config) if len(w.ours) == 1]
    elif isinstance(model, BertModel):
        pairs = [(ours, hf) for hf, ours in bert_name_map(model.config.n_layers).items()]
    elif isinstance(model, BertForSequenceClassification):
        pairs = [(f"bert.{ours}", f"bert.{hf}") for hf, ours in bert_name_map(model.config.n_layers).items()]
    else:
        return None
    return {ours.removesuffix(".weight"): hf.removesuffix(".weight") for ours, hf in pairs
            if ours.endswith(".weight")}


def _lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    if not layers:
        raise ValueError(f"the {type(model).__name__} has no LoRA layers to save; add_lora first")
    return layers


def has_peft_names(model: nn.Module) -> bool:
    """Whether every LoRA layer of `model` adapts a module PEFT names alone (not GPT-2's fused c_attn), so
    that `save_lora` writes PEFT's names."""
    hf = _hf_modules(model)
    return hf is not None and all(name in hf for name in _lora_layers(model))


def save_lora(model: nn.Module, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> Path:
    """Write the LoRA layers of `model` (A, B, r, α, dropout) to `directory`; returns it. In PEFT's format
    and names where the model has a Hugging Face layout (see the module docstring, `has_peft_names`), else
    in ours; adapter_config.json names `base_model_name_or_path`, the base the adapter was trained on."""
    layers = _lora_layers(model)
    first = next(iter(layers.values()))
    hf = _hf_modules(model)
    peft_names = has_peft_names(model)
    names = {name: _PEFT_PREFIX + hf[name] if peft_names and hf else name for name in layers}
    tensors: dict[str, Tensor] = {}
    for name, layer in layers.items():
        suffix = ".weight" if peft_names else ""
        tensors[f"{names[name]}.lora_A{suffix}"] = layer.lora_A.detach().cpu().contiguous()
        tensors[f"{names[name]}.lora_B{suffix}"] = layer.lora_B.detach().cpu().contiguous()
    heads = _heads(model)
    for head in heads:
        for weight, tensor in model.get_submodule(head).state_dict().items():
            tensors[f"{_PEFT_PREFIX}{head}.{weight}"] = tensor.detach().cpu().contiguous()
    task = "CAUSAL_LM" if isinstance(model, GPT) else "SEQ_CLS" if heads else None
    config = {"peft_type": "LORA", "task_type": task, "modules_to_save": list(heads) or None,
              "r": first.r, "lora_alpha": first.alpha, "lora_dropout": first.lora_dropout.p,
              "target_modules": sorted({n.rpartition(".")[2] for n in names.values()}), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model_name_or_path}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / ADAPTER_WEIGHTS) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_path(directory / ADAPTER_CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return directory


def _heads(model: nn.Module) -> tuple[str, ...]:
    """The modules an adapter of `model` holds whole (PEFT's modules_to_save): a classifier's head."""
    return _CLASSIFIER_HEAD if isinstance(model, BertForSequenceClassification) else ()


def load_lora(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Add the adapter in `directory` (written by `save_lora` or by PEFT's `save_pretrained`) to `model`,
    which has no LoRA layers yet; returns `model`, with a classifier's head from the adapter where it holds
    one. Every tensor is checked against the layer it fits."""
    directory = Path(directory)
    config = read_json_object(directory / ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory / ADAPTER_CONFIG}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    tensors = load_file(directory / ADAPTER_WEIGHTS)
    heads = {name: tensor for name, tensor in tensors.items()
             if name.removeprefix(_PEFT_PREFIX).partition(".")[0] in _heads(model)}
    adapters = _adapters(model, directory, {name: t for name, t in tensors.items() if name not in heads})
    targets = sorted({name.rpartition(".")[2] for name in adapters})
    add_lora(model, r=config.get("r", 8), alpha=float(config.get("lora_alpha", 8)),
             dropout=float(config.get("lora_dropout", 0.0)), targets=targets)
    missing = sorted(name for name, m in model.named_modules() if isinstance(m, LoRALinear) and name not in adapters)
    if missing:
        raise ValueError(f"{directory / ADAPTER_WEIGHTS} holds no A and B for {', '.join(missing[:3])}")
    for name, (a, b) in adapters.items():
        layer = cast(LoRALinear, model.get_submodule(name))
        for saved, ours, which in ((a, layer.lora_A, "lora_A"), (b, layer.lora_B, "lora_B")):
            if saved.shape != ours.shape:
                raise ValueError(f"{directory / ADAPTER_WEIGHTS}: {name}.{which} has shape {tuple(saved.shape)}, "
                                 f"the model's is {tuple(ours.shape)}")
            ours.data.copy_(saved)
    for name, tensor in heads.items():
        weight = model.get_parameter(name.removeprefix(_PEFT_PREFIX))
        if tensor.shape != weight.shape:
            raise ValueError(f"{directory / ADAPTER_WEIGHTS}: {name} has shape {tuple(tensor.shape)}, the model's "
                             f"is {tuple(weight.shape)} (another number of classes?)")
        weight.data.copy_(tensor)
    return model


def _adapters(model: nn.Module, directory: Path, tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Our module name -> (A, B), from PEFT's names (a task model's "bert." prefix dropped) or ours."""
    ours_of = {hf: ours for ours, hf in (_hf_modules(model) or {}).items()}
    modules = dict(model.named_modules())
    found: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removesuffix(".weight")
        module, _, which = name.rpartition(".")
        if which not in ("lora_A", "lora_B"):
            raise ValueError(f"{directory / ADAPTER_WEIGHTS} holds {key!r}, which is no LoRA A or B")
        if module.startswith(_PEFT_PREFIX):
            hf = module.removeprefix(_PEFT_PREFIX)
            module = ours_of.get(hf) or ours_of.get(hf.removeprefix("bert."), "")
            if not module:
                raise ValueError(f"{directory / ADAPTER_WEIGHTS}: {key!r} names no layer of this "
                                 f"{type(model).__name__}")
        elif not isinstance(modules.get(module), nn.Linear):
            raise ValueError(f"{directory / ADAPTER_WEIGHTS}: {key!r} names no linear layer of this "
                             f"{type(model).__name__}")
        found.setdefault(module, {})[which] = tensor
    incomplete = sorted(module for module, pair in found.items() if len(pair) != 2)
    if incomplete:
        raise ValueError(f"{directory / ADAPTER_WEIGHTS} holds only one of A and B for {incomplete[0]}")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in found.items()}
