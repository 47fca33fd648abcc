"""Low-rank adaptation, LoRA (Hu et al. 2021): fine-tune a frozen weight through a rank-r update.

For a frozen W (d_out, d_in):

    h = W x + (α / r) · B A x,        A (r, d_in), B (d_out, r), r ≪ min(d_in, d_out)

A starts Kaiming-uniform (a = √5, as torch.nn.Linear and PEFT), B at zero, so that training starts from the
base model exactly; dropout (optional) acts on x before A. Merging writes W ← W + (α / r) B A, so that the
adapted model costs nothing extra per token; unmerging subtracts it again.

`add_lora` swaps the chosen `Linear`s of a model for `LoRALinear`s that share their weight and bias (the
state dict keeps every base name and gains `NAME.lora_A`, `NAME.lora_B`), and freezes the rest;
`unload_lora` merges them and puts plain `Linear`s back. `LoRAConfig` holds add_lora's arguments, as a
fine-tuning run records them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config, checked, positive_int, positive_number, probability

#: The projections LoRA may adapt, by the name of their module: attention, feed-forward, the LM head.
TARGETS = ("W_q", "W_k", "W_v", "W_o", "W_1", "W_2", "W_3", "lm_head")


def _check_names(name: str, value: object, choices: Sequence[str] | None = None) -> None:
    if not isinstance(value, tuple) or not all(isinstance(item, str) and item for item in value):
        raise TypeError(f"{name} must be a tuple of names, got {value!r}")
    unknown = [item for item in value if choices is not None and item not in choices]
    if unknown:
        raise ValueError(f"{name}: {', '.join(map(repr, unknown))} are not LoRA targets; choose from "
                         f"{', '.join(choices or ())}")


def _check_targets(name: str, value: object) -> None:
    _check_names(name, value, TARGETS)
    if not value:
        raise ValueError(f"{name} must name at least one of {', '.join(TARGETS)}")


@dataclasses.dataclass
class LoRAConfig(Config):
    """`add_lora`'s arguments: rank r, α (the update is scaled by α / r), dropout on the input of A, the
    layers adapted (`targets`, of `TARGETS`) and the name patterns that stay trainable (a task head)."""

    r: int = positive_int(8)
    alpha: float = positive_number(16.0)
    dropout: float = probability(0.0)
    targets: tuple[str, ...] = checked(("W_q", "W_v"), _check_targets)
    trainable: tuple[str, ...] = checked((), _check_names)

    def __post_init__(self) -> None:
        # JSON gives lists; the config holds tuples, so that two equal configs compare equal.
        for name in ("targets", "trainable"):
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(self, name, tuple(value))
        super().__post_init__()


class LoRALinear(nn.Linear):
    """y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ: x (..., d_in) -> (..., d_out). W and b are the adapted
    layer's own parameters (frozen by `add_lora`); `lora_A` (r, d_in) and `lora_B` (d_out, r) train."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # shared: the base's names, values and ties
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout)
        self.merged = False

    def delta_weight(self) -> Tensor:
        """(α / r) B A, (d_out, d_in): what merging adds to W."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.merged:
            return y
        return y + self.scaling * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    @torch.no_grad()
    def merge(self) -> None:
        """W ← W + (α / r) B A, once: merging a merged layer changes nothing."""
        if not self.merged:
            self.weight += self.delta_weight().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W ← W − (α / r) B A, undoing `merge`; nothing when the layer is not merged."""
        if self.merged:
            self.weight -= self.delta_weight().to(self.weight.dtype)
            self.merged = False

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha:g}"


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: Sequence[str] = ("W_q", "W_v"), trainable: Iterable[str] = ()) -> nn.Module:
    """Adapt every linear layer of `model` whose name ends with one of `targets` (of `TARGETS`) with a
    rank-`r` LoRA, and freeze every other parameter but those whose name contains one of the `trainable`
    patterns ("norm", say). Returns `model`, changed in place.

    Refused with a ValueError: a target outside `TARGETS`, a target that matches no layer, the stacked
    expert weights of an MoE layer (one (E, d_ff, d) tensor, not a linear layer), a head tied to the
    token embedding (its update would change the embedding too), a model already adapted."""
    if isinstance(targets, str) or isinstance(trainable, str):
        raise TypeError(f"targets and trainable must be sequences of names, not the str {targets!r}")
    config = LoRAConfig(r=r, alpha=alpha, dropout=dropout, targets=tuple(targets), trainable=tuple(trainable))
    targets, trainable = config.targets, config.trainable
    if lora_layers(model):
        raise ValueError("the model already has LoRA layers; merge_lora or build it again before add_lora")
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and name.rpartition(".")[2] in targets]
    _refuse_stacked_experts(model, targets)
    if not chosen:
        raise ValueError(f"no linear layer of {type(model).__name__} is named {', '.join(targets)}")
    for name, layer in chosen:
        _refuse_tied(model, name, layer)
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, LoRALinear(layer, r, alpha, dropout))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in f".{name}" or any(pattern in name for pattern in trainable))
    return model


def _refuse_stacked_experts(model: nn.Module, targets: tuple[str, ...]) -> None:
    for name, _ in model.named_parameters():
        owner, _, attribute = name.rpartition(".")
        if attribute in targets and not isinstance(model.get_submodule(owner), nn.Linear):
            raise ValueError(f"{name} stacks the weights of every expert in one tensor; LoRA adapts linear "
                             "layers only: leave W_1, W_2, W_3 out of targets for an MoE model")


def _refuse_tied(model: nn.Module, name: str, layer: nn.Linear) -> None:
    others = [other for other, p in model.named_parameters(remove_duplicate=False)
              if p is layer.weight and not other.startswith(f"{name}.")]
    if others:
        raise ValueError(f"{name}.weight is tied to {others[0]} (tie_weights=True); LoRA on it would change "
                         f"that too: leave {name.rpartition('.')[2]} out of targets or untie the weights")


def unload_lora(model: nn.Module) -> nn.Module:
    """Merge every LoRA layer and put a plain `Linear` of the merged weight (and the bias) in its place:
    the model as Hugging Face or a state dict of the base names expects it. Returns `model`."""
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        layer.merge()
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, plain)
    return model


def refuse_lora_layers(model: nn.Module) -> None:
    """A ValueError naming the first LoRA layer of `model`, for what takes plain linear layers only
    (int8, prepacked weights)."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} is a LoRA layer: merge it into its weight first (pf.unload_lora)")


def adapter_state_names(model: nn.Module) -> list[str]:
    """The state-dict names a LoRA run saves: its trainable parameters and the persistent buffers
    (an MoE router's bias, which training updates); the frozen base weights stay with the base."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    buffers = {name for name, _ in model.named_buffers()}
    return [name for name in model.state_dict() if name in trainable or name in buffers]


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [module for module in model.modules() if isinstance(module, LoRALinear)]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every A and B of the model's LoRA layers, in module order: what an optimizer of LoRA trains."""
    return [p for layer in lora_layers(model) for p in (layer.lora_A, layer.lora_B)]


def merge_lora(model: nn.Module) -> nn.Module:
    """W ← W + (α / r) B A in every LoRA layer (idempotent); returns `model`."""
    for layer in lora_layers(model):
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo `merge_lora` in every LoRA layer; returns `model`."""
    for layer in lora_layers(model):
        layer.unmerge()
    return model
