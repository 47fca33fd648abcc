"""FlashAttention-2 as Triton kernels, with the semantics of `plainformer.nn.flash`.

Same equations (see plainformer/flash.py), one Triton program per tile row instead of a Python loop:

- forward: a program per (query block Q_i, batch · head) walks the key blocks K_j, V_j with the
  online softmax (m, l, O) and writes O and L = m + log l;
- backward, recomputing P = exp(s · Q_i K_jᵀ - L) tile by tile:
  a program per (key block, batch · key/value head) accumulates dV_j = Σ Pᵀ dO_i and
  dK_j = s · Σ dSᵀ Q_i over every query block of the G query heads sharing that key/value head
  (so no atomics), and a program per (query block, batch · head) accumulates dQ_i = s · Σ dS K_j,
  with dS = P ∘ (dO_i V_jᵀ - D) and D = rowsum(dO ∘ O) (minus dL), computed by torch beforehand.

Causal is top-left aligned (query i sees keys j <= i); key blocks entirely in the causal future are
never visited. Rows that see no key get O = 0, L = -inf and zero gradients. Matmuls run with
input_precision="ieee" so that fp32 stays exact (no TF32); fp16/bf16 use the tensor cores with fp32
accumulation. This module needs triton (the optional extra `plainformer[triton]`); it runs on CUDA
tensors, and on CPU tensors under the interpreter (TRITON_INTERPRET=1 set before importing triton).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _checks

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q: Tensor, v: Tensor) -> bool:
    """Whether the kernels handle these inputs (else plainformer.nn.flash uses plain PyTorch)."""
    return q.dtype in _DTYPES and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM


@triton.jit
def _keep(offs_m, offs_n, n, m, pad_ptr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask: query offs_m exists and may attend key offs_n."""
    keep = (offs_m < n)[:, None] & (offs_n < m)[None, :]
    if HAS_PAD:
        real = tl.load(pad_ptr + offs_n, mask=offs_n < m, other=0)
        keep = keep & (real != 0)[None, :]
    if IS_CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


