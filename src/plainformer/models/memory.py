"""How many bytes a model needs, estimated from its config before anything is built.

A config of `n_layers=10**6` or `block_size=10**9` is valid arithmetic and an impossible model: building
it runs for minutes, or until the allocator gives up with a traceback. Every estimate here is arithmetic
on the config's sizes (no tensor is made), and `check_memory` refuses a config whose estimate exceeds
the memory available, naming the size that is to blame.

A model (`footprint`, `model_bytes`, exact but for the per-tensor overhead):

    bytes = P · s + buffers + N_tensors · 2 kB         s = the bytes of an element (4 in float32)

P counts each parameter once (a tied output projection is the embedding): for a GPT

    P = V d (+ V d untied) (+ block_size · d learned positions) + final norm
        + Σ_l [ d (d + 2 d_kv) + d² (+ biases) + 2 norms + FFN_l ]
    FFN_l = (2 or 3, SwiGLU) · d · d_ff dense;  d E + 3 E d d_ff + 3 d · S d_ff on a MoE layer

with d_kv = n_kv_heads · d / n_heads; BERT and the encoder-decoder add their own tables and heads the
same way. The buffers are the float32 tables: rotary cos and sin, 2 · block_size · d/n_heads; sinusoidal
positions, block_size · d (one per stack in the encoder-decoder); a MoE layer's balancing bias and
load counts. 2 kB per tensor is what the Python objects of a tiny tensor and its module measured (about
2.7 kB), which is what a 100,000-layer model of tiny widths mostly costs. Building briefly holds a
little more: the float64 tables the positional buffers are computed from, an output projection before
it is tied.

Training one micro-batch of B rows of n tokens (`training_bytes`, an estimate, on the high side):

    bytes = model + 4 · P_trained · (1 + m) + 4 · A,     m = 2 moments (AdamW), 1 for the matrices Muon trains
    A = B n [ Σ_l (7 d + 2 d_kv + a · d_ff + w + r) + 3 d + 3 V ]

A counts the float32 activations autograd keeps: per layer the residual input and the norm's output of
each sublayer, q, k, v, the attention output before and after merging the heads, and the FFN's hidden
states (a = 2, or 4 for SwiGLU; on a MoE layer, top_k experts' worth and the router's logits); w, the
attention weights per query where they are materialised: 3 h n with attention dropout (the weights, the
dropped weights, the mask), h n on the math path, h n / 2 under backend "auto" on at most 512 keys
(the math path, in bfloat16), none in the fused kernels; r = 5/4 d_ff + d/2 with dropout, its masks and
the dropped hidden state W_2 reads; then the logits, their log-softmax and their gradient, V each.
BERT's masked LM scores the 15% selected positions only; the encoder-decoder adds the cross-attention
of each decoder layer and its keys and values over the source. Against the tensors autograd saves
(with the logits and their gradient), this is 0.9 to 1.3 times as much on small GPTs, BERTs and
encoder-decoders (tests/models/test_memory.py). An evaluation batch
(`forward_bytes`) keeps one layer's transients at a time and the logits; decoding (`decoding_bytes`,
`beam_search_bytes`) keeps the KV caches of every layer for every row. These three count what a model
needs beyond its own bytes: they are checked once it is loaded, with `held` = what it holds.

`available_memory` is the machine's MemAvailable (/proc/meminfo; else the free pages os.sysconf gives),
lowered to what RLIMIT_AS leaves this process when it is set; within `memory_limit(bytes)` it is the
limit given instead (the command line's --max-memory, for those who know better). A model built on
the meta device allocates nothing and is not checked.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _checks

try:
    import resource
except ImportError:  # not on Windows: no RLIMIT_AS to honour there
    resource = None  # type: ignore[assignment]

FLOAT32 = 4
TENSOR_OVERHEAD = 2048  # bytes per tensor beyond its elements: the Python objects (see the docstring)
MLM_SELECTED = 0.15  # the share of positions a masked LM scores (data/mlm.py)
MATH_KEYS = 512  # at most this many keys, backend "auto" takes the math path in bfloat16 (nn/attention.py)
EXTRA_OUTPUT_TOKENS = 50  # translating stops here past the source length (Vaswani et al., section 6.1)
FAMILIES = ("gpt", "bert", "bert-mlm", "bert-cls", "transformer")
_DEFAULT_FAMILY = {"GPTConfig": "gpt", "BertConfig": "bert", "TransformerConfig": "transformer"}

_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("plainformer_memory_limit", default=None)


class MemoryBudgetError(ValueError):
    """A config (or a batch, a beam) whose estimated bytes exceed the memory available."""


# ----------------------------------------------------------------------------- what a model holds

@dataclasses.dataclass
class Footprint:
    """What a model holds: its parameters (each counted once), those of them that are the 2-D weights of
    linear layers inside the blocks (what Muon trains), its tensors (parameters and buffers) and the
    bytes of its buffers."""

    parameters: int = 0
    block_matrices: int = 0
    tensors: int = 0
    buffer_bytes: int = 0

    def weight(self, numel: int, *, block_matrix: bool = False) -> None:
        self.parameters += numel
        self.block_matrices += numel if block_matrix else 0
        self.tensors += 1

    def linear(self, d_in: int, d_out: int, bias: bool, *, in_block: bool = True) -> None:
        self.weight(d_in * d_out, block_matrix=in_block)
        if bias:
            self.weight(d_out)

    def norm(self, kind: str, d: int, bias: bool) -> None:
        """A LayerNorm (weight, and bias when `bias`) or an RMSNorm (weight only)."""
        self.weight(d)
        if kind == "layernorm" and bias:
            self.weight(d)

    def buffer(self, nbytes: int) -> None:
        self.buffer_bytes += nbytes
        self.tensors += 1

    def add(self, other: Footprint, times: int = 1) -> None:
        """Add `times` copies of `other` (a stack of identical layers)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + times * getattr(other, field.name))


