"""A GPT's Hugging Face directory in and out (`write_gpt_directory`, `read_gpt_directory`: the GPT half
of `hf.auto`'s `save_hf` and `load_hf`), and the weight map that reads a layout's table.

A directory is config.json + model.safetensors, the files `transformers.AutoModelForCausalLM.from_pretrained`
reads (`save_hf` adds the tokenizer's files). The layouts, GPT-2, Llama, Mistral, Qwen3 and Mixtral, are the
declarative tables of `hf.gpt_layouts`; `weight_map` expands a layout's table into one entry per Hugging Face
tensor, which `state_from_hf` and `state_to_hf` follow in either direction.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..data.tokenizers import Tokenizer
from ..files.atomic import atomic_path
from ..models.family_model import check_model_memory
from ..models.gpt import GPT, GPTConfig
from .directory import HF_CONFIG, SAFETENSORS, check_hf_sizes, read_sharded_hf_weights, write_hf_config
from .gpt_layouts import CONV1D, EMBEDDING, EXPERTS, GPT2, LAYOUTS, LINEAR, NORM, Layout, layout_for

HEAD = "lm_head"


# ----------------------------------------------------------------------------- the weight map

@dataclasses.dataclass(frozen=True)
class Weight:
    """One Hugging Face tensor = our tensors concatenated on axis 0, transposed when `transpose`; or,
    with an `expert` index, that expert's (out, in) of our one stacked (E, out, in) tensor."""

    hf: str
    ours: tuple[str, ...]
    transpose: bool = False
    expert: int | None = None


def weight_map(config: GPTConfig, layout: Layout | None = None) -> list[Weight]:
    """Every tensor of a GPT with this config, as its Hugging Face layout names it.

    A tied output projection is absent (it is the embedding); an untied one is `lm_head.weight`.
    """
    layout = layout or layout_for(config)
    entries = list(layout.modules)
    for i in range(config.n_layers):
        prefix = layout.layer_prefix.format(i=i)
        entries += [(prefix + hf, _prefixed(f"blocks.{i}.", ours), kind) for hf, ours, kind in layout.layer]
    if not config.tie_weights:
        entries.append((HEAD, HEAD, LINEAR))
    weights = []
    for hf, ours, kind in entries:
        ours = (ours,) if isinstance(ours, str) else ours
        tensors: tuple[str, ...]
        if kind == EXPERTS:  # our stacked experts are parameters themselves, without a ".weight"
            weights += [Weight(f"{hf.format(e=e)}.weight", ours, expert=e) for e in range(config.n_experts)]
            continue
        if kind == LINEAR and hf == HEAD:
            tensors = ("weight",)  # the output projection never has a bias
        elif kind == EMBEDDING or (kind == NORM and config.norm == "rmsnorm"):
            tensors = ("weight",)
        else:
            tensors = ("weight", "bias") if config.bias else ("weight",)
        weights += [Weight(f"{hf}.{t}", tuple(f"{o}.{t}" for o in ours), kind == CONV1D and t == "weight")
                    for t in tensors]
    return weights


def _prefixed(prefix: str, ours: str | tuple[str, ...]) -> str | tuple[str, ...]:
    return prefix + ours if isinstance(ours, str) else tuple(prefix + o for o in ours)


