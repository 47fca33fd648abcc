"""FlashAttention (Dao et al. 2022; Dao 2023, FlashAttention-2): exact attention in O(n) memory.

softmax(s·Q Kᵀ) V is computed one (query block Q_i, key block K_j) tile at a time, so the n × m
score matrix is never stored. Forward, for each Q_i, from m = -inf, l = 0, O = 0, looping over j:

    S  = s · Q_i K_jᵀ                      (masked entries: -inf)
    m' = max(m, rowmax S)
    P  = exp(S - m')
    l  = e^{m - m'} · l + rowsum P
    O  = diag(e^{m - m'}) · O + P V_j,   m = m'

and at the end O = diag(l)⁻¹ O and the logsumexp L = m + log l. Only O and L are kept for the
backward pass, which recomputes each tile instead of storing it:

    D   = rowsum(dO ∘ O)                   (minus dL when L itself receives a gradient)
    P   = exp(s · Q_i K_jᵀ - L)
    dV_j += Pᵀ dO_i,   dP = dO_i V_jᵀ,   dS = P ∘ (dP - D)
    dQ_i += s · dS K_j,   dK_j += s · dSᵀ Q_i

Exponentials are taken base 2 (exp(x) = 2^(x·log₂e), log₂e folded into the scale once) because
torch's exp2 is about twice as fast as exp on CPU.

The variants of the scores enter each tile the same way in the forward and in the backward's recomputed
tile, where S becomes

    S = c·tanh(s·Q_i K_jᵀ / c)  +  m_h·(j - i - offset)  +  (-inf where masked)

Soft-capping (Gemma 2, `softcap=c`) bounds the scores, and the backward multiplies dS by the cap's derivative
1 - tanh²; in base 2 it is the same cap with c·log₂e (log₂e·c·tanh(S/c) = c'·tanh(S'/c') for S' = log₂e·S,
c' = log₂e·c). ALiBi (Press et al. 2022, `alibi_slopes` m_h) adds a bias linear in the distance, no
gradient. A sliding window (Mistral, `window` w) hides the keys j <= i + offset - w; the key blocks that
lie wholly outside every window of a query block are skipped like those in its causal future, so
causal attention with a window costs O(n·w), not O(n·m).

Conventions: q (B, H, n, d), k (B, H_kv, m, d), v (B, H_kv, m, d_v), H_kv dividing H (grouped-query
attention: query head h reads key/value head h // (H / H_kv)). `key_padding_mask` (B, m) is True for
real tokens. Query i sits at key position i + offset; `is_causal` lets it see keys j <= i + offset.
offset = 0 is torch's top-left alignment (query i sees keys j <= i, also when n != m); offset = m - n
aligns the last query with the last key, as decoding after m - n cached keys needs. A query row that
sees no key at all returns zeros (its L is -inf) and gets zero gradients.

Layout: the G = H / H_kv query heads that share a key/value head are folded into the rows, so every
tile is one batched matmul over (B·H_kv) of (block_q·G, d) @ (d, block_k) without copying K or V per
query head; row r of a block holds query position i0 + r // G.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from .. import _checks

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Tile sizes, measured on this project's 2-core AVX-512 CPU (the shapes of benchmarks/attention.py:
# B=1, H=8, d=64, fp32, forward+backward, n = 2048 and 4096, causal and not). Matmuls take ~80% of
# the time at every size; small tiles lose to per-op overhead (about 15 torch calls per tile, each a
# parallel region), big ones to cache misses in the element-wise passes over the score tile and,
# when causal, to computing more of the masked diagonal. 128 to 512 were within ~5% of each other
# on one thread (the venv's OMP_NUM_THREADS=1), 256 x 256 best at n = 4096; on two threads 256 x 256
# was the most consistent. One score tile is then H·256·256 fp32 = 2 MiB, the size of the L2
# caches. 1024 x 1024 was 10-40% slower.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256

_ACCUMULATE_IN_FP32 = (torch.float16, torch.bfloat16)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Terms:
    """What the scores hold besides s·Q Kᵀ (see the module doc), as `flash_attention` was given it."""

    is_causal: bool = False
    key_padding_mask: Tensor | None = None
    offset: int = 0
    window: int | None = None
    softcap: float | None = None
    alibi_slopes: Tensor | None = None

    @property
    def plain(self) -> bool:
        """Only top-left causality and key padding: what the Triton kernel computes."""
        return self.offset == 0 and self.window is None and self.softcap is None and self.alibi_slopes is None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                    key_padding_mask: Tensor | None = None, scale: float | None = None, offset: int = 0,
                    window: int | None = None, softcap: float | None = None, alibi_slopes: Tensor | None = None,
                    block_q: int | None = None, block_k: int | None = None,
                    return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(scale · Q Kᵀ) V tile by tile, never storing the (n, m) scores; see the module doc.

    q: (B, H, n, d); k: (B, H_kv, m, d); v: (B, H_kv, m, d_v); H_kv divides H.
    key_padding_mask: (B, m) bool, True = real token (False keys are never attended).
    offset: query i sits at key position i + offset (0: top-left aligned, as torch's is_causal).
    is_causal: query i attends keys j <= i + offset.
    window w: query i attends only keys j > i + offset - w (with is_causal: the last w, itself included).
    scale: defaults to 1/√d. softcap c: the scores become c·tanh(scale · Q Kᵀ / c) before masking.
    alibi_slopes (H,): ALiBi's m_h; head h's scores get m_h · (j - i - offset).
    block_q, block_k: tile sizes in query/key positions (defaults DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K).
    fp16/bf16 inputs are computed in fp32, the results cast back. CUDA tensors go to the Triton kernel
    (plainformer.flash_triton) when triton is installed, the dtype is fp16/bf16/fp32, d, d_v <= 256 and
    there is no variant (offset 0, no window, softcap or ALiBi); there block_q/block_k must be powers of two
    >= 16.

    Returns out (B, H, n, d_v), and with return_lse also L = logsumexp of each score row (B, H, n)
    (float32, or float64 for float64 inputs; -inf for rows that see no key), differentiable too.
    """
    terms = _Terms(is_causal, key_padding_mask, offset, window, softcap, alibi_slopes)
    scale = _check_inputs(q, k, v, terms, scale, block_q, block_k, return_lse)
    triton_attention = _triton_function(q, v) if terms.plain else None
    if triton_attention is not None:
        out, lse = triton_attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask,
                                    scale=scale, block_q=block_q, block_k=block_k)
    else:
        out, lse = _FlashAttention.apply(q, k, v, terms, scale, block_q or DEFAULT_BLOCK_Q,
                                         block_k or DEFAULT_BLOCK_K)
    return (out, lse) if return_lse else out


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, terms: _Terms, scale: float | None, block_q: int | None,
                  block_k: int | None, return_lse: bool) -> float:
    """Validate everything at the boundary (the arguments may be anything); returns the scale."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, x, ndim=4, shape_doc="(B, H, seq_len, head_dim)")
        _checks.check_floating(name, x)
        if x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
        if 0 in x.shape:
            raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    _checks.check_same_dtype_device(q=q, k=k, v=v)
    batch, heads, _, dim = q.shape
    if k.shape[0] != batch or k.shape[-1] != dim:
        raise ValueError(f"k must have shape (B, H_kv, m, d) with B = {batch} and d = {dim} as q, "
                         f"got k {tuple(k.shape)} and q {tuple(q.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v (B, H_kv, m, d_v) must match k (B, H_kv, m, d) in B, H_kv and m, "
                         f"got v {tuple(v.shape)} and k {tuple(k.shape)}")
    _checks.check_divisible("the query heads H", heads, "the key/value heads H_kv", k.shape[1])
    for name, flag in (("is_causal", terms.is_causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None:
            _checks.check_positive_int(name, size)
    if terms.key_padding_mask is not None:
        _checks.check_key_padding_mask("key_padding_mask", terms.key_padding_mask, batch, k.shape[2], q.device)
    _checks.check_non_negative_int("offset", terms.offset)
    if terms.window is not None:
        _checks.check_positive_int("window", terms.window)
    if terms.softcap is not None:
        _checks.check_positive_number("softcap", terms.softcap)
    if terms.alibi_slopes is not None:
        _checks.check_tensor("alibi_slopes", terms.alibi_slopes, ndim=1, shape_doc="(H,)")
        _checks.check_floating("alibi_slopes", terms.alibi_slopes)
        _checks.check_same_device(q=q, alibi_slopes=terms.alibi_slopes)
        if terms.alibi_slopes.shape[0] != heads:
            raise ValueError(f"alibi_slopes must hold one slope per query head (H = {heads}), "
                             f"got shape {tuple(terms.alibi_slopes.shape)}")
    if scale is None:
        return 1.0 / math.sqrt(dim)
    return _checks.check_positive_number("scale", scale)


def _triton_function(q: Tensor, v: Tensor) -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The Triton implementation when it applies to these tensors, else None (plain PyTorch)."""
    if not q.is_cuda:
        return None
    try:
        from . import flash_triton
    except ImportError:  # triton is an optional extra
        return None
    return flash_triton.triton_flash_attention if flash_triton.supports(q, v) else None


