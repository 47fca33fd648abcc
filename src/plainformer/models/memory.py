"""How many bytes a model needs, from its config, before anything is allocated.

A config of `n_layers=10**6` or `block_size=10**9` is valid arithmetic and an impossible model: building
it runs for minutes, or until the allocator gives up with a traceback. What a model holds is counted on
the meta device by its class (`SavedModel.footprint`, models/saved.py: exact, no memory); what it keeps
while it runs is arithmetic on the config's sizes, beside each family's model (`activation_bytes`,
`output_vocab`; GPT's `decoding_bytes`, the Transformer's `beam_search_bytes`) over the shared blocks'
terms (models/activations.py). `check_memory` (plainformer/memory.py) refuses an estimate beyond the
memory available, naming the size that is to blame.

Training one micro-batch of B rows of n tokens (`training_bytes`, an estimate, on the high side):

    bytes = model + 4 · P_trained · (1 + m) + 4 · A,     m = 2 moments (AdamW), 1 for the matrices Muon trains

with A the activations autograd keeps (models/activations.py). Against the tensors autograd saves (with
the logits and their gradient), this is 0.9 to 1.3 times as much on small GPTs, BERTs and
encoder-decoders (tests/models/test_memory.py). An evaluation batch (`forward_bytes`) keeps one layer's
transients at a time and the logits; decoding keeps the KV caches of every layer for every row. These
count what a model needs beyond its own bytes: they are checked once it is loaded, with `held` = what
it holds.

The family of an estimate is a class's `family` ("gpt", "bert-mlm", ...), by default the first class of
the config's type (BertModel for a BertConfig).
"""

from __future__ import annotations

from typing import Any

import torch

# The memory available, the refusal and sizes live in plainformer/memory.py; importable from here too.
from ..memory import MemoryBudgetError as MemoryBudgetError
from ..memory import _meminfo as _meminfo
from ..memory import available_memory as available_memory
from ..memory import check_memory
from ..memory import format_size as format_size
from ..memory import memory_limit as memory_limit
from ..memory import parse_size as parse_size
from .activations import FLOAT32, forward_pass
from .bert import MLM_SELECTED as MLM_SELECTED
from .gpt import decoding_bytes as decoding_bytes
from .saved import TENSOR_OVERHEAD as TENSOR_OVERHEAD
from .saved import Footprint, itemsize, model_class
from .transformer import EXTRA_OUTPUT_TOKENS as EXTRA_OUTPUT_TOKENS
from .transformer import beam_search_bytes as beam_search_bytes
from .transformer import largest_beam as largest_beam


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


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes a built model holds in its parameters and buffers (each tensor once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def activation_bytes(config: Any, batch_size: int, seq_len: int | None = None, family: str | None = None) -> int:
    """The bytes autograd keeps for one training micro-batch of `batch_size` rows of `seq_len` tokens
    (default: the config's context, block_size or max_len), in float32 (see the module docstring)."""
    return model_class(config, family).activation_bytes(config, batch_size, seq_len or context_length(config))


def context_length(config: Any) -> int:
    """The positions a model of `config` takes: a GPT's block_size, the others' max_len."""
    return getattr(config, "block_size", None) or config.max_len


def forward_bytes(config: Any, rows: int, seq_len: int | None = None, family: str | None = None,
                  dtype: torch.dtype = torch.float32) -> int:
    """The bytes beyond the model's own of evaluating `rows` rows of `seq_len` tokens at once (default:
    the config's context) with the model in `dtype`: a forward pass without autograd."""
    vocab = model_class(config, family).output_vocab(config)
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


def check_model_memory(config: Any, family: str | None = None) -> None:
    """A MemoryBudgetError when the model of `config` would not fit the memory available: what the
    constructors call before they build anything (not on the meta device, where nothing is allocated)."""
    if torch.get_default_device().type == "meta":
        return
    check_memory("the model needs ~{needed} for its parameters and buffers", lambda c: model_bytes(c, family=family),
                 config)
