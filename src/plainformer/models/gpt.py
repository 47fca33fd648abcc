"""A GPT-style decoder-only language model (Radford et al. 2018, 2019).

    h_0 = E[idx] (+ P[positions])                      token (+ learned or sinusoidal) embeddings
    h_l = Block_l(h_{l-1}),  l = 1 .. n_layers         pre-LN blocks with causal self-attention
    logits = Norm(h_L) Eᵀ                              output projection tied to E (optional)
    loss = cross_entropy(logits, targets)              next-token prediction

Each `Block` is pre-LN with a causal mask: x + Attn(LN(x)), then x + FFN(LN(x)).
With n_experts > 0 the FFN of every moe_every-th block after the first first_dense_layers is a
Mixture-of-Experts layer (`nn.moe`), and the training loss adds its balancing terms averaged over
those layers: loss = CE + aux_loss_coef · mean_l L_aux + z_loss_coef · mean_l L_z (in eval, CE only).
With pos_encoding="rope" positions enter through rotary embeddings of q and k instead of P; with "alibi"
through a bias of the attention scores linear in the distance (each block's attention owns its slopes).
Initialisation follows GPT-2: N(0, 0.02) weights, zero biases, and the projections that write into the
residual stream (W_o, W_2) scaled by 1/√(2·n_layers) so its variance does not grow with depth.
The config is checked when it is built; the modules built from it check nothing again.

The variants of the block that the speedruns added (issue 49), each a GPTConfig field, off by default:

    logit_softcap c     logits = c · tanh(z / c)                           (Gemma 2's final_logit_softcapping)
    zero_init           W_o, W_2 (every expert's) and the head start at 0  (needs an untied head)
    embed_norm          h_0 = RMSNorm(h_0)                                  (modded-nanogpt)
    x0_mix              x ← a_l · x + b_l · h_0 at each block's input      (nn/shortcuts.py)
    value_residual      v_l ← λ_l · v_l + (1 − λ_l) · v_1, layers l ≥ 2    (Zhou et al. 2024; nn/shortcuts.py)
    token_shift         e_t ← e_t + σ(g) ⊙ E[x_{t−1}]                      (nn/previous_token.py)
    bigram_embedding    e_t ← e_t + B[x_{t−1} · V + x_t]                    (nn/previous_token.py)

so that h_0 = Norm(E[x_t] + σ(g) ⊙ E[x_{t−1}] + B[x_{t−1}, x_t] + P_t) with every one on. With the attention
variants (qk_norm, attn_softcap, sliding_window, pos_encoding="alibi": `nn.attention.VariantAttention`) they are
`GPTConfig.variants`. `GPT` and `Block` hold none of them and read as the equations at the top; a config with
any variant on builds a `VariantGPT` of `VariantBlock`s instead (below), the class chosen once by `GPT(config)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..config import (
    Config,
    greater_than,
    non_negative_int,
    non_negative_number,
    one_of,
    positive_int,
    positive_number,
    probability,
)
from ..constants import IGNORE_INDEX
from ..data.tokenizers import Tokenizer
from ..generation.decoders import GPTDecoder
from ..generation.decoding import generate as generate_tokens
from ..generation.decoding import generate_padded, pad_prompts
from ..generation.sampling import Generators
from ..generation.stopping import StopStrings
from ..memory import unchecked
from ..nn.attention import BACKENDS, MultiHeadAttention, VariantAttention, check_softcap_backend
from ..nn.dtypes import at_least_float32
from ..nn.feedforward import ACTIVATIONS, FeedForward
from ..nn.kv_cache import KVCache
from ..nn.masks import AttentionMask, padded_positions_and_mask
from ..nn.modes import eval_mode
from ..nn.moe import MoEFeedForward, mean_router_losses, moe_layers
from ..nn.normalization import NORMS, RMSNorm, make_norm
from ..nn.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from ..nn.previous_token import BigramEmbedding, TokenShift, previous_tokens
from ..nn.rope import RotaryEmbedding, Rotation
from ..nn.shortcuts import EmbeddingShortcut, ValueResidual
from .family_model import FamilyModel

POSITION_ENCODINGS = ("alibi", "learned", "rope", "sinusoidal")
# The variants' fields (the module docstring's table; the guide's), each off by default; pos_encoding="alibi" too.
VARIANTS = ("qk_norm", "attn_softcap", "sliding_window", "logit_softcap", "zero_init", "embed_norm", "x0_mix",
            "value_residual", "token_shift", "bigram_embedding")


@dataclasses.dataclass
class GPTConfig(Config):
    """Shape and options of a `GPT`. vocab_size is usually set from the tokenizer at training time."""

    vocab_size: int = positive_int(65)
    block_size: int = positive_int(256)
    n_layers: int = positive_int(6)
    n_heads: int = positive_int(6)
    n_kv_heads: int | None = positive_int(None)
    d_model: int = positive_int(384)
    d_ff: int = positive_int(1536)
    dropout: float = probability(0.0)
    bias: bool = False
    pos_encoding: str = one_of("learned", POSITION_ENCODINGS)
    norm: str = one_of("layernorm", NORMS)
    activation: str = one_of("gelu", ACTIVATIONS)
    tie_weights: bool = True
    backend: str = one_of("auto", BACKENDS)
    rope_base: float = greater_than(10000.0, 1)
    norm_eps: float = positive_number(1e-5)
    # Attention variants, each off by default (nn/attention.py's VariantAttention): see docs/guide.md's table.
    qk_norm: bool = False
    attn_softcap: float | None = positive_number(None)
    sliding_window: int | None = positive_int(None)
    # Mixture of Experts (nn/moe.py): 0 experts = every FFN dense.
    n_experts: int = non_negative_int(0)
    top_k: int = positive_int(2)
    n_shared_experts: int = non_negative_int(0)
    moe_every: int = positive_int(1)
    first_dense_layers: int = non_negative_int(0)
    capacity_factor: float | None = positive_number(None)
    bias_update_rate: float = non_negative_number(0.0)
    aux_loss_coef: float = non_negative_number(0.01)
    z_loss_coef: float = non_negative_number(0.001)
    # The block variants of issue 49 (the module docstring; docs/guide.md's table), each off by default.
    logit_softcap: float | None = positive_number(None)
    zero_init: bool = False
    embed_norm: bool = False
    x0_mix: bool = False
    value_residual: bool = False
    token_shift: bool = False
    bigram_embedding: bool = False

    HELP: ClassVar[Mapping[str, str]] = {
        "vocab_size": "tokens in the vocabulary (the tokenizer's)",
        "block_size": "the context: positions a row holds",
        "n_layers": "blocks",
        "n_heads": "attention heads",
        "n_kv_heads": "key/value heads (grouped-query attention); none: n_heads",
        "d_model": "width of the residual stream",
        "d_ff": "hidden width of the FFN, each expert's",
        "dropout": "dropout of the embeddings, attention and sublayers",
        "bias": "biases in the linear layers and norms",
        "pos_encoding": "how positions enter",
        "norm": "the blocks' and the final norm",
        "activation": "the FFN's",
        "tie_weights": "the output projection is the token embedding",
        "backend": "the attention kernel",
        "rope_base": "RoPE's base b: θ_i = b^(-2i/d)",
        "norm_eps": "ε of the norms",
        "qk_norm": "RMSNorm of each head's q and k",
        "attn_softcap": "attention scores s -> c·tanh(s/c); none: off",
        "sliding_window": "attend to the last N positions only; none: all",
        "n_experts": "experts of a MoE layer; 0: every feed-forward dense",
        "top_k": "experts active per token",
        "n_shared_experts": "experts every token goes through besides",
        "moe_every": "every N-th block after the dense ones is MoE",
        "first_dense_layers": "leading blocks that stay dense",
        "capacity_factor": "an expert takes at most cf·T·K/E tokens; none: all",
        "bias_update_rate": "aux-loss-free balancing's step u; 0: off",
        "aux_loss_coef": "weight of the load-balancing loss",
        "z_loss_coef": "weight of the router z-loss",
        "logit_softcap": "logits z -> c·tanh(z/c); none: off",
        "zero_init": "W_o, W_2 and the head start at 0; needs no tie_weights",
        "embed_norm": "h_0 = RMSNorm(h_0)",
        "x0_mix": "x <- a_l·x + b_l·h_0 at each block's input",
        "value_residual": "v_l <- λ_l·v_l + (1 - λ_l)·v_1 from layer 2",
        "token_shift": "e_t <- e_t + σ(g) ⊙ E[x_(t-1)]",
        "bigram_embedding": "e_t <- e_t + B[x_(t-1)·V + x_t]",
    }
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        # nanoGPT's CPU recipe for Shakespeare characters (its README, "I only have a macbook").
        "nanogpt-cpu": dict(block_size=64, n_layers=4, n_heads=4, d_model=128, d_ff=512, dropout=0.0),
        # nanoGPT's config/train_shakespeare_char.py.
        "shakespeare-char": dict(block_size=256, n_layers=6, n_heads=6, d_model=384, d_ff=1536,
                                 dropout=0.2),
        # GPT-2 small, 124M parameters.
        "gpt2": dict(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768,
                     d_ff=3072, dropout=0.1, bias=True, activation="gelu_tanh"),
        # The best model found for ~5 minutes on 2 CPU cores: see docs/guide.md, "Choosing the default".
        "default": dict(block_size=128, n_layers=4, n_heads=4, d_model=256, d_ff=688, dropout=0.0,
                        pos_encoding="rope", norm="rmsnorm", activation="swiglu"),
        # "default" with 8 SwiGLU experts of half its width, top-2: the same active FFN size per token.
        "moe": dict(block_size=128, n_layers=4, n_heads=4, d_model=256, d_ff=344, dropout=0.0,
                    pos_encoding="rope", norm="rmsnorm", activation="swiglu", n_experts=8, top_k=2),
    }

    def validate(self) -> None:
        _checks.check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        if self.n_kv_heads is not None:
            _checks.check_divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads)
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise ValueError(f"pos_encoding='rope' needs an even head dimension d_model/n_heads, "
                             f"got {self.d_model}/{self.n_heads}")
        if self.pos_encoding == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"pos_encoding='sinusoidal' needs an even d_model, got {self.d_model}")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"top_k must be at most n_experts={self.n_experts}, got {self.top_k}")
        if self.zero_init and self.tie_weights:
            raise ValueError("zero_init needs tie_weights=False: a zero head tied to the token embedding "
                             "would zero the embedding")
        if self.attn_softcap is not None:
            check_softcap_backend(self.backend, "attn_softcap")
        if self.sliding_window is not None and self.sliding_window > self.block_size:
            raise ValueError(f"sliding_window must be at most block_size={self.block_size}, the context, got "
                             f"{self.sliding_window} (None: the whole context)")

    def is_moe_layer(self, layer: int) -> bool:
        """Block `layer` (0-based) is MoE: experts on, past the dense ones, on the moe_every grid."""
        return (self.n_experts > 0 and layer >= self.first_dense_layers
                and (layer - self.first_dense_layers) % self.moe_every == 0)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants that are on: the `VARIANTS` fields set, and "alibi" for pos_encoding="alibi"."""
        return (*(name for name in VARIANTS if getattr(self, name)), *("alibi",) * (self.pos_encoding == "alibi"))


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, n, V) against targets (B, n) over the positions that are not
    IGNORE_INDEX; 0 when every position is (a mean over nothing would be NaN), found without a sync."""
    summed = F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    return summed / (targets != IGNORE_INDEX).sum().clamp_min(1)


class Block(nn.Module):
    """One GPT block, built from the GPTConfig it belongs to (pre-LN, as GPT-2 and nanoGPT):

        x = x + Dropout(Attn(LN_1(x)))     causal multi-head self-attention (rope rotates q and k)
        x = x + Dropout(FFN(LN_2(x)))      a dense FFN, or MoE where config.is_moe_layer(layer_index)

    Submodules, named as checkpoints and the Hugging Face weight maps (hf/gpt_layouts.py) know them:
    `self_attn`, `ff`, `norm1`, `norm2`. The variants are `VariantBlock`'s. Nothing is checked here: the
    config was, when it was built.
    """

    def __init__(self, config: GPTConfig, layer_index: int):
        super().__init__()
        c = config
        self.self_attn = self._attention(c)
        self.ff = _feed_forward(c, layer_index)
        self.norm1 = make_norm(c.norm, c.d_model, eps=c.norm_eps, bias=c.bias, validate_args=False)
        self.norm2 = make_norm(c.norm, c.d_model, eps=c.norm_eps, bias=c.bias, validate_args=False)
        self.dropout1, self.dropout2 = nn.Dropout(c.dropout), nn.Dropout(c.dropout)

    @staticmethod
    def _attention(c: GPTConfig) -> MultiHeadAttention:
        return MultiHeadAttention(c.d_model, c.n_heads, n_kv_heads=c.n_kv_heads, bias=c.bias, dropout=c.dropout,
                                  backend=c.backend, validate_args=False)

    def forward(self, x: Tensor, mask: AttentionMask | None = None, *, rope: Rotation | None = None,
                kv_cache: KVCache | None = None) -> Tensor:
        """x (B, n, d_model) -> (B, n, d_model). mask: the batch's causal `AttentionMask`, which `GPT`
        builds once for all its blocks (default: `own_mask`). kv_cache: x holds the positions after the
        cached ones."""
        mask = self.own_mask(x, kv_cache) if mask is None else mask
        h = self.norm1(x)
        x = x + self.dropout1(self.self_attn(h, h, h, mask, rope=rope, kv_cache=kv_cache))
        return x + self.dropout2(self.ff(self.norm2(x)))

    def own_mask(self, x: Tensor, kv_cache: KVCache | None = None) -> AttentionMask:
        """The causal mask of x (B, n, d_model), the positions after kv_cache's: a block called alone."""
        n = x.shape[1]
        return AttentionMask.causal(n, n if kv_cache is None else kv_cache.attended(n), device=x.device)

    def residual_projections(self) -> list[Tensor]:
        """The weights that write into the residual stream: W_o, and the FFN's W_2 (every expert's)."""
        if isinstance(self.ff, MoEFeedForward):
            shared = [] if self.ff.shared is None else [self.ff.shared.W_2.weight]
            return [self.self_attn.W_o.weight, self.ff.W_2, *shared]
        return [self.self_attn.W_o.weight, cast(FeedForward, self.ff).W_2.weight]


