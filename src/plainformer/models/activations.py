"""What the shared blocks (attention, FFN, their norms) keep while they run: the arithmetic each family's
model adds up into its training, evaluation and decoding estimates (models/memory.py).

Training one micro-batch of B rows of n tokens keeps, in float32 (an estimate, on the high side):

    A = B n [ Σ_l (7 d + 2 d_kv + a · d_ff + w + r + g) + 3 d + 3 V ]

per layer the residual input and the norm's output of each sublayer, q, k, v, the attention output
before and after merging the heads (g = d + d_kv more with QK-norm: q and k before their norms), and the
FFN's hidden states (a = 2, or 4 for SwiGLU; on a MoE layer, top_k experts' worth and the router's
logits); w, the attention weights per query where they are materialised: 3 h n with attention dropout
(the weights, the dropped weights, the mask), h n on the math path (2 h n with soft-capped scores, which
take it under "auto" too), h n / 2 under backend "auto" on at most 512 keys (the math path, in
bfloat16), none in the fused kernels; r = 5/4 d_ff + d/2 with dropout, its masks and the dropped hidden
state W_2 reads; then the logits, their log-softmax and their gradient, V each.
d_kv = n_kv_heads · d / n_heads.
"""

from __future__ import annotations

from typing import Any

FLOAT32 = 4
MATH_KEYS = 512  # at most this many keys, backend "auto" takes the math path in bfloat16 (nn/attention.py)


def kv_width(config: Any) -> int:
    """d_kv = n_kv_heads · d_model / n_heads, the width of the keys (and of the values)."""
    n_kv_heads = getattr(config, "n_kv_heads", None) or config.n_heads
    return n_kv_heads * (config.d_model // config.n_heads)


def _attention_dropout(c: Any) -> float:
    return getattr(c, "attention_dropout", c.dropout)


def scores(c: Any, keys: int) -> int:
    """Elements kept per query for the attention weights, where they are materialised: with attention
    dropout (the weights, the dropped weights and the mask), on the math path, or under backend "auto"
    on at most 512 keys (the math path in bfloat16: half the bytes)."""
    if _attention_dropout(c) > 0:
        return 3 * c.n_heads * keys
    capped = getattr(c, "attn_softcap", None) is not None  # the math path, which also keeps tanh's output
    if c.backend == "math" or (capped and c.backend == "auto"):
        return (2 if capped else 1) * c.n_heads * keys
    return c.n_heads * keys // 2 if c.backend == "auto" and keys <= MATH_KEYS else 0


def hidden(activation: str, d_ff: int) -> int:
    """The FFN's hidden states per token: a · d_ff, a = 4 for SwiGLU, else 2."""
    return (4 if activation == "swiglu" else 2) * d_ff


def dropout(c: Any, d_ff: int) -> int:
    """Dropout's masks (a byte an element) and the dropped FFN hidden state W_2 takes."""
    return (5 * d_ff) // 4 + c.d_model // 2 if c.dropout > 0 else 0


def layer_activations(c: Any, keys: int) -> int:
    """Elements kept per token by one dense self-attention layer (see the module docstring)."""
    qk_norm = c.d_model + kv_width(c) if getattr(c, "qk_norm", False) else 0
    return (7 * c.d_model + 2 * kv_width(c) + hidden(c.activation, c.d_ff) + scores(c, keys)
            + dropout(c, c.d_ff) + qk_norm)


def cross_activations(c: Any, keys: int) -> int:
    """A decoder layer's cross-attention per target token: the norm's input and output, q, the attention
    output before and after merging the heads, the weights where materialised."""
    return 5 * c.d_model + scores(c, keys)


def forward_pass(config: Any, rows: int, n: int, itemsize: int, vocab: int) -> int:
    """A forward pass without autograd over `rows` rows of `n` tokens: one layer's transients at a time
    (the residual stream, the norm's output, q, k, v, the attention's output and weights, the FFN's
    hidden states) in elements of `itemsize` bytes, and float32 logits of width `vocab` with their
    log-softmax at every position."""
    c = config
    transients = 4 * c.d_model + 2 * kv_width(c) + hidden(c.activation, c.d_ff) + c.n_heads * n
    return rows * n * (itemsize * transients + FLOAT32 * 2 * vocab)
