"""How many bytes a model needs beyond its own, from its config, before anything is allocated: each
family's formula, stated once, and the checks the commands call at their boundaries.

Where memory is handled, one concern a layer:

- the base module plainformer/memory.py: the machine's memory, the limit (--max-memory), sizes written and
  read, `check_memory`, the refusal that names the size to blame, and what a model *holds*, counted on
  the meta device from its class (`footprint`, with the class's `shallow` stack of one layer a kind) and
  priced by `model_bytes`: in the bottom layer, because a model's constructor, a checkpoint's loader and
  Hugging Face's reader refuse a model too large before they build it. A model file holds no arithmetic
  of memory: its class says only how its stacks are shallowed.
- here, above the models: what a model *keeps while it runs*, training, evaluating, sampling, translating:
  arithmetic on the config's sizes. The shared blocks' terms first (attention, FFN, norms), then each
  family's sums, registered once by its family's name in `TRAINING_ACTIVATIONS` and `OUTPUT_VOCAB`, then
  the estimates (`training_bytes`, `forward_bytes`, `decoding_bytes`, `beam_search_bytes`) and the checks
  that hold them to the memory available (`check_evaluation_memory`, `check_decoding_memory`,
  `check_beam_memory`; a training run's, `check_training_memory`, reads a `Run`, and sits beside it in
  family.py). No model file holds this arithmetic.

Training one micro-batch of B rows of n tokens (`training_bytes`, an estimate, on the high side):

    bytes = model + 4 · P_trained · (1 + m) + 4 · A,     m = 2 moments (AdamW), 1 for the matrices Muon trains

with A the activations autograd keeps, in float32:

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

Against the tensors autograd saves (with the logits and their gradient), this is 0.9 to 1.3 times as
much on small GPTs, BERTs and encoder-decoders (tests/families/test_memory_estimates.py). An evaluation
batch (`forward_bytes`) keeps one layer's transients at a time and the logits; decoding keeps the KV
caches of every layer for every row. These count what a model needs beyond its own bytes: they are
checked once it is loaded, with `held` = what it holds.

The family of an estimate is a class's `family` ("gpt", "bert-mlm", ...), by default the first class of
the config's type (BertModel for a BertConfig).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..memory import TENSOR_OVERHEAD as TENSOR_OVERHEAD
from ..memory import Footprint as Footprint

# The memory available, the refusal and sizes live in plainformer/memory.py; importable from here too.
from ..memory import MemoryBudgetError as MemoryBudgetError
from ..memory import available_memory, available_phrase, check_memory, format_size, itemsize
from ..memory import memory_limit as memory_limit
from ..models.family_model import FamilyModel, model_class
from ..models.gpt import GPT, moe_layer_count
from ..models.transformer import EXTRA_OUTPUT_TOKENS, Transformer

FLOAT32 = 4
MATH_KEYS = 512  # at most this many keys, backend "auto" takes the math path in bfloat16 (nn/attention.py)
MLM_SELECTED = 0.15  # the share of positions a masked LM scores (data/mlm.py)


# ----------------------------------------------------------------------------- the shared blocks' terms

def kv_width(config: Any) -> int:
    """d_kv = n_kv_heads · d_model / n_heads, the width of the keys (and of the values)."""
    n_kv_heads = getattr(config, "n_kv_heads", None) or config.n_heads
    return n_kv_heads * (config.d_model // config.n_heads)


def _attention_dropout(c: Any) -> float:
    """The attention weights' dropout: attention_dropout where a config has one that is set, else dropout."""
    rate = getattr(c, "attention_dropout", None)
    return c.dropout if rate is None else rate


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


# ----------------------------------------------------------------------------- each family's sums

def _moe_activations(c: Any, keys: int) -> int:
    """Elements kept per token by a MoE layer: a dense layer's, but top_k experts' inputs, hidden states
    and outputs for the FFN's, and the router's logits."""
    shared = c.n_shared_experts * c.d_ff
    experts = c.top_k * (2 * c.d_model + hidden("swiglu", c.d_ff)) + hidden("swiglu", shared)
    return (layer_activations(c, keys) - hidden(c.activation, c.d_ff) - dropout(c, c.d_ff) + experts
            + dropout(c, shared) + 2 * c.n_experts)


def _variant_activations(c: Any) -> int:
    """Elements kept per token by the variants that are on (as measured): tanh's output for logit_softcap;
    the input of embed_norm; E[x_{t−1}] for token_shift; each block's input before x0_mix; each later
    layer's own values beside the mixed ones (which attention keeps instead) for value_residual. A bigram
    embedding keeps its indices and mask only."""
    return ((c.vocab_size if c.logit_softcap is not None else 0)
            + c.d_model * (c.embed_norm + c.token_shift + c.n_layers * c.x0_mix)
            + (c.n_layers - 1) * kv_width(c) * c.value_residual)


def _gpt_activations(c: Any, batch_size: int, n: int) -> int:
    moe = moe_layer_count(c)
    per_token = ((c.n_layers - moe) * layer_activations(c, n) + moe * _moe_activations(c, n)
                 + 3 * c.d_model + 3 * c.vocab_size + _variant_activations(c))
    return FLOAT32 * batch_size * n * per_token