class VariantBlock(Block):
    """A GPT block with the variants its config turns on (the module docstring's table), each off by default:

        x = a · x + b · x0                 x0_mix: the embedding output x0 mixed in (`x0_mix` holds a, b)
        x = x + Dropout(Attn(LN_1(x)))     a `VariantAttention`: QK-norm, soft-caps, ALiBi, a sliding window
        x = x + Dropout(FFN(LN_2(x)))

    With value_residual the attention of every block after the first reads v ← λ · v + (1 − λ) · v_1, its
    values mixed with the first block's (`value_residual` holds λ; the first block has none). A `VariantGPT`
    builds these and hands each the embedding output x0 and the first block's values v_1.
    """

    def __init__(self, config: GPTConfig, layer_index: int):
        super().__init__(config, layer_index)
        self.x0_mix = EmbeddingShortcut() if config.x0_mix else None
        self.value_residual = ValueResidual() if config.value_residual and layer_index > 0 else None
        self.shares_values = config.value_residual

    @staticmethod
    def _attention(c: GPTConfig) -> VariantAttention:
        return VariantAttention(c.d_model, c.n_heads, n_kv_heads=c.n_kv_heads, bias=c.bias, dropout=c.dropout,
                                backend=c.backend, qk_norm=c.qk_norm, norm_eps=c.norm_eps, softcap=c.attn_softcap,
                                alibi=c.pos_encoding == "alibi", window=c.sliding_window, validate_args=False)

    def forward(self, x: Tensor, mask: AttentionMask | None = None, *,  # type: ignore[override]  # and v_1
                rope: Rotation | None = None, kv_cache: KVCache | None = None, x0: Tensor | None = None,
                v1: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, n, d_model) -> (the block's output (B, n, d_model), the pass's first-layer values v_1).

        x0: the embedding output, for x0_mix (default: x, as for the first block). v1 (B, H_kv, n, d_k): with
        value_residual, the first block's values (None for the first block, which returns its own); without
        it, v_1 is None."""
        mask = self.own_mask(x, kv_cache) if mask is None else mask
        if self.x0_mix is not None:
            x = self.x0_mix(x, x if x0 is None else x0)
        h = self.norm1(x)
        v = self._values(h, v1)
        x = x + self.dropout1(self.self_attn(h, h, h, mask, rope=rope, kv_cache=kv_cache, values=v))
        return x + self.dropout2(self.ff(self.norm2(x))), v if v1 is None else v1

    def own_mask(self, x: Tensor, kv_cache: KVCache | None = None) -> AttentionMask:
        """`Block.own_mask` with the attention's window and ALiBi."""
        n = x.shape[1]
        attn = cast(VariantAttention, self.self_attn)
        return attn.causal_mask(n, n if kv_cache is None else kv_cache.attended(n), device=x.device)

    def _values(self, h: Tensor, v1: Tensor | None) -> Tensor | None:
        """With value_residual, the values this block's attention reads: h W^V (B, H_kv, n, d_k), mixed with
        v1 after the first block. Without it None: the attention projects its own."""
        if not self.shares_values:
            return None
        v = self.self_attn.project_v(h)
        return v if v1 is None or self.value_residual is None else self.value_residual(v, v1)


