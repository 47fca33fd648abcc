"""Language-model data: tokenizers built for a split, memory-mapped token arrays, LM batches.

Token arrays are encoded chunk by chunk into a `.bin` file (uint16 when the vocabulary fits, else
uint32) in a cache directory, written atomically and opened with `np.memmap`, so a large text never
sits in memory twice and a second run starts at once. Cache entries are keyed by the sha256 of the
text, the split's span and the tokenizer's fingerprint; tokenizers built here are cached the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import tokenizers as hf
import torch
from torch import Tensor

from .. import _checks
from ..io.atomic import atomic_path, reporting_full_disk
from .corpus import (
    ENCODE_CHUNK_CHARS,
    SPLITS,
    VAL_FRACTION,
    TextSplit,
    load_split,
    stable_seed,
)
from .tokenizers import (
    TRAINING_CHUNK_CHARS,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    WordPieceTokenizer,
    load_tokenizer,
)

ENCODE_GROUP = 8  # chunks encoded at once: parallel for Hugging Face tokenizers, memory stays bounded


def default_cache_dir() -> Path:
    """$PLAINFORMER_CACHE, else $XDG_CACHE_HOME/plainformer, else ~/.cache/plainformer."""
    if os.environ.get("PLAINFORMER_CACHE"):
        return Path(os.environ["PLAINFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plainformer"


def _cache_key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def build_tokenizer(split: TextSplit, kind: str = "char", *, vocab_size: int | None = None,
                    special_tokens: Sequence[str] = (), cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """A tokenizer for `split`, loaded from the cache when an identical one was built before.

    "char": the sorted distinct characters of the whole text (so validation text always encodes; only
    the character set is shared). "bpe" / "wordpiece": trained on the training works only, with
    `vocab_size` tokens (BPE adds `special_tokens`, e.g. ("eos",)).
    """
    _checks.check_choice("tokenizer", kind, ("char", "bpe", "wordpiece"))
    if (kind == "char") != (vocab_size is None):
        raise ValueError(f"vocab_size must be {'None' if kind == 'char' else 'given'} for a {kind} "
                         f"tokenizer, got {vocab_size}")
    if special_tokens and kind != "bpe":
        raise ValueError(f"special_tokens apply to a bpe tokenizer only, got {tuple(special_tokens)} for {kind}")
    span = (0, len(split.text)) if kind == "char" else split.span("train")
    key = _cache_key(kind, split.text_sha256, span, vocab_size, tuple(special_tokens), hf.__version__)
    directory = Path(cache_dir or default_cache_dir()) / "tokenizers" / key
    if directory.is_dir():
        return load_tokenizer(directory)
    if kind == "char":
        tokenizer: Tokenizer = CharTokenizer(split.text)
    elif kind == "bpe":
        tokenizer = BPETokenizer.train(split.chunks("train", TRAINING_CHUNK_CHARS), vocab_size,
                                       special_tokens=special_tokens)
    else:
        tokenizer = WordPieceTokenizer.train(split.chunks("train", TRAINING_CHUNK_CHARS), vocab_size)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(directory) as tmp:
            tokenizer.save(tmp)
    except OSError:
        if not directory.is_dir():  # else another process cached the same tokenizer first
            raise
    return tokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def token_array(split: TextSplit, which: str, tokenizer: Tokenizer, *,
                cache_dir: str | os.PathLike | None = None) -> np.memmap:
    """The tokens of one split as a read-only memory map (N,), encoded once and cached on disk.

    Encoding runs chunk by chunk straight into the file; the result equals
    `tokenizer.encode(split.text[start:end])` for a char or byte-level BPE tokenizer.
    """
    _checks.check_choice("tokenizer kind", tokenizer.kind, ("char", "bpe"))
    start, end = split.span(which)
    dtype = token_dtype(tokenizer.vocab_size)
    key = _cache_key(split.text_sha256, start, end, tokenizer.fingerprint)
    path = Path(cache_dir or default_cache_dir()) / "tokens" / f"{key}.bin"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        chunks = split.chunks(which, ENCODE_CHUNK_CHARS)
        # f.write, not ndarray.tofile: on a full disk tofile raises an OSError without an errno.
        with reporting_full_disk(path, "the token cache"), atomic_path(path) as tmp, open(tmp, "wb") as f:
            while group := list(itertools.islice(chunks, ENCODE_GROUP)):
                for ids in tokenizer.encode_many(group):
                    f.write(np.asarray(ids, dtype=dtype).tobytes())
    return np.memmap(path, dtype=dtype, mode="r")


@dataclasses.dataclass(frozen=True, eq=False)
class LMData:
    """Everything a language-model run reads: the split, its tokenizer and both token arrays."""

    split: TextSplit
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray


def prepare_lm_data(path: str | os.PathLike | None = None, *, tokenizer: str | Tokenizer = "char",
                    vocab_size: int | None = None, cache_dir: str | os.PathLike | None = None,
                    val_fraction: float = VAL_FRACTION) -> LMData:
    """Load, split, tokenize (a kind to build, or a given tokenizer, e.g. a checkpoint's) and encode.

    After a first run every step is a cache hit: the bundled corpus is ready in well under a second.
    """
    split = load_split(path, val_fraction=val_fraction)
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(split, tokenizer, vocab_size=vocab_size, cache_dir=cache_dir)
    elif vocab_size is not None:
        raise ValueError("vocab_size only applies when the tokenizer is built here (tokenizer given as a kind)")
    arrays = [token_array(split, which, tokenizer, cache_dir=cache_dir) for which in SPLITS]
    return LMData(split, tokenizer, *arrays)


def _as_tokens(name: str, tokens: object) -> np.ndarray:
    if isinstance(tokens, Tensor):
        tokens = tokens.cpu().numpy()
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        shape = getattr(tokens, "shape", None)
        raise TypeError(f"{name} must be a 1-D integer array or tensor of token ids, got "
                        f"{type(tokens).__name__} {getattr(tokens, 'dtype', '')} {shape or ''}".rstrip())
    return tokens


class LMBatchSource:
    """Random windows of a token stream for next-token prediction.

    get_batch(split, index, batch_size) draws B start offsets s_b uniformly from [0, N - T) with a
    torch.Generator seeded by sha256(seed, split, index) — so batch `index` is the same in every run
    and after a resume — and returns idx[b] = tokens[s_b : s_b + T], targets[b] = tokens[s_b + 1 : s_b + T + 1],
    both (B, T) long.
    """

    def __init__(self, train_tokens: np.ndarray | Tensor, val_tokens: np.ndarray | Tensor,
                 block_size: int, seed: int = 0):
        self.block_size = _checks.check_positive_int("block_size", block_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self.tokens = {"train": _as_tokens("train_tokens", train_tokens),
                       "val": _as_tokens("val_tokens", val_tokens)}
        for split, tokens in self.tokens.items():
            if len(tokens) < block_size + 1:
                raise ValueError(f"the {split} split has {len(tokens)} tokens but block_size={block_size} "
                                 f"needs at least {block_size + 1} (block_size + 1 for the shifted targets); "
                                 "use a smaller block_size or more text")

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        """{"idx": (B, T) long, "targets": (B, T) long}, a function of (seed, split, index) only."""
        tokens = self.tokens[_checks.check_choice("split", split, SPLITS)]
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}")
        _checks.check_positive_int("batch_size", batch_size)
        T = self.block_size
        generator = torch.Generator().manual_seed(stable_seed(self.seed, split, index))
        starts = torch.randint(0, len(tokens) - T, (batch_size,), generator=generator).numpy()
        windows = torch.from_numpy(tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64))  # (B, T + 1)
        return {"idx": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}