def _encoder_activations(c: Any, batch_size: int, n: int) -> int:
    """Elements BERT's encoder keeps for a micro-batch: its layers', the embeddings' and the pooler's."""
    return batch_size * n * (c.n_layers * layer_activations(c, n) + 3 * c.d_model)


def _bert_activations(c: Any, batch_size: int, n: int) -> int:
    return FLOAT32 * _encoder_activations(c, batch_size, n)


def _bert_mlm_activations(c: Any, batch_size: int, n: int) -> int:
    """The encoder's, and the head's over the 15% of positions selected: its input, hidden state and
    norm, the logits, their log-softmax and their gradient."""
    selected = math.ceil(MLM_SELECTED * batch_size * n)
    return FLOAT32 * (_encoder_activations(c, batch_size, n) + selected * (3 * c.d_model + 3 * c.vocab_size))


def _bert_cls_activations(c: Any, batch_size: int, n: int) -> int:
    """The encoder's, and the classifier's over the pooled rows."""
    return FLOAT32 * (_encoder_activations(c, batch_size, n) + batch_size * (2 * c.d_model + 3 * c.n_labels))


def _transformer_activations(c: Any, batch_size: int, n: int) -> int:
    """Sources and targets of n tokens; a decoder layer adds its cross-attention and its keys and values
    over the source, 2 d_kv per source token, as many as there are target tokens."""
    encoder = c.encoder_layers * layer_activations(c, n)
    decoder = c.decoder_layers * (layer_activations(c, n) + cross_activations(c, n) + 2 * kv_width(c))
    return FLOAT32 * batch_size * n * (encoder + decoder + 4 * c.d_model + 3 * c.tgt_vocab_size)


#: Each family's bytes autograd keeps for one training micro-batch: (config, batch_size, n) -> bytes.
TRAINING_ACTIVATIONS: dict[str, Callable[[Any, int, int], int]] = {
    "gpt": _gpt_activations, "bert": _bert_activations, "bert-mlm": _bert_mlm_activations,
    "bert-cls": _bert_cls_activations, "transformer": _transformer_activations,
}
#: The width of the logits each family scores every position with (absent: a pooled head, or none).
OUTPUT_VOCAB: dict[str, Callable[[Any], int]] = {
    "gpt": lambda c: c.vocab_size, "bert-mlm": lambda c: c.vocab_size, "transformer": lambda c: c.tgt_vocab_size,
}


# ----------------------------------------------------------------------------- the estimates

def footprint(config: Any, family: str | None = None) -> Footprint:
    """What the model of `config` holds, counted on the meta device. family: "gpt", "bert", "bert-mlm",
    "bert-cls" or "transformer" (default: the config's own model, BertModel for a BertConfig)."""
    return model_class(config, family).footprint(config)


def parameter_count(config: Any, family: str | None = None) -> int:
    """The parameters of the model of `config`, each counted once: sum(p.numel() for p in model.parameters())."""
    return footprint(config, family).parameters


def model_bytes(config: Any, dtype: torch.dtype = torch.float32, family: str | None = None) -> int:
    """The bytes of the model of `config` with its parameters in `dtype`: parameters, buffers (float32,
    as built) and the per-tensor overhead."""
    return model_class(config, family).model_bytes(config, dtype)


