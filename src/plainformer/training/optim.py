"""The optimizer and the learning-rate schedules.

One optimizer update t = 1, 2, ... (with G = grad_accum_steps micro-batches of loss ℓ_g):

    g_t = ∇ (1/G) Σ_g ℓ_g,   g_t ← g_t · min(1, c / ‖g_t‖)   (clipping at c = grad_clip)
    θ_t = AdamW(θ_{t-1}, g_t, lr_t)                           (no decay on biases, norms, embeddings)

With optimizer "muon" the blocks' matrices (the 2-D weights of nn.Linear modules inside an nn.ModuleList:
attention and feed-forward projections) take Muon instead (Jordan et al. 2024, `torch.optim.Muon`):

    B_t = μ B_{t-1} + (1 − μ) g_t,   O_t = NewtonSchulz5((1 − μ) g_t + μ B_t) ≈ U Vᵀ   (Nesterov, μ = 0.95)
    θ_t = (1 − η_t λ) θ_{t-1} − η_t √max(1, A/B) O_t                              (θ: A × B, λ = weight_decay)

at η_t = lr_t · muon_lr / lr (the same schedule, peak muon_lr); embeddings, the output head, norms and
biases stay with AdamW, as in the modded-nanoGPT speedruns. Newton–Schulz runs once per group of
same-shaped matrices (`BatchedMuon`), in bfloat16 as in torch's Muon where bf16 matmuls are native (a CPU
with AMX, a CUDA device with bf16), in float32 elsewhere, where bf16 would multiply at about half the rate
(or, on an AVX2-only CPU, a hundredth), and in float64 for a float64 model.

Schedules (W = warmup_steps, T = decay_steps or max_steps):

    cosine        lr·t/W for t ≤ W, then min_lr + ½(lr − min_lr)(1 + cos(π (t − W)/(T − W))), min_lr after T
    linear        lr·t/W for t ≤ W, then lr − (lr − min_lr)(t − W)/(T − W), min_lr after T (to zero with
                  min_lr 0: Bergsma et al. 2025, "Straight to Zero")
    constant      lr·t/W for t ≤ W, then lr
    inverse_sqrt  lr · d_model^−0.5 · min(t^−0.5, t · W^−1.5)   (Vaswani et al. 2017, eq. 3, when lr = 1)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .. import _checks
from ..memory import block_matrices
from .config import TrainConfig
from .precision import native_bf16


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer update `step` = t (1-based; see the module docstring)."""
    _checks.check_positive_int("step", step)
    t, warmup = step, config.warmup_steps
    if config.schedule == "inverse_sqrt":
        assert config.schedule_d_model is not None  # TrainConfig requires it for this schedule
        return config.lr * config.schedule_d_model ** -0.5 * min(t ** -0.5, t * warmup ** -1.5)
    if t <= warmup:
        return config.lr * t / warmup
    if config.schedule == "constant":
        return config.lr
    horizon = config.decay_steps or config.max_steps
    progress = min(1.0, (t - warmup) / max(1, horizon - warmup))
    if config.schedule == "linear":
        return config.lr - (config.lr - config.min_lr) * progress
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed): matrices decay; biases, norm weights (ndim < 2) and the weights of
    nn.Embedding modules (also when tied to an output projection) do not."""
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or id(p) in embedding else decay).append(p)
    return decay, no_decay


def muon_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The hidden matrices Muon trains: 2-D weights of nn.Linear modules that sit inside an
    nn.ModuleList (the blocks), never an embedding (so not a head tied to one): `block_matrices`, which
    the memory estimates count."""
    return block_matrices(model)


def _adamw(groups: list[dict[str, Any]], config: TrainConfig) -> torch.optim.AdamW:
    """The fused kernel is used where torch has one (CPU, CUDA): on the CPU its step is several times
    faster than foreach's (measured: docs/performance.md, "Choices inside the code")."""
    params = [p for g in groups for p in g["params"]]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                             fused=fused or None)


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW | MuonWithAdamW:
    """AdamW over `parameter_groups(model)`; with `config.optimizer == "muon"`, Muon over
    `muon_parameters(model)` and AdamW over the rest (see the module docstring)."""
    hidden = {id(p) for p in muon_parameters(model)} if config.optimizer == "muon" else set()
    if config.optimizer == "muon" and not hidden:
        raise ValueError(f"optimizer 'muon' trains the 2-D weights of nn.Linear modules inside an "
                         f"nn.ModuleList (the blocks); {type(model).__name__} has none: use 'adamw'")
    decay, no_decay = parameter_groups(model)
    groups = [{"params": params, "weight_decay": wd}
              for params, wd in (([p for p in decay if id(p) not in hidden], config.weight_decay),
                                 (no_decay, 0.0)) if params]
    if not groups and not hidden:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    if not hidden:
        return _adamw(groups, config)
    muon = BatchedMuon([p for p in decay if id(p) in hidden], lr=config.muon_lr, weight_decay=config.weight_decay,
                       ns_dtype=newton_schulz_dtype(next(model.parameters())))
    for group in muon.param_groups:
        group["lr_scale"] = config.muon_lr / config.lr
    return MuonWithAdamW(muon, _adamw(groups, config) if groups else None)