def state_from_hf(hf_state: Mapping[str, Tensor], config: GPTConfig,
                  layout: Layout | None = None) -> dict[str, Tensor]:
    """A Hugging Face state dict (or any dict keyed by its names, e.g. of gradients) in our names,
    with the buffers the layout has no tensor for (`Layout.buffers`).

    Every key must be mapped, be a buffer the layout ignores (by suffix), or be the tied head.
    """
    layout = layout or layout_for(config)
    if not any(k.startswith(layout.base_prefix) for k in hf_state):  # a base model without its LM head
        hf_state = {layout.base_prefix + k: v for k, v in hf_state.items()}
    hf_state = layout.renamed(hf_state)
    weights = weight_map(config, layout)
    known = {w.hf for w in weights}
    unknown = sorted(k for k in hf_state if k not in known and not k.endswith(layout.ignored_suffixes)
                     and not (config.tie_weights and k == f"{HEAD}.weight"))
    missing = sorted(known - set(hf_state))
    for problem, names in (("unexpected", unknown), ("missing", missing)):
        if names:
            raise ValueError(f"{problem} weights for a {config.n_layers}-layer {layout.architecture}: "
                             f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    state: dict[str, Tensor] = {}
    experts: dict[str, list[Tensor]] = {}  # ours -> its experts' tensors, in order (as weight_map lists them)
    for w in weights:
        tensor = hf_state[w.hf].T if w.transpose else hf_state[w.hf]
        if w.expert is None:
            state.update(zip(w.ours, tensor.chunk(len(w.ours)), strict=True))
        else:
            experts.setdefault(w.ours[0], []).append(tensor)
    state.update({name: torch.stack(tensors) for name, tensors in experts.items()})  # (E, out, in)
    if config.tie_weights:
        state[f"{HEAD}.weight"] = state["token_embedding.weight"]
    return {**state, **layout.buffers(config)}


def state_to_hf(state: Mapping[str, Tensor], config: GPTConfig,
                layout: Layout | None = None) -> dict[str, Tensor]:
    """Our state dict in the Hugging Face layout's names (contiguous CPU tensors, each stored once).
    A buffer the layout has no tensor for must hold the value the layout implies (`Layout.buffers`)."""
    layout = layout or layout_for(config)
    for name, implied in layout.buffers(config).items():
        if not torch.equal(state[name].detach().cpu().to(implied.dtype), implied):
            value = "zero" if not implied.any() else f"{implied.tolist()!r:.80}"
            raise ValueError(f"{name} must be {value} for the {layout.architecture} layout, which has no "
                             "tensor for it: the model would not compute the same function there")
    tensors = {}
    for w in weight_map(config, layout):
        if w.expert is None:
            tensor = torch.cat([state[o].detach() for o in w.ours])  # (Σ out, in) or (Σ out,)
        else:
            tensor = state[w.ours[0]].detach()[w.expert]  # (out, in) of (E, out, in)
        tensors[w.hf] = (tensor.T if w.transpose else tensor).cpu().contiguous()
    return tensors


# ----------------------------------------------------------------------------- the directory

def gpt_config_to_hf(config: GPTConfig, tokenizer: Tokenizer | None = None, *,
                     dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of a GPT with this config (refused, naming the field, when no layout fits)."""
    layout = layout_for(config)
    special = {f"{role}_token_id": getattr(tokenizer, f"{role}_id", None) for role in ("bos", "eos", "pad")}
    return {"architectures": [layout.architecture], "model_type": layout.model_type,
            "dtype": str(dtype).removeprefix("torch."), **special, **layout.config_to_hf(config)}


def gpt_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """A GPTConfig from a GPT-2, Llama, Mistral, Qwen3 or Mixtral config.json."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError("config.json has no model_type: not a Hugging Face model directory (a plainformer "
                         "checkpoint loads with GPT.from_checkpoint or load_checkpoint)")
    if model_type not in LAYOUTS:
        raise ValueError(f"config.json describes a {model_type!r} model; a GPT loads from "
                         f"{' or '.join(map(repr, LAYOUTS))}")
    check_hf_sizes(hf)
    return GPTConfig.from_dict({**LAYOUTS[model_type].config_from_hf(hf), **overrides})


def _with_zero_biases(config: GPTConfig, state: Mapping[str, Tensor]) -> tuple[GPTConfig, dict[str, Tensor]]:
    """A GPT without biases (nanoGPT's bias=False) as the GPT-2 layout holds it, whose every linear
    layer and LayerNorm has a bias: zeros, which compute the same function."""
    with_biases = config.replace(bias=True)
    like = state["token_embedding.weight"]
    zeros = {name: torch.zeros(state[name.removesuffix(".bias") + ".weight"].shape[0], dtype=like.dtype)
             for w in weight_map(with_biases, GPT2) for name in w.ours if name.endswith(".bias")}
    return with_biases, {**state, **zeros}


def exported_state(model: GPT, tokenizer: Tokenizer | None) -> tuple[GPTConfig, dict[str, Tensor]]:
    """The config and weights a GPT is exported with: a vocabulary padded past the tokenizer's cropped to
    it (no id reaches those rows), and a GPT-2-layout model without biases given zero ones."""
    config, state = model.config, model.state_dict()
    if tokenizer is not None and tokenizer.vocab_size != config.vocab_size:
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                             f"vocab_size={config.vocab_size}")
        config = config.replace(vocab_size=tokenizer.vocab_size)  # why: padding rows no id reaches
        state = {k: v[:tokenizer.vocab_size] if k in ("token_embedding.weight", f"{HEAD}.weight") else v
                 for k, v in state.items()}
    if layout_for(config) is GPT2 and not config.bias:
        config, state = _with_zero_biases(config, state)
    return config, state


def write_gpt_directory(model: GPT, directory: str | os.PathLike, tokenizer: Tokenizer | None) -> Path:
    """config.json and model.safetensors of `model`, as `exported_state` exports it with `tokenizer`
    (which also gives config.json its special token ids), each file written atomically."""
    config, state = exported_state(model, tokenizer)
    hf_config = gpt_config_to_hf(config, tokenizer, dtype=model.token_embedding.weight.dtype)
    tensors = state_to_hf(state, config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / SAFETENSORS) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_hf_config(directory, hf_config)
    return directory


def read_gpt_directory(directory: Path, hf: Mapping[str, Any], *, backend: str = "auto") -> GPT:
    """The GPT (in eval mode) of a GPT-2, Llama, Mistral, Qwen3 or Mixtral directory whose config.json holds `hf`."""
    config = gpt_config_from_hf(hf, backend=backend)
    check_model_memory(config, "gpt")  # from config.json alone, before the weights are read
    weights = read_sharded_hf_weights(directory)
    _check_weights_fit(directory, config, weights)
    model = GPT(config)
    state = state_from_hf(weights, config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"the weights in {directory} do not fit its {HF_CONFIG}: {e}") from None
    return model.eval()


def _check_weights_fit(directory: Path, config: GPTConfig, weights: Mapping[str, Tensor]) -> None:
    """Refuse, before building anything, a config.json describing far more parameters than the weights
    hold (num_hidden_layers: 100000 beside a small model's weights); a weight or two missing is named
    later, by `state_from_hf`."""
    needed = GPT.footprint(config).parameters
    stored = sum(t.numel() for t in weights.values())
    if needed > 2 * stored:
        raise ValueError(f"{directory / HF_CONFIG} describes a model of {needed:,} parameters but its weights "
                         f"hold {stored:,} values: they do not belong together")