@triton.jit
def _load_tile(ptr, offs_rows, stride_row, n_rows, offs_cols, n_cols):
    """A (rows, cols) tile of a row-major matrix with column stride 1, zero outside."""
    mask = (offs_rows < n_rows)[:, None] & (offs_cols < n_cols)[None, :]
    return tl.load(ptr + offs_rows[:, None] * stride_row + offs_cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, value, offs_rows, stride_row, n_rows, offs_cols, n_cols):
    mask = (offs_rows < n_rows)[:, None] & (offs_cols < n_cols)[None, :]
    tl.store(ptr + offs_rows[:, None] * stride_row + offs_cols[None, :],
             value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _query_program(H, G, BLOCK_M: tl.constexpr):
    """This program's query block: (block index, its rows, flat b·H + h, b, flat b·H_kv + h_kv)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    bhk = b * (H // G) + (bh % H) // G
    return pid_m, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), bh, b, bhk


@triton.jit
def _load_query_rows(Q, DO, L2, D, bh, offs_m, n, d, dv, offs_d, offs_dv):
    """Q_i, dO_i, L₂ (+inf past the end, so P = 0 there) and D of one query block of head bh."""
    q = _load_tile(Q + bh * n * d, offs_m, d, n, offs_d, d)
    do = _load_tile(DO + bh * n * dv, offs_m, dv, n, offs_dv, dv)
    lse2 = tl.load(L2 + bh * n + offs_m, mask=offs_m < n, other=float("inf"))
    delta = tl.load(D + bh * n + offs_m, mask=offs_m < n, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _forward_kernel(Q, K, V, O, L, PAD, n, m, H, G, d, dv, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    pid_m, offs_m, bh, b, bhk = _query_program(H, G, BLOCK_M)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + bh * n * d, offs_m, d, n, offs_d, d)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    end = tl.minimum(m, (pid_m + 1) * BLOCK_M) if IS_CAUSAL else m
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K + bhk * m * d, offs_n, d, m, offs_d, d)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        scores = tl.where(_keep(offs_m, offs_n, n, m, PAD + b * m, IS_CAUSAL, HAS_PAD),
                          scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(row_max - shift)
        row_sum = row_sum * correction + tl.sum(probs, 1)
        v = _load_tile(V + bhk * m * dv, offs_n, dv, m, offs_dv, dv)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        row_max = new_max
    safe_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    _store_tile(O + bh * n * dv, acc / safe_sum[:, None], offs_m, dv, n, offs_dv, dv)
    tl.store(L + bh * n + offs_m, (row_max + tl.log2(safe_sum)) * 0.6931471805599453,
             mask=offs_m < n)


@triton.jit
def _probs_and_dscores(q, k, v, do, lse2, delta, offs_m, offs_n, n, m, pad_ptr, qk_scale,
                       IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """Recompute one tile: P = 2^(S₂ - L₂) and dS = P ∘ (dO Vᵀ - D), both (BLOCK_M, BLOCK_N)."""
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    keep = _keep(offs_m, offs_n, n, m, pad_ptr, IS_CAUSAL, HAS_PAD)
    probs = tl.where(keep, tl.exp2(scores - lse2[:, None]), 0.0)
    dprobs = tl.dot(do, tl.trans(v), input_precision="ieee")
    return probs, probs * (dprobs - delta[:, None])


@triton.jit
def _dkdv_kernel(Q, K, V, DO, L2, D, DK, DV, PAD, n, m, H, G, d, dv, qk_scale, scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)
    n_kv_heads = H // G
    b, hk = bhk // n_kv_heads, bhk % n_kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = _load_tile(K + bhk * m * d, offs_n, d, m, offs_d, d)
    v = _load_tile(V + bhk * m * dv, offs_n, dv, m, offs_dv, dv)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # Query blocks that end before this key block starts see none of it under the causal mask.
    start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if IS_CAUSAL else 0
    for g in range(G):
        bh = b * H + hk * G + g
        for start_m in range(start, n, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q, do, lse2, delta = _load_query_rows(Q, DO, L2, D, bh, offs_m, n, d, dv, offs_d,
                                                  offs_dv)
            probs, dscores = _probs_and_dscores(q, k, v, do, lse2, delta, offs_m, offs_n, n, m,
                                                PAD + b * m, qk_scale, IS_CAUSAL, HAS_PAD)
            dv_acc += tl.dot(tl.trans(probs).to(do.dtype), do, input_precision="ieee")
            dk += tl.dot(tl.trans(dscores).to(q.dtype), q, input_precision="ieee")
    _store_tile(DK + bhk * m * d, dk * scale, offs_n, d, m, offs_d, d)
    _store_tile(DV + bhk * m * dv, dv_acc, offs_n, dv, m, offs_dv, dv)


@triton.jit
def _dq_kernel(Q, K, V, DO, L2, D, DQ, PAD, n, m, H, G, d, dv, qk_scale, scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    pid_m, offs_m, bh, b, bhk = _query_program(H, G, BLOCK_M)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q, do, lse2, delta = _load_query_rows(Q, DO, L2, D, bh, offs_m, n, d, dv, offs_d, offs_dv)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(m, (pid_m + 1) * BLOCK_M) if IS_CAUSAL else m
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K + bhk * m * d, offs_n, d, m, offs_d, d)
        v = _load_tile(V + bhk * m * dv, offs_n, dv, m, offs_dv, dv)
        _, dscores = _probs_and_dscores(q, k, v, do, lse2, delta, offs_m, offs_n, n, m,
                                        PAD + b * m, qk_scale, IS_CAUSAL, HAS_PAD)
        dq += tl.dot(dscores.to(k.dtype), k, input_precision="ieee")
    _store_tile(DQ + bh * n * d, dq * scale, offs_m, d, n, offs_d, d)


def _check_block(name: str, size: int | None, default: int) -> int:
    if size is None:
        return default
    if not _checks.is_int(size) or size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernel, got {size!r}")
    return size


class _Launch:
    """Shapes, tiles and flags shared by the three kernel launches of one call."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                 is_causal: bool, scale: float, block_q: int, block_k: int):
        self.batch, self.heads, self.n, self.d = q.shape
        self.kv_heads, self.m, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.is_causal, self.scale = is_causal, scale
        self.block_q, self.block_k = block_q, block_k
        self.pad = q if key_padding_mask is None else key_padding_mask.to(torch.int8).contiguous()
        self.has_pad = key_padding_mask is not None

    def sizes(self) -> tuple:
        return (self.n, self.m, self.heads, self.heads // self.kv_heads, self.d, self.dv)

    def meta(self) -> dict:
        return dict(BLOCK_M=self.block_q, BLOCK_N=self.block_k,
                    BLOCK_D=max(16, triton.next_power_of_2(self.d)),
                    BLOCK_DV=max(16, triton.next_power_of_2(self.dv)),
                    IS_CAUSAL=self.is_causal, HAS_PAD=self.has_pad)

    def query_grid(self) -> tuple[int, int]:
        return (triton.cdiv(self.n, self.block_q), self.batch * self.heads)

    def key_grid(self) -> tuple[int, int]:
        return (triton.cdiv(self.m, self.block_k), self.batch * self.kv_heads)


class _TritonFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                is_causal: bool, scale: float, block_q: int, block_k: int) -> tuple[Tensor, Tensor]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        launch = _Launch(q, k, v, key_padding_mask, is_causal, scale, block_q, block_k)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        _forward_kernel[launch.query_grid()](q, k, v, out, lse, launch.pad, *launch.sizes(),
                                             scale * LOG2E, **launch.meta())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.launch = launch
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        launch = ctx.launch
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(dim=-1)  # D = rowsum(dO ∘ O), (B, H, n)
        if grad_lse is not None:
            delta -= grad_lse.float()
        lse2 = (lse * LOG2E).masked_fill(torch.isneginf(lse), float("inf"))  # P = 0 in empty rows
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        args = (q, k, v, grad_out, lse2, delta)
        tail = (*launch.sizes(), launch.scale * LOG2E, launch.scale)
        _dkdv_kernel[launch.key_grid()](*args, dk, dv, launch.pad, *tail, **launch.meta())
        _dq_kernel[launch.query_grid()](*args, dq, launch.pad, *tail, **launch.meta())
        return dq, dk, dv, None, None, None, None, None


def triton_flash_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                           key_padding_mask: Tensor | None = None, scale: float | None = None,
                           block_q: int | None = None, block_k: int | None = None
                           ) -> tuple[Tensor, Tensor]:
    """(out (B, H, n, d_v), lse (B, H, n) float32) for inputs already validated by
    `plainformer.nn.flash.flash_attention` (which calls this for CUDA tensors); block sizes must be
    powers of two >= 16 (default 64, 32 when d > 128 to fit shared memory)."""
    default = 64 if max(q.shape[-1], v.shape[-1]) <= 128 else 32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _TritonFlashAttention.apply(q, k, v, key_padding_mask, is_causal, scale,
                                       _check_block("block_q", block_q, default),
                                       _check_block("block_k", block_k, default))