def newton_schulz_dtype(parameter: torch.Tensor) -> torch.dtype:
    """bfloat16 (torch's Muon) where the parameter's device multiplies it natively, float32 elsewhere, and
    float64 for a float64 model: such a model is a reference run, whose every step must stay in float64."""
    if parameter.dtype == torch.float64:
        return torch.float64
    native, _ = native_bf16(parameter.device)
    return torch.bfloat16 if native else torch.float32


class BatchedMuon(torch.optim.Muon):
    """`torch.optim.Muon`, with the Newton–Schulz iteration run once per group of same-shaped matrices
    (a batch of k × A × B in `torch.baddbmm`) instead of once per matrix, in `ns_dtype`.

    The update is torch's (momentum, Nesterov, NewtonSchulz5, decoupled weight decay, the √max(1, A/B)
    rate), and with ns_dtype bfloat16 (torch's) bit for bit; its state and state dict are torch's, so
    checkpoints do not tell them apart. On CPU the per-matrix products are small: at the default preset's
    28 matrices (16 of 256 × 256, 12 of 688 × 256) the iteration takes about half the time batched.
    Without AMX the iteration (half as much arithmetic as the forward and backward at the default preset:
    docs/performance.md, "Choices inside the code") runs in float32: bf16 matmuls ran at about half the
    fp32 rate on a Xeon without AMX and are emulated on AVX2 (docs/experiments.md, "The dtype"). Under
    FSDP the parameters are DTensor shards of their matrices, and the same code runs on them: DTensor stacks
    them, gathers what the products need, and returns each update sharded like its parameter.
    """

    def __init__(self, params: Any, *args: Any, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            by_shape: dict[tuple[Any, ...], list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((p.shape, p.dtype, p.device, getattr(p, "placements", None)), []).append(i)
            for indices in by_shape.values():
                self._update([params[i] for i in indices], [grads[i] for i in indices],
                             [buffers[i] for i in indices], group)
        return loss

    def _update(self, params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor],
                group: dict[str, Any]) -> None:
        """One Muon step for same-shaped matrices θ (A × B), with their gradients and momenta."""
        momentum, lr = group["momentum"], float(group["lr"])
        torch._foreach_lerp_(buffers, grads, 1 - momentum)  # B_t = μ B_{t-1} + (1 − μ) g_t
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        orthogonal = newton_schulz(torch.stack(updates), group["ns_coefficients"], group["ns_steps"],
                                   group["eps"], self.ns_dtype)
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        rate = lr * _muon_rate_ratio(group["adjust_lr_fn"], *params[0].shape)
        torch._foreach_add_(params, list(orthogonal.unbind(0)), alpha=-rate)


def _muon_rate_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch's Muon rate per matrix shape: √max(1, A/B) ("original", the default), 0.2·√max(A, B)
    ("match_rms_adamw", Moonshot's), or 1."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NewtonSchulz5 of each matrix in (k, A, B), in `dtype` (torch's Muon: bfloat16), as torch computes it:

        X ← G / ‖G‖_F (on the short side: Gᵀ when A > B),   then `steps` times
        X ← a X + (b M + c M²) X,   M = X Xᵀ

    which drives the singular values of X towards 1 (U Vᵀ of the SVD G = U Σ Vᵀ, approximately).
    """
    a, b, c = coefficients
    tall = updates.shape[-2] > updates.shape[-1]
    x = updates.to(dtype)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # (k, A, A)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def set_lr(optimizer: torch.optim.Optimizer | MuonWithAdamW, lr: float) -> None:
    """Set every param group's rate to `lr`, times the group's `lr_scale` (Muon's) where it has one."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


class MuonWithAdamW:
    """Muon and AdamW stepped as one optimizer. `param_groups` and `state_dict` are AdamW's then
    Muon's, numbered as one torch optimizer would number them, so a checkpoint saves and restores
    both like any single optimizer."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW | None):
        self.optimizers = [o for o in (adamw, muon) if o is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for optimizer in self.optimizers:
            own = optimizer.state_dict()
            state.update({offset + i: s for i, s in own["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in own["param_groups"]]
            offset += sum(len(g["params"]) for g in optimizer.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict` returned; the Muon rate scale stays this run's (muon_lr / lr)."""
        scales = [g.get("lr_scale") for g in self.param_groups]
        groups, offset = iter(state_dict["param_groups"]), 0
        for optimizer in self.optimizers:
            own = [next(groups) for _ in optimizer.param_groups]
            indices = [i for g in own for i in g["params"]]
            optimizer.load_state_dict({
                "state": {i - offset: state_dict["state"][i] for i in indices if i in state_dict["state"]},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in own]})
            offset += len(indices)
        for group, scale in zip(self.param_groups, scales, strict=True):
            if scale is not None:
                group["lr_scale"] = scale