# ----------------------------------------------------------------------------- layout and tiling

def _to_rows(x: Tensor, n_kv_heads: int) -> Tensor:
    """(B, H, n, d) -> (B·H_kv, n·G, d): the G query heads of one key/value head become rows,
    ordered (position, head), so a block of positions is a contiguous range of rows."""
    batch, heads, n, dim = x.shape
    groups = heads // n_kv_heads
    rows = x.reshape(batch, n_kv_heads, groups, n, dim).transpose(2, 3)  # (B, H_kv, n, G, d)
    return rows.reshape(batch * n_kv_heads, n * groups, dim)


def _from_rows(x: Tensor, batch: int, heads: int) -> Tensor:
    """Inverse of `_to_rows`: (B·H_kv, n·G, d) -> (B, H, n, d)."""
    n_kv_heads = x.shape[0] // batch
    groups = heads // n_kv_heads
    n = x.shape[1] // groups
    rows = x.reshape(batch, n_kv_heads, n, groups, -1).transpose(2, 3)  # (B, H_kv, G, n, d)
    return rows.reshape(batch, heads, n, -1)


def _blocks(x: Tensor, size: int) -> list[Tensor]:
    """Split the rows (dim 1) into contiguous blocks of `size` rows (the last may be shorter)."""
    return [block.contiguous() for block in x.split(size, dim=1)]


