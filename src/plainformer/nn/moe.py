"""Mixture-of-Experts feed-forward layer (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral 2024).

Per token x (d_model), with E experts FFN_e and K = top_k of them active:

    s = x W_rᵀ                               router logits (E,), W_r: (E, d_model), no bias
    p = softmax(s)   or   p = sigmoid(s)     scores (DeepSeek-V3 uses sigmoid)
    T_K = top-K indices of p + b             b: aux-loss-free balancing bias, only chooses experts
    g_e = p_e / Σ_{j ∈ T_K} p_j              gate weights (renormalised when normalize_top_k)
    y = Σ_{e ∈ T_K} g_e · FFN_e(x)  (+ FFN_shared(x))
    FFN_e(x) = (SiLU(x W_1[e]ᵀ) ⊙ x W_3[e]ᵀ) W_2[e]ᵀ      SwiGLU, as `FeedForward(activation="swiglu")`

Balancing:
    L_aux = E · Σ_i f_i · P_i   f_i: fraction of tokens with a slot on expert i (Σ_i f_i = K),
                                P_i: mean softmax probability of i; = K under uniform routing
    L_z   = mean_t (logsumexp_i s_{t,i})²                 router z-loss (ST-MoE, Zoph et al. 2022)
    b_i ← b_i + u · sign(mean_j load_j − load_i), then b ← b − mean(b), once per optimizer step
                                (aux-loss-free balancing, Wang et al. 2024, arXiv 2408.15664)
    capacity: each expert takes at most ⌈cf · T · K / E⌉ of the T·K slots, first come first served
    in token order; the overflow is dropped (its gate contributes nothing) and counted.

Dispatch: the T·K (token, expert) slots are sorted by expert with a stable argsort, so each expert's
tokens are one contiguous slice; one matmul per expert runs over its slice, the gates are applied in
fp32, and `index_add` sums the slots back into their tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .. import _checks
from .dtypes import at_least_float32
from .feedforward import FeedForward

SCORES = ("softmax", "sigmoid")


def load_balancing_loss(router_logits: Tensor, top_k: int) -> Tensor:
    """L_aux = E · Σ_i f_i · P_i (Switch / Mixtral convention) from router_logits (T, E) -> scalar.

    f_i = (tokens with one of their top_k slots on expert i) / T, P_i = mean_t softmax(s_t)_i.
    Only P carries a gradient. Equals top_k when the routing is uniform.
    """
    _checks.check_tensor("router_logits", router_logits, ndim=2, shape_doc="(T, E)")
    n_experts = router_logits.shape[1]
    _checks.check_positive_int("top_k", top_k)
    if top_k > n_experts:
        raise ValueError(f"top_k must be at most the number of experts {n_experts}, got {top_k}")
    return _load_balancing_loss(router_logits, top_k)


def _load_balancing_loss(router_logits: Tensor, top_k: int) -> Tensor:
    n_experts = router_logits.shape[1]
    probs = torch.softmax(at_least_float32(router_logits), dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices  # (T, K)
    f = expert_counts(chosen, n_experts).float() / router_logits.shape[0]  # (E,)
    return n_experts * (f * probs.mean(dim=0)).sum()


def expert_counts(experts: Tensor, n_experts: int) -> Tensor:
    """How often each of the n_experts ids occurs in `experts` (any shape) -> (E,) int64. torch.bincount
    would read the largest id on the host first (a CUDA sync); a scatter-add needs no host value."""
    ids = experts.flatten()
    return torch.zeros(n_experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def router_z_loss(router_logits: Tensor) -> Tensor:
    """L_z = mean_t (logsumexp_i s_{t,i})² from router_logits (T, E) -> scalar, in fp32 or wider."""
    _checks.check_tensor("router_logits", router_logits, ndim=2, shape_doc="(T, E)")
    return _router_z_loss(router_logits)


def _router_z_loss(router_logits: Tensor) -> Tensor:
    return torch.logsumexp(at_least_float32(router_logits), dim=-1).square().mean()


class _SwiGLUExperts(torch.autograd.Function):
    """ys[slice_e] = (SiLU(xs W_1[e]ᵀ) ⊙ xs W_3[e]ᵀ ⊙ keep) W_2[e]ᵀ for the contiguous slice of each expert.

    xs (S, d_model) holds the slots sorted by expert, counts[e] of them for expert e; keep (S, d_ff) is
    the dropout mask (already scaled by 1/(1-p)) or None. One autograd node with a hand-written
    backward: each expert's matmuls write into row slices of preallocated contiguous tensors, so there
    is no per-expert autograd bookkeeping, concatenation or strided elementwise pass. With
    g = xs W_1ᵀ, u = xs W_3ᵀ and a = SiLU(g) ⊙ u ⊙ keep (g, u, SiLU(g) and a saved for the backward):
        da = dy W_2,  dW_2 = dyᵀ a,  dg = SiLU'(g) ⊙ da ⊙ keep ⊙ u,  du = da ⊙ keep ⊙ SiLU(g),
        dxs = dg W_1 + du W_3,  dW_1 = dgᵀ xs,  dW_3 = duᵀ xs                (per expert slice)
    """

    @staticmethod
    def forward(ctx, xs: Tensor, W_1: Tensor, W_3: Tensor, W_2: Tensor, counts: list[int],
                keep: Tensor | None) -> Tensor:
        gate = xs.new_empty(xs.shape[0], W_1.shape[1])  # (S, d_ff)
        up = torch.empty_like(gate)
        for e, rows in _expert_slices(counts):
            torch.mm(xs[rows], W_1[e].t(), out=gate[rows])
            torch.mm(xs[rows], W_3[e].t(), out=up[rows])
        silu = F.silu(gate)
        a = silu * up if keep is None else silu * up * keep  # (S, d_ff)
        ys = torch.empty_like(xs)  # (S, d_model)
        for e, rows in _expert_slices(counts):
            torch.mm(a[rows], W_2[e].t(), out=ys[rows])
        ctx.save_for_backward(xs, W_1, W_3, W_2, gate, up, silu, a, keep)
        ctx.counts = counts
        return ys

    @staticmethod
    @once_differentiable
    def backward(ctx, dys: Tensor):
        xs, W_1, W_3, W_2, gate, up, silu, a, keep = ctx.saved_tensors
        counts = ctx.counts
        dys = dys.contiguous()
        da = torch.empty_like(a)  # (S, d_ff)
        dW_1, dW_3, dW_2 = (torch.zeros_like(W) for W in (W_1, W_3, W_2))  # empty experts: zero gradient
        for e, rows in _expert_slices(counts):
            torch.mm(dys[rows], W_2[e], out=da[rows])
            torch.mm(dys[rows].t(), a[rows], out=dW_2[e])
        if keep is not None:
            da = da * keep
        dgate = torch.ops.aten.silu_backward(da * up, gate)  # (S, d_ff)
        dup = da.mul_(silu)
        dxs = torch.empty_like(xs)
        for e, rows in _expert_slices(counts):
            torch.mm(dgate[rows], W_1[e], out=dxs[rows])
            dxs[rows].addmm_(dup[rows], W_3[e])
            torch.mm(dgate[rows].t(), xs[rows], out=dW_1[e])
            torch.mm(dup[rows].t(), xs[rows], out=dW_3[e])
        return dxs, dW_1, dW_3, dW_2, None, None


def _inverse_permutation(order: Tensor) -> Tensor:
    """inverse[order[s]] = s, by one scatter instead of a second sort."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _to_slots(x: Tensor, tokens: Tensor) -> Tensor:
    """Dispatch D: x (T, d) -> (S, d), row s = x[tokens[s]]."""
    return x.index_select(0, tokens)