def _feed_forward(config: GPTConfig, layer_index: int) -> nn.Module:
    """Block `layer_index`'s FFN: on the config's MoE layers its SwiGLU experts (nn/moe.py, no bias,
    whatever `activation` says), elsewhere the dense FFN of `activation`."""
    c = config
    if c.is_moe_layer(layer_index):
        return MoEFeedForward(c.d_model, c.d_ff, c.n_experts, c.top_k, n_shared_experts=c.n_shared_experts,
                              capacity_factor=c.capacity_factor, bias_update_rate=c.bias_update_rate,
                              dropout=c.dropout, validate_args=False)
    return FeedForward(c.d_model, c.d_ff, c.activation, c.dropout, bias=c.bias, validate_args=False)


def moe_layer_count(config: GPTConfig) -> int:
    """How many of the blocks `GPTConfig.is_moe_layer` makes MoE, counted without a loop."""
    if not config.n_experts or config.n_layers <= config.first_dense_layers:
        return 0
    return -(-(config.n_layers - config.first_dense_layers) // config.moe_every)


class GPT(FamilyModel):
    """Decoder-only Transformer LM. forward(idx (B, n), targets (B, n) | None) -> (logits (B, n, V), loss).

    The equations at the top of this module and nothing else. `GPT(config)` with any of `config.variants` on
    builds a `VariantGPT` instead, as `pathlib.Path(...)` builds a `PosixPath`: the class is chosen once, here.
    """

    family = "gpt"
    config_class = GPTConfig
    config: GPTConfig
    tokenizer: Tokenizer | None
    block_class: ClassVar[type[Block]] = Block

    def __new__(cls, *args: Any, **kwargs: Any) -> GPT:
        config = args[0] if args else kwargs.get("config")
        chosen = VariantGPT if cls is GPT and isinstance(config, GPTConfig) and config.variants else cls
        return super().__new__(chosen)

    def __init__(self, config: GPTConfig):
        super().__init__(config)  # checked, and its bytes, before anything is allocated
        self._build_embeddings(config)
        self.rope = (RotaryEmbedding(config.head_dim, config.block_size, config.rope_base, validate_args=False)
                     if config.pos_encoding == "rope" else None)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(self.block_class(config, layer) for layer in range(config.n_layers))
        self.norm = make_norm(config.norm, config.d_model, eps=config.norm_eps, bias=config.bias,
                              validate_args=False)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        self._init_parameters()

    def _build_embeddings(self, config: GPTConfig) -> None:
        """E, and P where positions are learned or sinusoidal: h_0 = E[idx] + P."""
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position = self._make_position_encoding(config)

    def _init_parameters(self) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, and N(0, 0.02/√(2·n_layers)) for the residual projections."""
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in cast(Iterable[Block], self.blocks):
            for weight in block.residual_projections():
                nn.init.normal_(weight, std=residual_std)

    @classmethod
    def shallow(cls, config: GPTConfig) -> tuple[GPTConfig, dict[str, int]]:
        """One block of each kind, each counted as many times as there are of its kind: a dense block and a
        MoE block (where there are both), and with value_residual the first block apart (it has no λ)."""
        n, moe = config.n_layers, moe_layer_count(config)
        lead = [config.is_moe_layer(0)] if config.value_residual and n > 1 else []  # is it MoE
        rest, rest_moe = n - len(lead), moe - sum(lead)
        kinds = lead + [False] * (rest_moe < rest) + [True] * (rest_moe > 0)  # whether each block kept is MoE
        counts = [1] * len(lead) + [rest - rest_moe] * (rest_moe < rest) + [rest_moe] * (rest_moe > 0)
        first_moe = kinds.index(True) if True in kinds else len(kinds)
        moe_every = 2 if kinds[first_moe:] in ([True, False], [True, False, True]) else 1
        return (unchecked(config, n_layers=len(kinds), first_dense_layers=first_moe, moe_every=moe_every),
                {f"blocks.{i}": count for i, count in enumerate(counts)})

    @staticmethod
    def _make_position_encoding(config: GPTConfig) -> nn.Module | None:
        if config.pos_encoding == "learned":
            return LearnedPositionalEmbedding(config.d_model, config.block_size, validate_args=False)
        if config.pos_encoding == "sinusoidal":
            return SinusoidalPositionalEncoding(config.d_model, config.block_size, validate_args=False)
        return None

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, MoEFeedForward):
            for weight in (module.W_1, module.W_3, module.W_2):
                nn.init.normal_(weight, mean=0.0, std=0.02)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (a tied output projection is the embedding)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.token_embedding.weight.numel()
            if isinstance(self.position, LearnedPositionalEmbedding):
                total -= self.position.embedding.weight.numel()
        return total

    # ------------------------------------------------------------------ forward

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, kv_caches: list[KVCache] | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx (B, n) token ids -> logits (B, n, vocab_size) and the mean next-token loss.

        targets (B, n): the token that follows each position; IGNORE_INDEX (-100) marks positions to ignore.
        kv_caches (one per block): decode incrementally; idx then holds the new positions only.
        attention_mask (B, P + n) boolean, True = real token, over the P cached positions and idx: a
        batch of padded rows. Each row's positions count its real tokens only, and no token attends a
        padding one, so a row's logits are those of its tokens alone (as Hugging Face's attention_mask).
        """
        offset = self._check_inputs(idx, targets, kv_caches, attention_mask)
        logits = self.output_logits(self._hidden_states(idx, offset, kv_caches, attention_mask))
        if targets is None:
            return logits, None
        try:  # a target out of range makes the CPU loss raise IndexError: explained here, read nothing before
            loss = next_token_loss(logits, targets)
        except IndexError:
            raise ValueError(f"targets must hold token ids in [0, {self.config.vocab_size}) or IGNORE_INDEX "
                             f"({IGNORE_INDEX}) for positions to ignore") from None
        if self.training and self.config.n_experts:
            aux, z = mean_router_losses(moe_layers(self))
            loss = loss + self.config.aux_loss_coef * aux + self.config.z_loss_coef * z
        return logits, loss

    def output_logits(self, hidden: Tensor) -> Tensor:
        """h_L (B, n, d_model) -> logits (B, n, vocab_size) = Norm(h_L) W_headᵀ: what `forward` and decoding
        (`GPTDecoder`) both read."""
        return self.lm_head(self.norm(hidden))  # (B, n, vocab_size)

    def hidden_states(self, idx: Tensor, *, kv_caches: list[KVCache] | None = None,
                      attention_mask: Tensor | None = None) -> Tensor:
        """idx (B, n) -> h_L (B, n, d_model), the last block's output before the final norm."""
        offset = self._check_inputs(idx, None, kv_caches, attention_mask)
        return self._hidden_states(idx, offset, kv_caches, attention_mask)

    def _hidden_states(self, idx: Tensor, offset: int, kv_caches: list[KVCache] | None,
                       attention_mask: Tensor | None) -> Tensor:
        """h_0 = Dropout(E[idx] + P), then h_l = Block_l(h_{l-1}): idx (B, n) -> h_L (B, n, d_model)."""
        x = _checks.lookup_token_ids("idx", idx, self.config.vocab_size, self.token_embedding)  # (B, n, d_model)
        positions, mask, rope = self._positions_and_mask(idx, offset, kv_caches, attention_mask)
        if self.position is not None:
            x = self.position(x, offset=offset, positions=positions)
        x = self.dropout(x)
        for layer, block in enumerate(self.blocks):
            x = block(x, mask, rope=rope, kv_cache=None if kv_caches is None else kv_caches[layer])
        return x

    def _positions_and_mask(self, idx: Tensor, offset: int, kv_caches: list[KVCache] | None,
                            attention_mask: Tensor | None) -> tuple[Tensor | None, AttentionMask, Rotation | None]:
        """The batch's causal mask, built once for all the blocks; for padded rows (attention_mask) each row's
        positions (B, n), and rope at them."""
        n = idx.shape[1]
        keys = n if kv_caches is None else kv_caches[0].attended(n)  # a window's cache attends its last keys
        if attention_mask is None:
            return None, self._causal_mask(n, keys, idx.device), self.rope
        positions, mask = self._padded_mask(attention_mask, offset, keys)
        return positions, mask, None if self.rope is None else self.rope.at(positions)

    def _causal_mask(self, n: int, keys: int, device: torch.device) -> AttentionMask:
        """n queries, the last of `keys` positions, each seeing itself and the keys before it."""
        return AttentionMask.causal(n, keys, device=device)

    def _padded_mask(self, real: Tensor, offset: int, keys: int) -> tuple[Tensor, AttentionMask]:
        """`_causal_mask` for padded rows, real (B, offset + n), True = real token, and their positions (B, n)."""
        return padded_positions_and_mask(real, offset, keys=keys)

    def _check_inputs(self, idx: Tensor, targets: Tensor | None, kv_caches: list[KVCache] | None,
                      attention_mask: Tensor | None = None) -> int:
        """The batch's shapes and dtypes and the caches' count and room, read from metadata only (a bad
        token id is explained by `_checks.lookup_token_ids`): no device sync. Returns the position of
        idx[:, 0]."""
        _checks.check_token_id_tensor("idx", idx)
        if targets is not None:
            _checks.check_dtype("targets", _checks.check_same_shape("targets", targets, "idx", idx),
                                torch.long, "token ids as torch.long")
        if kv_caches is not None:
            _checks.check_one_per_layer("kv_caches", kv_caches, self.config.n_layers, "cache")
        offset = 0 if kv_caches is None else kv_caches[0].length
        _checks.check_context("idx", idx.shape[1], offset, self.config.block_size)
        if attention_mask is not None:
            _checks.check_key_padding_mask("attention_mask", attention_mask, idx.shape[0], offset + idx.shape[1],
                                           idx.device)
        return offset

    # ------------------------------------------------------------------ generation

    def new_kv_caches(self, batch_size: int) -> list[KVCache]:
        """One preallocated (B, n_kv_heads, block_size, head_dim) cache per block; with a sliding window w,
        (B, n_kv_heads, min(w, block_size), head_dim), rolling."""
        _checks.check_positive_int("batch_size", batch_size)
        parameter = self.token_embedding.weight
        n_kv_heads = self.config.n_kv_heads or self.config.n_heads
        return [KVCache(batch_size, n_kv_heads, self.config.block_size, self.config.head_dim,
                        dtype=parameter.dtype, device=parameter.device, window=self.config.sliding_window,
                        validate_args=False)
                for _ in range(self.config.n_layers)]

    def decoder(self) -> GPTDecoder:
        """This model as `generation.iter_generate` drives it fastest (see `GPTDecoder`)."""
        return GPTDecoder(self)

    def generate(self, idx: Tensor | Sequence[Sequence[int] | Tensor], max_new_tokens: int, *,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 use_cache: bool = True, generator: Generators = None, eos_id: int | None = None,
                 stop: Sequence[str] = ()) -> Tensor | list[list[int]]:
        """Extend prompts idx (B, n) by max_new_tokens sampled tokens -> (B, n + max_new_tokens).

        Or idx is a list of prompts of any lengths (lists of ids or 1-D tensors), decoded in one
        left-padded batch, each row as it would be alone -> a list of each prompt's ids with its new
        ones, which end after `eos_id` or after the token that completes one of the `stop` strings
        (decoded by `self.tokenizer`). `generator`: one, or one per prompt.

        temperature 0 is greedy decoding. Past block_size the context slides (see `generation`).
        The prompt's ids are checked once here; the decoding steps check nothing that needs a sync.
        """
        options: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, use_cache=use_cache,
                                       generator=generator)
        if eos_id is not None:
            _checks.check_index("eos_id", eos_id, self.config.vocab_size, "vocab_size")
        # why inference_mode: no autograd bookkeeping at all, unlike no_grad
        if isinstance(idx, Tensor):
            _checks.check_token_ids("idx", idx, self.config.vocab_size)
            if stop:
                raise ValueError("stop strings end rows of different lengths: give the prompts as a list")
            with eval_mode(self), torch.inference_mode():
                return generate_tokens(self.decoder(), idx, max_new_tokens, eos_id=eos_id, **options)
        prompts, pads = pad_prompts(idx, device=self.token_embedding.weight.device)
        _checks.check_token_ids("idx", prompts, self.config.vocab_size)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer to read the text; this GPT has none")
        stops = StopStrings(self.tokenizer.decode, stop) if stop and self.tokenizer is not None else None
        with eval_mode(self), torch.inference_mode():
            return generate_padded(self.decoder(), prompts, pads, max_new_tokens, eos_id=eos_id, stop=stops,
                                   **options)