def held_bytes(model: nn.Module) -> int:
    """The bytes a built model holds in its parameters and buffers (each tensor once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def activation_bytes(config: Any, batch_size: int, seq_len: int | None = None, family: str | None = None) -> int:
    """The bytes autograd keeps for one training micro-batch of `batch_size` rows of `seq_len` tokens
    (default: the config's context, block_size or max_len), in float32 (see the module docstring)."""
    cls = model_class(config, family)
    if cls.family not in TRAINING_ACTIVATIONS:
        raise NotImplementedError(f"{cls.__name__} does not estimate its activations")
    return TRAINING_ACTIVATIONS[cls.family](config, batch_size, seq_len or context_length(config))


def context_length(config: Any) -> int:
    """The positions a model of `config` takes: a GPT's block_size, the others' max_len."""
    return getattr(config, "block_size", None) or config.max_len


def forward_bytes(config: Any, rows: int, seq_len: int | None = None, family: str | None = None,
                  dtype: torch.dtype = torch.float32) -> int:
    """The bytes beyond the model's own of evaluating `rows` rows of `seq_len` tokens at once (default:
    the config's context) with the model in `dtype`: a forward pass without autograd."""
    vocab = OUTPUT_VOCAB.get(model_class(config, family).family, lambda c: 0)(config)
    return forward_pass(config, rows, seq_len or context_length(config), itemsize(dtype), vocab)


def training_bytes(config: Any, batch_size: int, *, seq_len: int | None = None, optimizer: str = "adamw",
                   family: str | None = None, trainable: int | None = None, eval_batch_size: int | None = None
                   ) -> int:
    """The bytes of training the model of `config` at `batch_size` rows of `seq_len` tokens: the model,
    a float32 gradient and the optimizer's state of every trained parameter (`trainable` of them,
    default all; AdamW keeps 2 moments, Muon 1 for the block matrices, when all are trained), and the
    larger of the training activations and an evaluation batch of `eval_batch_size` rows (default
    batch_size)."""
    f = footprint(config, family)
    trained = f.parameters if trainable is None else trainable
    moments = 2 * trained - (f.block_matrices if optimizer == "muon" and trainable is None else 0)
    activations = max(activation_bytes(config, batch_size, seq_len, family),
                      forward_bytes(config, eval_batch_size or batch_size, seq_len, family))
    return model_bytes(config, family=family) + FLOAT32 * (trained + moments) + activations


def decoding_bytes(config: Any, rows: int, prompt_len: int, dtype: torch.dtype = torch.float32) -> int:
    """The bytes beyond the model's own of sampling `rows` rows from a GPT in `dtype` at once: a KV cache
    of block_size positions (at most sliding_window) per layer and row, the prompt's forward pass (the
    logits of its last position only) and the float32 logits of each step."""
    c, size = config, itemsize(dtype)
    caches = c.n_layers * 2 * kv_width(c) * min(c.block_size, c.sliding_window or c.block_size) * size
    prompt = forward_pass(c, 1, min(prompt_len, c.block_size), size, 0)
    return rows * (caches + prompt + FLOAT32 * 3 * c.vocab_size)


def beam_search_bytes(config: Any, sentences: int, beam_size: int, source_len: int) -> int:
    """The bytes beyond the model's own of translating `sentences` sources of up to `source_len` tokens at
    once with `beam_size` hypotheses each: the encoder's pass, and per hypothesis the self-attention
    caches of every decoder layer (min(source_len + 50, max_len) positions, twice with a beam: the buffers a
    reorder writes into), the cross-attention keys and values and the memory over the source, the scores of
    each step and the tokens."""
    c = config
    steps = min(source_len + EXTRA_OUTPUT_TOKENS, c.max_len) * (2 if beam_size > 1 else 1)
    per_row = (FLOAT32 * (c.decoder_layers * 2 * kv_width(c) * (steps + source_len) + source_len * c.d_model
                          + 3 * c.tgt_vocab_size) + 8 * steps)
    return forward_pass(c, sentences, source_len, FLOAT32, 0) + sentences * beam_size * per_row


def largest_beam(config: Any, sentences: int, source_len: int, held: int = 0) -> int:
    """The largest beam that fits the memory available for `sentences` sources at once (0 when not even
    one does), at most the target vocabulary; `held`: the bytes of the model, loaded already."""
    encoder = beam_search_bytes(config, sentences, 0, source_len)
    per_beam = (beam_search_bytes(config, sentences, 2, source_len) - encoder) // 2  # a beam's, spare buffers in
    room = available_memory(held) - held - encoder
    return max(0, min(config.tgt_vocab_size, room // per_beam))


# ----------------------------------------------------------------------------- the checks at the boundaries

def check_evaluation_memory(model: FamilyModel, rows: int, seq_len: int | None = None) -> None:
    """A MemoryBudgetError when a forward pass over `rows` rows (--batch-size) of `seq_len` tokens (default:
    the model's context) would not fit the memory available beside `model`, loaded already."""
    held = held_bytes(model)
    dtype = next(model.parameters()).dtype
    check_memory(f"evaluating {rows} rows at once (--batch-size) needs ~{{needed}} for the model and a forward pass",
                 lambda: held + forward_bytes(model.config, rows, seq_len, model.family, dtype), held=held)


def check_decoding_memory(model: GPT, rows: int, prompt_len: int, what: str) -> None:
    """Refuse, before anything is drawn, decoding `rows` rows at once whose KV caches would not fit the
    memory available with the model; `what` names the rows in the message ("sampling 4 row(s) at once")."""
    held = held_bytes(model)
    config = model.config
    check_memory(f"{what} needs ~{{needed}} for the model and a KV cache of {config.block_size} positions per "
                 "layer and row",
                 lambda: held + decoding_bytes(config, rows, prompt_len, model.token_embedding.weight.dtype), held=held)


def check_beam_memory(model: Transformer, beam: int, sentences: int, source_len: int) -> None:
    """A MemoryBudgetError when `sentences` sources of up to `source_len` tokens at a time, with `beam`
    hypotheses each, would not fit the memory available beside `model`; it names the largest beam that fits."""
    held = held_bytes(model)
    fits = largest_beam(model.config, sentences, source_len, held)
    if beam > fits:
        needed = held + beam_search_bytes(model.config, sentences, beam, source_len)
        most = f"at most --beam {fits} fits" if fits else "not even --beam 1 fits"
        raise MemoryBudgetError(f"--beam {beam} needs ~{format_size(needed)} to translate {sentences} sentence(s) "
                                f"of up to {source_len} tokens at once, more than {available_phrase(held)}: {most}")
