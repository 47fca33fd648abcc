"""The optimizer and the learning-rate schedules.

One optimizer update t = 1, 2, ... (with G = grad_accum_steps micro-batches of loss ℓ_g):

    g_t = ∇ (1/G) Σ_g ℓ_g,   g_t ← g_t · min(1, c / ‖g_t‖)   (clipping at c = grad_clip)
    θ_t = AdamW(θ_{t-1}, g_t, lr_t)                           (no decay on biases, norms, embeddings)

Schedules (W = warmup_steps, T = decay_steps or max_steps):

    cosine        lr·t/W for t ≤ W, then min_lr + ½(lr − min_lr)(1 + cos(π (t − W)/(T − W))), min_lr after T
    constant      lr·t/W for t ≤ W, then lr
    inverse_sqrt  lr · d_model^−0.5 · min(t^−0.5, t · W^−1.5)   (Vaswani et al. 2017, eq. 3, when lr = 1)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import _checks
from .config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer update `step` = t (1-based; see the module docstring)."""
    _checks.check_positive_int("step", step)
    t, warmup = step, config.warmup_steps
    if config.schedule == "inverse_sqrt":
        return config.lr * config.schedule_d_model ** -0.5 * min(t ** -0.5, t * warmup ** -1.5)
    if t <= warmup:
        return config.lr * t / warmup
    if config.schedule == "constant":
        return config.lr
    horizon = config.decay_steps or config.max_steps
    progress = min(1.0, (t - warmup) / max(1, horizon - warmup))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed): matrices decay; biases, norm weights (ndim < 2) and the weights of
    nn.Embedding modules (also when tied to an output projection) do not."""
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or id(p) in embedding else decay).append(p)
    return decay, no_decay


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `parameter_groups(model)`. The fused kernel is used where torch has one (CPU, CUDA):
    on a 10.8M-parameter GPT-like model on this CPU one step takes 5.7 ms fused vs 32 ms foreach."""
    decay, no_decay = parameter_groups(model)
    groups = [{"params": params, "weight_decay": wd}
              for params, wd in ((decay, config.weight_decay), (no_decay, 0.0)) if params]
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                             fused=fused or None)