class VariantGPT(GPT):
    """A GPT with the variants its config turns on (the module docstring's table), of `VariantBlock`s;
    `GPT(config)` builds one when any is on. Around the blocks it holds the terms the variants add to h_0
    (`token_shift`, `bigram`, `embed_norm`, each None where off), soft-caps the logits (logit_softcap),
    starts at zero (zero_init), and hands every block the embedding output x0 and the first block's values v_1.
    """

    block_class = VariantBlock

    def _build_embeddings(self, config: GPTConfig) -> None:
        """E, σ(g) and B (previous-token terms), P and embed_norm's RMSNorm, in the order checkpoints hold them."""
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.token_shift = TokenShift(config.d_model) if config.token_shift else None
        self.bigram = BigramEmbedding(config.vocab_size, config.d_model) if config.bigram_embedding else None
        self.position = self._make_position_encoding(config)
        self.embed_norm = (RMSNorm(config.d_model, eps=config.norm_eps, validate_args=False)
                           if config.embed_norm else None)

    def _init_parameters(self) -> None:
        super()._init_parameters()
        if self.config.zero_init:  # every residual branch adds 0 at first, and every logit is 0 (an untied head)
            for block in cast(Iterable[Block], self.blocks):
                for weight in block.residual_projections():
                    nn.init.zeros_(weight)
            nn.init.zeros_(self.lm_head.weight)
        if self.bigram is not None:  # _init_weights drew it as any embedding: it starts at 0, as a no-op
            nn.init.zeros_(self.bigram.table.weight)

    def _causal_mask(self, n: int, keys: int, device: torch.device) -> AttentionMask:
        return self._blocks_attention().causal_mask(n, keys, device=device)  # the window and ALiBi of every block

    def _padded_mask(self, real: Tensor, offset: int, keys: int) -> tuple[Tensor, AttentionMask]:
        return self._blocks_attention().padded_mask(real, offset, keys=keys)

    def _blocks_attention(self) -> VariantAttention:
        return cast(VariantAttention, cast(Block, self.blocks[0]).self_attn)

    def output_logits(self, hidden: Tensor) -> Tensor:
        """`GPT.output_logits`, then c · tanh(logits / c) with logit_softcap c."""
        logits = super().output_logits(hidden)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _hidden_states(self, idx: Tensor, offset: int, kv_caches: list[KVCache] | None,
                       attention_mask: Tensor | None) -> Tensor:
        """x0 = h_0 = Dropout(Norm(E[idx] + the previous-token terms + P)), then each block given x0 and v_1."""
        x = _checks.lookup_token_ids("idx", idx, self.config.vocab_size, self.token_embedding)  # (B, n, d_model)
        if self.token_shift is not None or self.bigram is not None:
            x = self._add_previous_token_terms(x, idx, offset, kv_caches, attention_mask)
        positions, mask, rope = self._positions_and_mask(idx, offset, kv_caches, attention_mask)
        if self.position is not None:
            x = self.position(x, offset=offset, positions=positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x0 = x = self.dropout(x)
        v1 = None
        for layer, block in enumerate(self.blocks):
            cache = None if kv_caches is None else kv_caches[layer]
            x, v1 = block(x, mask, rope=rope, kv_cache=cache, x0=x0, v1=v1)
        return x

    def _add_previous_token_terms(self, x: Tensor, idx: Tensor, offset: int, kv_caches: list[KVCache] | None,
                                  attention_mask: Tensor | None) -> Tensor:
        """x = E[idx] (B, n, d_model) + σ(g) ⊙ E[x_{t−1}] + B[x_{t−1} · V + x_t], the terms that are on.
        With caches, the predecessor of idx[:, 0] is the first cache's newest token, and idx's last token
        is kept there for the next call."""
        last = kv_caches[0].last_tokens() if kv_caches is not None and offset > 0 else None
        previous, has = previous_tokens(idx, offset, last, attention_mask)  # (B, n) each
        if kv_caches is not None:
            kv_caches[0].set_last_tokens(idx[:, -1])
        if self.token_shift is not None:
            x = x + self.token_shift(self.token_embedding(previous), has)
        if self.bigram is not None:
            x = x + self.bigram(idx, previous, has)
        return x