def _family(config: Any, family: str | None) -> str:
    family = family or _DEFAULT_FAMILY.get(type(config).__name__)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)} for a {type(config).__name__}, "
                         f"got {family!r}")
    return family


def _kv_width(config: Any) -> int:
    """d_kv = n_kv_heads · d_model / n_heads, the width of the keys (and of the values)."""
    n_kv_heads = getattr(config, "n_kv_heads", None) or config.n_heads
    return n_kv_heads * (config.d_model // config.n_heads)


def _attention(f: Footprint, d: int, d_kv: int, bias: bool) -> None:
    """W_q, W_k, W_v, W_o of `nn.attention.MultiHeadAttention` (d_model divisible by n_heads)."""
    for d_out in (d, d_kv, d_kv):
        f.linear(d, d_out, bias)
    f.linear(d, d, bias)


def _feed_forward(f: Footprint, d: int, d_ff: int, activation: str, bias: bool) -> None:
    """`nn.feedforward.FeedForward`: W_1, W_3 for SwiGLU, W_2."""
    for _ in range(2 if activation == "swiglu" else 1):
        f.linear(d, d_ff, bias)
    f.linear(d_ff, d, bias)


def _moe_layers(config: Any) -> int:
    """How many of a GPT's blocks `GPTConfig.is_moe_layer` makes MoE, counted without a loop."""
    if not config.n_experts or config.n_layers <= config.first_dense_layers:
        return 0
    return -(-(config.n_layers - config.first_dense_layers) // config.moe_every)


def _gpt_block(config: Any, moe: bool) -> Footprint:
    c, f = config, Footprint()
    _attention(f, c.d_model, _kv_width(c), c.bias)
    f.norm(c.norm, c.d_model, c.bias)
    f.norm(c.norm, c.d_model, c.bias)
    if not moe:
        _feed_forward(f, c.d_model, c.d_ff, c.activation, c.bias)
        return f
    f.linear(c.d_model, c.n_experts, False)  # the router
    for _ in range(3):  # W_1, W_3, W_2: (E, d_ff, d_model) parameters, no nn.Linear
        f.weight(c.n_experts * c.d_ff * c.d_model)
    if c.n_shared_experts:
        _feed_forward(f, c.d_model, c.n_shared_experts * c.d_ff, "swiglu", False)
    f.buffer(FLOAT32 * c.n_experts)  # expert_bias
    f.buffer(8 * c.n_experts)  # step_load, int64
    return f


def _gpt(config: Any) -> Footprint:
    c, f = config, Footprint()
    f.weight(c.vocab_size * c.d_model)  # the token embedding, and the head when tied
    if c.pos_encoding == "learned":
        f.weight(c.block_size * c.d_model)
    elif c.pos_encoding == "sinusoidal":
        f.buffer(FLOAT32 * c.block_size * c.d_model)
    else:  # rope: cos and signed sin, (block_size, head_dim) each
        for _ in range(2):
            f.buffer(FLOAT32 * c.block_size * (c.d_model // c.n_heads))
    moe = _moe_layers(c)
    f.add(_gpt_block(c, moe=False), c.n_layers - moe)
    f.add(_gpt_block(c, moe=True), moe)
    f.norm(c.norm, c.d_model, c.bias)
    if not c.tie_weights:
        f.linear(c.d_model, c.vocab_size, False, in_block=False)
    return f


def _residual_layer(config: Any, cross_attention: bool) -> Footprint:
    """`nn.blocks.EncoderLayer` / `DecoderLayer` as the BERT and encoder-decoder configs build them:
    biases everywhere, LayerNorms."""
    c, f = config, Footprint()
    for _ in range(2 if cross_attention else 1):
        _attention(f, c.d_model, _kv_width(c), True)
    _feed_forward(f, c.d_model, c.d_ff, c.activation, True)
    for _ in range(3 if cross_attention else 2):
        f.norm("layernorm", c.d_model, True)
    return f


def _bert(config: Any, family: str) -> Footprint:
    c, f = config, Footprint()
    for rows in (c.vocab_size, c.max_len, c.type_vocab_size):  # word, position, token type
        f.weight(rows * c.d_model)
    f.norm("layernorm", c.d_model, True)
    f.add(_residual_layer(c, cross_attention=False), c.n_layers)
    f.linear(c.d_model, c.d_model, True, in_block=False)  # the pooler
    if family == "bert-mlm":  # dense, LayerNorm, the output bias (the decoder is the word embedding)
        f.linear(c.d_model, c.d_model, True, in_block=False)
        f.norm("layernorm", c.d_model, True)
        f.weight(c.vocab_size)
    elif family == "bert-cls":
        f.linear(c.d_model, c.n_labels, True, in_block=False)
    return f


def _transformer(config: Any) -> Footprint:
    c, f = config, Footprint()
    stacks = ((c.src_vocab_size, c.encoder_layers, False), (c.tgt_vocab_size, c.decoder_layers, True))
    for vocab_size, n_layers, cross_attention in stacks:
        if not (cross_attention and c.share_embeddings):
            f.weight(vocab_size * c.d_model)
        f.buffer(FLOAT32 * c.max_len * c.d_model)  # the sinusoidal table
        f.add(_residual_layer(c, cross_attention), n_layers)
        if c.norm_first:
            f.norm("layernorm", c.d_model, True)
    if not c.tie_weights:
        f.linear(c.d_model, c.tgt_vocab_size, False, in_block=False)
    return f


def footprint(config: Any, family: str | None = None) -> Footprint:
    """What the model of `config` holds. family: "gpt", "bert", "bert-mlm", "bert-cls" or "transformer"
    (default: the config's own model, BertModel for a BertConfig)."""
    family = _family(config, family)
    if family == "gpt":
        return _gpt(config)
    if family == "transformer":
        return _transformer(config)
    return _bert(config, family)


def parameter_count(config: Any, family: str | None = None) -> int:
    """The parameters of the model of `config`, each counted once: sum(p.numel() for p in model.parameters())."""
    return footprint(config, family).parameters


def model_bytes(config: Any, dtype: torch.dtype = torch.float32, family: str | None = None) -> int:
    """The bytes of the model of `config` with its parameters in `dtype`: parameters, buffers (float32,
    as built) and the per-tensor overhead."""
    f = footprint(config, family)
    return f.parameters * _itemsize(dtype) + f.buffer_bytes + f.tensors * TENSOR_OVERHEAD


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes a built model holds in its parameters and buffers (each tensor once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- activations

def _attention_dropout(c: Any) -> float:
    return getattr(c, "attention_dropout", c.dropout)


def _scores(c: Any, keys: int) -> int:
    """Elements kept per query for the attention weights, where they are materialised: with attention
    dropout (the weights, the dropped weights and the mask), on the math path, or under backend "auto"
    on at most 512 keys (the math path in bfloat16: half the bytes)."""
    if _attention_dropout(c) > 0:
        return 3 * c.n_heads * keys
    if c.backend == "math":
        return c.n_heads * keys
    return c.n_heads * keys // 2 if c.backend == "auto" and keys <= MATH_KEYS else 0


def _hidden(activation: str, d_ff: int) -> int:
    return (4 if activation == "swiglu" else 2) * d_ff


def _dropout(c: Any, d_ff: int) -> int:
    """Dropout's masks (a byte an element) and the dropped FFN hidden state W_2 takes."""
    return (5 * d_ff) // 4 + c.d_model // 2 if c.dropout > 0 else 0


def _layer_activations(c: Any, keys: int) -> int:
    """Elements kept per token by one dense self-attention layer (see the module docstring)."""
    return (7 * c.d_model + 2 * _kv_width(c) + _hidden(c.activation, c.d_ff) + _scores(c, keys)
            + _dropout(c, c.d_ff))


def _moe_activations(c: Any, keys: int) -> int:
    """A MoE layer: top_k experts' inputs, hidden states and outputs per token, the router's logits."""
    shared = c.n_shared_experts * c.d_ff
    experts = c.top_k * (2 * c.d_model + _hidden("swiglu", c.d_ff)) + _hidden("swiglu", shared)
    return (_layer_activations(c, keys) - _hidden(c.activation, c.d_ff) - _dropout(c, c.d_ff) + experts
            + _dropout(c, shared) + 2 * c.n_experts)


def _cross_activations(c: Any, keys: int) -> int:
    """A decoder layer's cross-attention per target token: the norm's input and output, q, the attention
    output before and after merging the heads, the weights where materialised."""
    return 5 * c.d_model + _scores(c, keys)


def activation_bytes(config: Any, batch_size: int, seq_len: int | None = None, family: str | None = None) -> int:
    """The bytes autograd keeps for one training micro-batch of `batch_size` rows of `seq_len` tokens
    (default: the config's context, block_size or max_len), in float32 (see the module docstring)."""
    c, family = config, _family(config, family)
    if family == "gpt":
        n = seq_len or c.block_size
        moe = _moe_layers(c)
        per_token = ((c.n_layers - moe) * _layer_activations(c, n) + moe * _moe_activations(c, n)
                     + 3 * c.d_model + 3 * c.vocab_size)
        return FLOAT32 * batch_size * n * per_token
    if family == "transformer":
        n = seq_len or c.max_len  # sources and targets alike
        encoder = c.encoder_layers * _layer_activations(c, n)
        # per target token; the cross-attention's keys and values, 2 d_kv per source token, as many
        decoder = c.decoder_layers * (_layer_activations(c, n) + _cross_activations(c, n) + 2 * _kv_width(c))
        return FLOAT32 * batch_size * n * (encoder + decoder + 4 * c.d_model + 3 * c.tgt_vocab_size)
    n = seq_len or c.max_len
    tokens = batch_size * n
    total = tokens * (c.n_layers * _layer_activations(c, n) + 3 * c.d_model)
    if family == "bert-mlm":
        total += math.ceil(MLM_SELECTED * tokens) * (3 * c.d_model + 3 * c.vocab_size)
    elif family == "bert-cls":
        total += batch_size * (2 * c.d_model + 3 * c.n_labels)
    return FLOAT32 * total


def _output_vocab(config: Any, family: str) -> int:
    """The width of the logits the model scores every position with (0: a pooled head, or none)."""
    if family in ("gpt", "bert-mlm"):
        return config.vocab_size
    return config.tgt_vocab_size if family == "transformer" else 0


def _forward(config: Any, rows: int, n: int, itemsize: int, vocab: int) -> int:
    """A forward pass without autograd over `rows` rows of `n` tokens: one layer's transients at a time
    (the residual stream, the norm's output, q, k, v, the attention's output and weights, the FFN's
    hidden states) in elements of `itemsize` bytes, and float32 logits of width `vocab` with their
    log-softmax at every position."""
    c = config
    transients = 4 * c.d_model + 2 * _kv_width(c) + _hidden(c.activation, c.d_ff) + c.n_heads * n
    return rows * n * (itemsize * transients + FLOAT32 * 2 * vocab)


def context_length(config: Any) -> int:
    """The positions a model of `config` takes: a GPT's block_size, the others' max_len."""
    return getattr(config, "block_size", None) or config.max_len


def forward_bytes(config: Any, rows: int, seq_len: int | None = None, family: str | None = None,
                  dtype: torch.dtype = torch.float32) -> int:
    """The bytes beyond the model's own of evaluating `rows` rows of `seq_len` tokens at once (default:
    the config's context) with the model in `dtype`: a forward pass without autograd."""
    family = _family(config, family)
    n = seq_len or context_length(config)
    return _forward(config, rows, n, _itemsize(dtype), _output_vocab(config, family))


def training_bytes(config: Any, batch_size: int, *, seq_len: int | None = None, optimizer: str = "adamw",
                   family: str | None = None, trainable: int | None = None, eval_batch_size: int | None = None
                   ) -> int:
    """The bytes of training the model of `config` at `batch_size` rows of `seq_len` tokens: the model,
    a float32 gradient and the optimizer's state of every trained parameter (`trainable` of them,
    default all; AdamW keeps 2 moments, Muon 1 for the block matrices, when all are trained), and the
    larger of the training activations and an evaluation batch of `eval_batch_size` rows (default
    batch_size)."""
    family = _family(config, family)
    f = footprint(config, family)
    trained = f.parameters if trainable is None else trainable
    moments = 2 * trained - (f.block_matrices if optimizer == "muon" and trainable is None else 0)
    activations = max(activation_bytes(config, batch_size, seq_len, family),
                      forward_bytes(config, eval_batch_size or batch_size, seq_len, family))
    return model_bytes(config, family=family) + FLOAT32 * (trained + moments) + activations


def decoding_bytes(config: Any, rows: int, prompt_len: int, dtype: torch.dtype = torch.float32) -> int:
    """The bytes beyond the model's own of sampling `rows` rows from a GPT in `dtype` at once: a KV cache
    of block_size positions per layer and row, the prompt's forward pass (the logits of its last
    position only) and the float32 logits of each step."""
    c, itemsize = config, _itemsize(dtype)
    caches = c.n_layers * 2 * _kv_width(c) * c.block_size * itemsize
    prompt = _forward(c, 1, min(prompt_len, c.block_size), itemsize, 0)
    return rows * (caches + prompt + FLOAT32 * 3 * c.vocab_size)


def beam_search_bytes(config: Any, sentences: int, beam_size: int, source_len: int) -> int:
    """The bytes beyond the model's own of translating `sentences` sources of up to `source_len` tokens at
    once with `beam_size` hypotheses each: the encoder's pass, and per hypothesis the self-attention
    caches of every decoder layer (min(source_len + 50, max_len) positions), the cross-attention keys
    and values and the memory over the source, the scores of each step and the tokens."""
    c = config
    steps = min(source_len + EXTRA_OUTPUT_TOKENS, c.max_len)
    per_row = (FLOAT32 * (c.decoder_layers * 2 * _kv_width(c) * (steps + source_len) + source_len * c.d_model
                          + 3 * c.tgt_vocab_size) + 8 * steps)
    return _forward(c, sentences, source_len, FLOAT32, 0) + sentences * beam_size * per_row


def largest_beam(config: Any, sentences: int, source_len: int, held: int = 0) -> int:
    """The largest beam that fits the memory available for `sentences` sources at once (0 when not even
    one does), at most the target vocabulary; `held`: the bytes of the model, loaded already."""
    encoder = beam_search_bytes(config, sentences, 0, source_len)
    per_beam = beam_search_bytes(config, sentences, 1, source_len) - encoder
    room = available_memory(held) - held - encoder
    return max(0, min(config.tgt_vocab_size, room // per_beam))


# ----------------------------------------------------------------------------- the memory available

def available_memory(held: int = 0) -> int:
    """The bytes this process may use: `memory_limit`'s when one is set, else the machine's MemAvailable,
    lowered to what RLIMIT_AS leaves (see the module docstring), plus `held`, bytes it holds already for
    what is estimated (a model loaded before its decoding is checked)."""
    limit = _limit.get()
    return limit if limit is not None else _machine_available() + held


@contextlib.contextmanager
def memory_limit(limit: int | None) -> Iterator[None]:
    """Within: `available_memory()` is `limit` bytes instead of the machine's (None: no change)."""
    if limit is None:
        yield
        return
    _checks.check_positive_int("limit", limit)
    token = _limit.set(limit)
    try:
        yield
    finally:
        _limit.reset(token)


def _machine_available() -> int:
    free = _meminfo("/proc/meminfo", "MemAvailable")
    if free is None:
        free = _sysconf_bytes("SC_AVPHYS_PAGES")
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            left = max(0, soft - (_meminfo("/proc/self/status", "VmSize") or 0))
            free = left if free is None else min(free, left)
    return free if free is not None else 2**63  # nothing known: nothing refused


def _meminfo(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_bytes(name: str) -> int | None:
    try:
        return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------- refusing

def check_memory(what: str, estimate: Callable[..., int], *configs: Any, held: int = 0) -> int:
    """estimate(*configs) bytes, or a MemoryBudgetError when that exceeds `available_memory(held)`
    (`held`: bytes of the estimate allocated already, a model loaded).

    `what` says what needs them, with `{needed}` where the estimate goes ("training needs ~{needed}").
    The message names the size to blame: the int field of one of `configs` whose return to its default
    lowers the estimate most (n_layers=1000000, batch_size=100000000)."""
    needed = estimate(*configs)
    available = available_memory(held)
    if needed <= available:
        return needed
    blamed = _blamed_field(estimate, configs, needed)
    where = f"{blamed[0]}={blamed[1]}: " if blamed is not None else ""
    raise MemoryBudgetError(f"{where}{what.format(needed=format_size(needed))}, more than {available_phrase(held)}")


def available_phrase(held: int = 0) -> str:
    """"the 20.1 GB available", or "the 1.0 GB allowed" within `memory_limit`: what a refusal compares with."""
    allowed = "allowed" if _limit.get() is not None else "available"
    return f"the {format_size(available_memory(held))} {allowed}"


def check_model_memory(config: Any, family: str | None = None) -> None:
    """A MemoryBudgetError when the model of `config` would not fit the memory available: what the
    constructors call before they build anything (not on the meta device, where nothing is allocated)."""
    if torch.get_default_device().type == "meta":
        return
    check_memory("the model needs ~{needed} for its parameters and buffers", lambda c: model_bytes(c, family=family),
                 config)


def _blamed_field(estimate: Callable[..., int], configs: tuple[Any, ...], needed: int) -> tuple[str, int] | None:
    """(name, value) of the int field whose default, put back, lowers the estimate (`needed`) most; None
    when none lowers it."""
    found: list[tuple[int, int, str, int]] = []
    for position, config in enumerate(configs):
        for field in dataclasses.fields(config):
            value, default = getattr(config, field.name), field.default
            if not _checks.is_int(value) or not (default is None or _checks.is_int(default) and value > default):
                continue
            trial = copy.copy(config)  # unchecked: a default may not fit the other fields' rules
            setattr(trial, field.name, default)
            try:
                lowered = estimate(*configs[:position], trial, *configs[position + 1:])
            except TypeError:  # a None default where the estimate needs a number
                continue
            if lowered < needed:
                found.append((lowered, len(found), field.name, value))
    return min(found)[2:] if found else None


_UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtpe])(i?)b?|b?)\s*", re.IGNORECASE)


def format_size(nbytes: int) -> str:
    """812 B, 20.1 GB, 3.2 TB (powers of 1000), 4.1e+27 B beyond exabytes."""
    if nbytes < 1000:
        return f"{nbytes} B"
    exponent = min(int(math.log10(nbytes) // 3), len(_UNITS) - 1)
    value = nbytes / 1000 ** exponent
    return f"{value:.1f} {_UNITS[exponent]}" if value < 1000 else f"{nbytes:.1e} B"


def parse_size(text: str) -> int:
    """Bytes from a size: 64GB, 1.5 TB, 512MiB, 800k, 1000000 (a bare number is bytes; k, M, G, T, P, E are
    powers of 1000, Ki, Mi, ... of 1024; the B is optional and the case free). A ValueError otherwise."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected a size such as 64GB or 512MiB, got {text!r}")
    number, prefix, binary = match.groups()
    power = 0 if prefix is None else "kmgtpe".index(prefix.lower()) + 1
    size = round(float(number) * (1024 if binary else 1000) ** power)
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return size