def _to_tokens(y: Tensor, tokens: Tensor, inverse: Tensor | None, n_tokens: int) -> Tensor:
    """Its transpose Dᵀ: y (S, d) -> (T, d), each token the sum of its slots.

    Dropless, the sorted slots are a permutation of the T·K slots t·K + k, so Dᵀ is a gather by the
    inverse permutation and a sum over k (no scatter); with dropped slots it is an index_add.
    """
    if inverse is None:
        return y.new_zeros(n_tokens, y.shape[1]).index_add_(0, tokens, y)
    return y.index_select(0, inverse).view(n_tokens, -1, y.shape[1]).sum(dim=1)


class _Dispatch(torch.autograd.Function):
    """xs = D x (to the expert-sorted slots); backward Dᵀ, a gather when dropless."""

    @staticmethod
    def forward(ctx, x: Tensor, tokens: Tensor, inverse: Tensor | None) -> Tensor:
        ctx.save_for_backward(tokens, inverse)
        ctx.n_tokens = x.shape[0]
        return _to_slots(x, tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        tokens, inverse = ctx.saved_tensors
        return _to_tokens(grad, tokens, inverse, ctx.n_tokens), None, None


class _Combine(torch.autograd.Function):
    """y = Dᵀ ys (slots summed into their tokens); backward D."""

    @staticmethod
    def forward(ctx, ys: Tensor, tokens: Tensor, inverse: Tensor | None, n_tokens: int) -> Tensor:
        ctx.save_for_backward(tokens)
        return _to_tokens(ys, tokens, inverse, n_tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (tokens,) = ctx.saved_tensors
        return _to_slots(grad.contiguous(), tokens), None, None, None


def _expert_slices(counts: list[int]):
    """(expert, row slice) for every expert with at least one slot, in expert order."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


class MoEFeedForward(nn.Module):
    """Top-K routed SwiGLU experts, with optional shared experts: (B, n, d_model) -> (B, n, d_model).

    Parameters: `router` (Linear d_model -> E, no bias), `W_1`, `W_3` (E, d_ff, d_model), `W_2`
    (E, d_model, d_ff), and `shared`, one SwiGLU `FeedForward` of width n_shared_experts · d_ff (the
    sum of n_shared_experts SwiGLU experts of width d_ff is one SwiGLU of the concatenated width).
    Buffer: `expert_bias` (E,), the aux-loss-free balancing bias b, saved in the state dict.

    After each forward the layer keeps `router_logits` (T, E) for the model's L_aux and L_z. In
    training mode it also adds the slots per expert to `step_load` (E,) and the dropped slots to
    `step_dropped`, summed over the micro-batches of an optimizer step until `update_bias()`.

    One host synchronisation per forward: the per-expert slot counts are read once with `.tolist()`,
    because the slices of the dispatch need their sizes on the host. validate_args=False skips the
    checks of the arguments and of forward's input (see `MultiHeadAttention`): a GPT's config
    checked the former, its block makes the latter.
    """

    expert_bias: Tensor  # (E,) buffers
    step_load: Tensor

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, *, n_shared_experts: int = 0,
                 score: str = "softmax", normalize_top_k: bool = True, capacity_factor: float | None = None,
                 bias_update_rate: float = 0.0, dropout: float = 0.0, validate_args: bool = True):
        super().__init__()
        if validate_args:
            for name, value in (("d_model", d_model), ("d_ff", d_ff), ("n_experts", n_experts), ("top_k", top_k)):
                _checks.check_positive_int(name, value)
            if top_k > n_experts:
                raise ValueError(f"top_k must be at most n_experts={n_experts}, got {top_k}")
            _checks.check_non_negative_int("n_shared_experts", n_shared_experts)
            _checks.check_choice("score", score, SCORES)
            if capacity_factor is not None:
                _checks.check_positive_number("capacity_factor", capacity_factor)
            _checks.check_non_negative_number("bias_update_rate", bias_update_rate)
            _checks.check_probability("dropout", dropout)
        self.validate_args = validate_args
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.normalize_top_k = normalize_top_k
        self.capacity_factor = capacity_factor
        self.bias_update_rate = float(bias_update_rate)
        self.dropout = dropout
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.W_1 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.W_3 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.W_2 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.shared = (FeedForward(d_model, n_shared_experts * d_ff, "swiglu", dropout, bias=False,
                                   validate_args=False) if n_shared_experts else None)
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        # An integer count, so that casting the model to half precision cannot round it.
        self.register_buffer("step_load", torch.zeros(n_experts, dtype=torch.long), persistent=False)
        self.step_dropped = 0
        self.router_logits: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised as an `nn.Linear` of its shape would be: U(±1/√fan_in)."""
        for weight in (self.W_1, self.W_3, self.W_2):
            bound = 1 / math.sqrt(weight.shape[2])
            nn.init.uniform_(weight, -bound, bound)

    @property
    def d_model(self) -> int:
        return self.W_1.shape[2]

    def capacity(self, n_tokens: int) -> int | None:
        """⌈cf · T · K / E⌉ slots per expert for T tokens, or None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """router_logits (T, E) -> chosen experts (T, K) and their gates g (T, K), in fp32 or wider.

        The choice needs no gradient; the gates are computed from the K chosen logits only, which is
        exact: softmax renormalised over the top K is softmax(s_topK), and without renormalisation
        p_e = exp(s_e − logsumexp(s)). This keeps the (T, E) softmax out of the autograd graph.
        """
        logits = at_least_float32(router_logits)
        with torch.no_grad():
            scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)  # (T, E)
            experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices  # (T, K)
        chosen = logits.gather(1, experts)  # (T, K)
        if self.score == "sigmoid":
            gates = torch.sigmoid(chosen)
            return experts, gates / gates.sum(dim=-1, keepdim=True) if self.normalize_top_k else gates
        if self.normalize_top_k:
            return experts, torch.softmax(chosen, dim=-1)
        return experts, torch.exp(chosen - torch.logsumexp(logits, dim=-1, keepdim=True))

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, n, d_model) -> (B, n, d_model)."""
        if self.validate_args:  # called on its own; in a model's block x is the block's own
            _checks.check_tensor("x", x)
            _checks.check_last_dim("x", x, self.d_model, "d_model")
        flat = x.reshape(-1, x.shape[-1])  # (T, d_model)
        logits = self.router(flat)  # (T, E)
        self.router_logits = logits
        experts, gates = self.route(logits)  # (T, K), (T, K)
        slot_expert = experts.flatten()  # (T·K,), slot t·K + k
        order = torch.argsort(slot_expert, stable=True)  # slots grouped by expert, token order within
        loads = expert_counts(slot_expert, self.n_experts)  # (E,)
        counts = loads.tolist()  # the one host sync: slice sizes
        order, counts, dropped = self._apply_capacity(order, counts, flat.shape[0])
        if self.training:
            with torch.no_grad():
                self.step_load += loads
            self.step_dropped += dropped
        tokens = order // self.top_k  # (S,) the token of each kept slot
        inverse = None if dropped else _inverse_permutation(order)  # slot t·K + k -> its sorted position
        # Under autocast the experts run in its dtype, as an nn.Linear would; the gates stay fp32.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        keep = None
        if self.training and self.dropout > 0:
            keep = torch.empty(order.shape[0], self.W_1.shape[1], dtype=dtype, device=x.device)
            keep.bernoulli_(1 - self.dropout).div_(1 - self.dropout)
        xs = _Dispatch.apply(flat.to(dtype), tokens, inverse)  # (S, d_model)
        with torch.autocast(device, enabled=False):
            ys = _SwiGLUExperts.apply(xs, self.W_1.to(dtype), self.W_3.to(dtype), self.W_2.to(dtype),
                                      counts, keep)  # (S, d_model)
        weighted = ys.to(gates.dtype) * gates.flatten()[order].unsqueeze(1)  # (S, d_model), gates in fp32+
        out = _Combine.apply(weighted, tokens, inverse, flat.shape[0]).to(x.dtype).reshape(x.shape)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def _apply_capacity(self, order: Tensor, counts: list[int], n_tokens: int) -> tuple[Tensor, list[int], int]:
        """Keep the first `capacity` slots of each expert: (sorted slots, counts, dropped slot count)."""
        capacity = self.capacity(n_tokens)
        if capacity is None or max(counts) <= capacity:
            return order, counts, 0
        kept = [min(count, capacity) for count in counts]
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        order = torch.cat([order[start:start + k] for start, k in zip(starts, kept, strict=True)])
        return order, kept, sum(counts) - sum(kept)

    def __getstate__(self) -> dict:
        # Why: the last logits are part of an autograd graph, which copy.deepcopy and pickle refuse.
        return {**self.__dict__, "router_logits": None}

    def aux_losses(self) -> tuple[Tensor, Tensor]:
        """(L_aux, L_z) of the last forward's router logits (its own: nothing to check)."""
        if self.router_logits is None:
            raise RuntimeError("aux_losses() needs a forward pass first")
        return _load_balancing_loss(self.router_logits, self.top_k), _router_z_loss(self.router_logits)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Once per optimizer step: b_i += u · sign(mean load − load_i), b -= mean(b); reset step stats."""
        if self.bias_update_rate > 0:
            load = self.step_load.to(self.expert_bias.dtype)
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
            self.expert_bias -= self.expert_bias.mean()
        self.step_load.zero_()
        self.step_dropped = 0


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE layers of a model, in module order."""
    return [module for module in model.modules() if isinstance(module, MoEFeedForward)]


def mean_router_losses(layers: list[MoEFeedForward]) -> tuple[Tensor, Tensor]:
    """(mean_l L_aux, mean_l L_z) over the layers' last forward."""
    losses = [layer.aux_losses() for layer in layers]
    return (torch.stack([aux for aux, _ in losses]).mean(), torch.stack([z for _, z in losses]).mean())