class _Tiles:
    """Which tiles exist and what their scores hold besides Q Kᵀ, shared by the forward and the backward.

    Query block i covers positions [i0, i1), key block j covers keys [j0, j1). Under the causal
    mask, a key block with j0 > i1 - 1 + offset lies entirely in the future of the query block and is
    skipped; one with j1 - 1 > i0 + offset straddles the diagonal and is masked element-wise. Under a
    window w, one with j1 - 1 <= i0 + offset - w lies before every query's window and is skipped; one
    with j0 <= i1 - 1 + offset - w straddles the window's edge and is masked element-wise.
    """

    def __init__(self, n: int, m: int, groups: int, batch: int, block_q: int, block_k: int, terms: _Terms,
                 dtype: torch.dtype, device: torch.device):
        self.groups, self.batch, self.is_causal, self.offset = groups, batch, terms.is_causal, terms.offset
        self.window = terms.window
        self.softcap2 = None if terms.softcap is None else terms.softcap * LOG2E  # the cap in base-2 units
        self.slopes2 = (None if terms.alibi_slopes is None  # base 2, (H_kv, G): head h = kv head · G + g
                        else (terms.alibi_slopes.to(dtype) * LOG2E).view(-1, groups))
        self.dtype, self.device = dtype, device
        self.queries = [(i0, min(i0 + block_q, n)) for i0 in range(0, n, block_q)]
        self.keys = [(j0, min(j0 + block_k, m)) for j0 in range(0, m, block_k)]
        self.padding = self.padded = None
        key_padding_mask = terms.key_padding_mask
        if key_padding_mask is not None:
            # Additive bias (B, m): 0 for real tokens, -inf for padding; blocks without padding
            # skip it. Which keys are padding anywhere is read on the host once (one sync on CUDA,
            # this path's only one: the backward reuses these tiles), not once per block.
            self.padding = self._bias(~key_padding_mask)
            padded_keys = (~key_padding_mask).any(dim=0).tolist()  # (m,)
            self.padded = [any(padded_keys[j0:j1]) for j0, j1 in self.keys]
        self._band: dict[tuple[int, int, int], Tensor] = {}
        self._alibi_tiles: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def cap_(self, scores: Tensor, tanh: Tensor | None = None) -> Tensor | None:
        """S ← c'·tanh(S/c') in place where soft-capped; with `tanh`, tanh(S/c') is kept there (for the
        backward's 1 - tanh²) and returned."""
        if self.softcap2 is None:
            return None
        if tanh is None:
            scores.div_(self.softcap2).tanh_().mul_(self.softcap2)
            return None
        torch.tanh(scores.div_(self.softcap2), out=tanh)
        torch.mul(tanh, self.softcap2, out=scores)
        return tanh

    def visible(self, i: int, j: int) -> bool:
        """Some query of block i sees some key of block j."""
        (i0, i1), (j0, j1) = self.queries[i], self.keys[j]
        return ((not self.is_causal or j0 <= i1 - 1 + self.offset)
                and (self.window is None or j1 - 1 > i0 + self.offset - self.window))

    def key_blocks(self, i: int) -> list[int]:
        """The key blocks query block i sees: one contiguous run (causality ends it, a window starts it)."""
        return [j for j in range(len(self.keys)) if self.visible(i, j)]

    def bias_(self, scores: Tensor, i: int, j: int) -> Tensor:
        """Add the tile's biases to the score tile (B·H_kv, rows, cols), in place: -inf at its masked
        entries, ALiBi's m_h·(j - i - offset).

        Masks are added as 0/-inf biases: a broadcast add is vectorised, a broadcast masked_fill
        is not (10x slower on CPU).
        """
        (i0, i1), (j0, j1) = self.queries[i], self.keys[j]
        tile = scores.view(self.batch, -1, scores.shape[1], scores.shape[2])  # (B, H_kv, rows, cols)
        if self.padding is not None and self.padded is not None and self.padded[j]:
            tile.add_(self.padding[:, None, None, j0:j1])
        if ((self.is_causal and j1 - 1 > i0 + self.offset)
                or (self.window is not None and j0 <= i1 - 1 + self.offset - self.window)):
            scores.add_(self._band_bias(i0, i1, j0, j1))
        if self.slopes2 is not None:
            slopes, distance = self._alibi(self.slopes2, i1 - i0, j1 - j0)
            tile.addcmul_(slopes, distance + (j0 - i0 - self.offset))
        return scores

    def _band_bias(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        """(rows, cols) bias, -inf where key j is in the future of the row's query (j > i + offset, when
        causal) or before its window (j <= i + offset - w); cached, since it depends only on i0 - j0 and
        the tile's size."""
        key = (i0 - j0, i1 - i0, j1 - j0)
        if key not in self._band:
            position = torch.arange(i0, i1, device=self.device).repeat_interleave(self.groups)
            distance = torch.arange(j0, j1, device=self.device)[None, :] - (position[:, None] + self.offset)
            hidden = (distance > 0) & self.is_causal  # j - (i + offset), (rows, cols)
            if self.window is not None:
                hidden |= distance <= -self.window
            self._band[key] = self._bias(hidden)
        return self._band[key]

    def _alibi(self, slopes2: Tensor, positions: int, cols: int) -> tuple[Tensor, Tensor]:
        """For a tile of `positions` query positions and `cols` keys: each row's slope of `slopes2` (H_kv, G),
        (H_kv, rows, 1) (row r is head r % G), and c - r // G (rows, cols), the distance j - i less the tile's
        j0 - i0; cached."""
        if (positions, cols) not in self._alibi_tiles:
            slopes = slopes2.repeat(1, positions).unsqueeze(-1)
            rows = torch.arange(positions, device=self.device, dtype=self.dtype).repeat_interleave(self.groups)
            distance = torch.arange(cols, device=self.device, dtype=self.dtype)[None, :] - rows[:, None]
            self._alibi_tiles[positions, cols] = slopes, distance
        return self._alibi_tiles[positions, cols]

    def _bias(self, masked: Tensor) -> Tensor:
        return torch.zeros(masked.shape, dtype=self.dtype, device=self.device).masked_fill_(
            masked, float("-inf"))


def _workspace(rows: int, cols: int, like: Tensor) -> Callable[[int, int], Tensor]:
    """One flat buffer reused for every (r, c) tile: fresh multi-MiB allocations would page-fault
    on every tile, which on CPU costs as much as the matmul that fills them."""
    flat = like.new_empty(like.shape[0] * rows * cols)

    def tile(r: int, c: int) -> Tensor:
        return flat[: like.shape[0] * r * c].view(like.shape[0], r, c)

    return tile


# ----------------------------------------------------------------------------- forward and backward

def _forward(q_blocks: list[Tensor], k: Tensor, v: Tensor, tiles: _Tiles) -> tuple[Tensor, Tensor]:
    """q_blocks: (B·H_kv, rows, d) pre-scaled by s·log₂e; k, v: (B·H_kv, m, d).

    Returns O (B·H_kv, n·G, d_v) and L₂ = L·log₂e (B·H_kv, n·G).
    """
    scores_of = _workspace(q_blocks[0].shape[1], tiles.keys[0][1], k)
    total_rows = sum(q_i.shape[1] for q_i in q_blocks)
    out = k.new_empty(k.shape[0], total_rows, v.shape[-1])
    lse2 = k.new_empty(k.shape[0], total_rows)
    r0 = 0
    for i, q_i in enumerate(q_blocks):
        rows = q_i.shape[1]
        acc = q_i.new_zeros(q_i.shape[0], rows, v.shape[-1])
        row_max = q_i.new_full((q_i.shape[0], rows), float("-inf"))
        row_sum = q_i.new_zeros(q_i.shape[0], rows)
        for j in tiles.key_blocks(i):
            j0, j1 = tiles.keys[j]
            scores = torch.bmm(q_i, k[:, j0:j1].transpose(1, 2), out=scores_of(rows, j1 - j0))
            tiles.cap_(scores)
            tiles.bias_(scores, i, j)
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            # A row with no visible key yet keeps max -inf; shifting it by 0 gives exp2(-inf) = 0.
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = scores.sub_(shift.unsqueeze(-1)).exp2_()  # P, in place of S
            correction = torch.exp2(row_max - shift)  # e^{m - m'}
            row_sum.mul_(correction).add_(probs.sum(dim=-1))
            acc.mul_(correction.unsqueeze(-1)).baddbmm_(probs, v[:, j0:j1])
            row_max = new_max
        out[:, r0:r0 + rows] = acc.div_(row_sum.masked_fill(row_sum == 0, 1.0).unsqueeze(-1))
        lse2[:, r0:r0 + rows] = row_max + torch.log2(row_sum)  # -inf for rows that see no key
        r0 += rows
    return out, lse2


def _backward(q_blocks: list[Tensor], k: Tensor, v: Tensor, grad_blocks: list[Tensor],
              lse2_blocks: list[Tensor], delta_blocks: list[Tensor],
              tiles: _Tiles) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients Σ dS K_j, Σ dSᵀ Q'_i, Σ Pᵀ dO_i (unscaled) for q_blocks Q' = s·log₂e·Q.

    lse2_blocks and delta_blocks are (B·H_kv, rows, 1); L₂ is +inf for rows that see no key, so
    that P = 2^(S - L₂) is 0 there.
    """
    rows = q_blocks[0].shape[1]
    probs_of = _workspace(rows, tiles.keys[0][1], k)
    dprobs_of = _workspace(rows, tiles.keys[0][1], k)
    tanh_of = _workspace(rows, tiles.keys[0][1], k) if tiles.softcap2 is not None else None
    dq_blocks = [torch.zeros_like(q_i) for q_i in q_blocks]
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
    for j, (j0, j1) in enumerate(tiles.keys):
        k_j, v_j = k[:, j0:j1], v[:, j0:j1]
        dk_acc, dv_acc = torch.zeros_like(k_j), torch.zeros_like(v_j)
        for i, q_i in enumerate(q_blocks):
            if not tiles.visible(i, j):
                continue
            r, c = q_i.shape[1], j1 - j0
            probs = torch.bmm(q_i, k_j.transpose(1, 2), out=probs_of(r, c))
            tanh = tiles.cap_(probs, None if tanh_of is None else tanh_of(r, c))
            tiles.bias_(probs, i, j)
            probs.sub_(lse2_blocks[i]).exp2_()  # P = exp(S - L)
            dv_acc.baddbmm_(probs.transpose(1, 2), grad_blocks[i])
            dscores = torch.bmm(grad_blocks[i], v_j.transpose(1, 2), out=dprobs_of(r, c))  # dP
            dscores.sub_(delta_blocks[i]).mul_(probs)  # dS = P ∘ (dP - D)
            if tanh is not None:  # through the cap: dS ∘ (1 - tanh²)
                dscores.mul_(tanh.square_().neg_().add_(1.0))
            dq_blocks[i].baddbmm_(dscores, k_j)
            dk_acc.baddbmm_(dscores.transpose(1, 2), q_i)
        dk[:, j0:j1] = dk_acc
        dv[:, j0:j1] = dv_acc
    return torch.cat(dq_blocks, dim=1), dk, dv


class _FlashAttention(torch.autograd.Function):
    """Plain-PyTorch FlashAttention-2 for any device; saves only the inputs, O and L."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, terms: _Terms, scale: float, block_q: int,
                block_k: int) -> tuple[Tensor, Tensor]:
        batch, heads, n, _ = q.shape
        n_kv_heads, m = k.shape[1], k.shape[2]
        compute = torch.float32 if q.dtype in _ACCUMULATE_IN_FP32 else q.dtype
        tiles = _Tiles(n, m, heads // n_kv_heads, batch, block_q, block_k, terms, compute, q.device)
        q_blocks = _scaled_query_blocks(q, n_kv_heads, tiles.groups * block_q, scale * LOG2E,
                                        compute)
        out, lse2 = _forward(q_blocks, _kv_rows(k, compute), _kv_rows(v, compute), tiles)
        out = _from_rows(out, batch, heads).to(q.dtype)  # (B, H, n, d_v)
        lse = _from_rows((lse2 * LN2).unsqueeze(-1), batch, heads).squeeze(-1)  # (B, H, n)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (scale, block_q)
        ctx.tiles = tiles  # the backward walks the same tiles: its masks and padded blocks are not made again
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        scale, block_q = ctx.options
        tiles = ctx.tiles
        batch, heads = q.shape[:2]
        n_kv_heads = k.shape[1]
        compute = torch.float32 if q.dtype in _ACCUMULATE_IN_FP32 else q.dtype
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_rows = _to_rows(grad_out.to(compute), n_kv_heads)  # (B·H_kv, n·G, d_v)
        # D = rowsum(dO ∘ O), (B·H_kv, n·G)
        delta = (grad_rows * _to_rows(out.to(compute), n_kv_heads)).sum(dim=-1)
        if grad_lse is not None:
            delta -= _to_rows(grad_lse.to(compute).unsqueeze(-1), n_kv_heads).squeeze(-1)
        lse2 = _to_rows(lse.to(compute).unsqueeze(-1), n_kv_heads).squeeze(-1) * LOG2E
        lse2.masked_fill_(lse2 == float("-inf"), float("inf"))
        rows = tiles.groups * block_q
        q_blocks = _scaled_query_blocks(q, n_kv_heads, rows, scale * LOG2E, compute)
        dq, dk, dv = _backward(q_blocks, _kv_rows(k, compute), _kv_rows(v, compute),
                               _blocks(grad_rows, rows), _blocks(lse2.unsqueeze(-1), rows),
                               _blocks(delta.unsqueeze(-1), rows), tiles)
        dq = _from_rows(dq.mul_(scale), batch, heads).to(q.dtype)
        # dK = s · Σ dSᵀ Q = Σ dSᵀ Q' / log₂e, as the blocks held Q' = s·log₂e·Q.
        dk = dk.mul_(1.0 / LOG2E).view(k.shape).to(k.dtype)
        return dq, dk, dv.view(v.shape).to(v.dtype), None, None, None, None


def _scaled_query_blocks(q: Tensor, n_kv_heads: int, rows: int, factor: float,
                         compute: torch.dtype) -> list[Tensor]:
    return [block.to(compute) * factor for block in _to_rows(q, n_kv_heads).split(rows, dim=1)]


def _kv_rows(x: Tensor, compute: torch.dtype) -> Tensor:
    """(B, H_kv, m, d) -> (B·H_kv, m, d) in the compute dtype (a view when nothing changes)."""
    return x.to(compute).reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])
