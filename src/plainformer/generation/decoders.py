"""Model decoders: a model as the decoding loops drive it (see `decoding.IncrementalDecoder`).

Nothing here imports a model: a decoder reads the few attributes it names, so `models/` may build
its decoders from here without an import cycle.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from .. import _checks


class _LanguageModel(Protocol):
    """What `GPTDecoder` reads from a GPT."""

    def output_logits(self, hidden: Tensor) -> Tensor: ...

    @property
    def block_size(self) -> int: ...

    def hidden_states(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                      attention_mask: Tensor | None = None) -> Tensor: ...

    def new_kv_caches(self, batch_size: int) -> list[Any]: ...


class _Seq2SeqModel(Protocol):
    """What `SourceBoundDecoder` reads from an encoder-decoder Transformer."""

    config: Any  # .max_len
    decoder: Any  # .new_kv_caches(memory, max_len, repeats=...)

    def decode(self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None, *,
               kv_caches: list[Any] | None = None) -> Tensor: ...


class GPTDecoder:
    """A GPT as `generation` drives it: model(idx, kv_caches) -> (logits (B, 1, V), None), the logits
    of the last position only, which is all that sampling reads: the output projection of the other
    positions (a prompt's) is never computed. The head is the model's own, as the commands that decode
    left it (`inference.for_decoding`: prepacked, on the kernel measured fastest, or int8).
    """

    def __init__(self, model: _LanguageModel):
        self.model = model
        self.block_size = model.block_size

    def new_kv_caches(self, batch_size: int) -> list[Any]:
        return self.model.new_kv_caches(batch_size)

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                 attention_mask: Tensor | None = None) -> tuple[Tensor, None]:
        hidden = self.model.hidden_states(idx, kv_caches=kv_caches, attention_mask=attention_mask)
        return self.model.output_logits(hidden[:, -1:]), None  # (B, 1, V)

    def all_logits(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                   attention_mask: Tensor | None = None) -> Tensor:
        """The logits (B, n, V) of every position of idx (B, n): what scoring a prompt reads."""
        return self.model.output_logits(self.model.hidden_states(idx, kv_caches=kv_caches,
                                                                 attention_mask=attention_mask))


class SourceBoundDecoder:
    """The decoder with the encoder memory of B sources bound: a next-token model over target
    prefixes, as `generation.generate` and `generation.beam_search` expect.

    It accepts any multiple r·B of rows: rows b·r .. b·r + r − 1 all translate source b (beams).
    `new_kv_caches` projects the memory's cross-attention keys/values once, for all decoding steps.
    """

    def __init__(self, model: _Seq2SeqModel, memory: Tensor, memory_key_padding_mask: Tensor, block_size: int):
        _checks.check_positive_int("max_len", block_size)
        if block_size > model.config.max_len:
            raise ValueError(f"max_len must be at most the model's max_len={model.config.max_len}, "
                             f"got {block_size}")
        self.model = model
        self.memory, self.memory_key_padding_mask = memory, memory_key_padding_mask
        self.block_size = block_size
        self._expanded: tuple[int, Tensor, Tensor] | None = None

    def _repeats(self, rows: int) -> int:
        sources = self.memory.shape[0]
        if rows % sources:
            raise ValueError(f"a decoder bound to {sources} sources takes a multiple of {sources} rows, "
                             f"got {rows}")
        return rows // sources

    def _memory_for(self, rows: int) -> tuple[Tensor, Tensor]:
        """The memory and its mask with each source repeated for its rows (computed once per size)."""
        repeats = self._repeats(rows)
        if self._expanded is None or self._expanded[0] != repeats:
            self._expanded = (repeats, self.memory.repeat_interleave(repeats, dim=0),
                              self.memory_key_padding_mask.repeat_interleave(repeats, dim=0))
        return self._expanded[1], self._expanded[2]

    def new_kv_caches(self, batch_size: int) -> list[Any]:
        return self.model.decoder.new_kv_caches(self.memory, self.block_size,
                                                repeats=self._repeats(batch_size))

    def keep_sources(self, indices: Tensor) -> None:
        """Decode only the sources `indices` (S',) from now on, in that order: beam search leaves out the
        sentences it is done with."""
        self.memory, self.memory_key_padding_mask = self.memory[indices], self.memory_key_padding_mask[indices]
        self._expanded = None

    def __call__(self, idx: Tensor, *, kv_caches: list[Any] | None = None,
                 attention_mask: Tensor | None = None) -> tuple[Tensor, None]:
        """Target prefixes idx (B, n) -> logits; they are never padded (`attention_mask` is None)."""
        if attention_mask is not None:
            raise ValueError("the encoder-decoder decodes target prefixes of one length: no attention_mask")
        memory, mask = self._memory_for(idx.shape[0])
        return self.model.decode(idx, memory, mask, kv_caches=kv_caches), None
