"""Language-model data: documents to token ids (in memory from a `TextSplit`, cached as memory-mapped
arrays), and LM batches. `prepared.prepare_lm_data` streams a corpus from files into the same arrays.

Within a split, documents are joined by the end-of-text token — "<eos>", a special token that a BPE
tokenizer built here gains — or, for a char tokenizer (and a given tokenizer without one), by the
ids of a blank line, DOC_SEPARATOR = "\n\n", so the model sees where documents end. The arrays equal
`encode(document)` for each document, joined by those ids.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers as hf
import torch
from torch import Tensor

from .. import _checks
from ..files.atomic import atomic_path, reporting_full_disk
from .corpus import (
    ENCODE_CHUNK_CHARS,
    SPLITS,
    TextSplit,
    check_batch_index,
    stable_seed,
)
from .sources import Piece
from .tokenizers import (
    SAFE_CUT,
    TRAINING_CHUNK_CHARS,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    WordPieceTokenizer,
    load_tokenizer,
)

ENCODE_GROUP = 8  # chunks' worth of text encoded at once: parallel for Hugging Face, memory bounded


DOC_SEPARATOR = "\n\n"








FORMAT_VERSION = 2  # of the token caches; 1 encoded raw text spans, separators included


# Fallback cut for a line longer than LONG_LINE_CHUNKS chunks: just before a space that follows a
# non-space and precedes one. No pre-tokenizer here joins text across it (GPT-2's byte-level pieces
# carry a space only at their start; BERT and characters split there anyway).
_SPACE_CUT = re.compile(r"\S(?= \S)")


LONG_LINE_CHUNKS = 8


def default_cache_dir() -> Path:
    """$PLAINFORMER_CACHE, else $XDG_CACHE_HOME/plainformer, else ~/.cache/plainformer."""
    if os.environ.get("PLAINFORMER_CACHE"):
        return Path(os.environ["PLAINFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plainformer"


def cache_key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ----------------------------------------------------------------------------- chunking and encoding

def document_chunks(pieces: Iterable[Piece], chunk_chars: int) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) for each document in chunks of about `chunk_chars` characters, cut only
    where tokenization is local (`tokenizers.SAFE_CUT`, else `_SPACE_CUT` in a very long line), so
    encoding chunk by chunk equals encoding each document whole. Only a run of non-space characters
    longer than LONG_LINE_CHUNKS chunks is held whole."""
    buffer, scanned = "", 0
    for piece in pieces:
        buffer += piece.text
        while len(buffer) > chunk_chars:
            found = SAFE_CUT.search(buffer, max(chunk_chars, scanned) - 1)
            if found is None and len(buffer) > LONG_LINE_CHUNKS * chunk_chars:
                found = _SPACE_CUT.search(buffer, chunk_chars - 1)
            if found is None:
                scanned = len(buffer)
                break
            yield buffer[:found.end()], False
            buffer, scanned = buffer[found.end():], 0
        if piece.last:
            yield buffer, True
            buffer, scanned = "", 0


def separator_ids(tokenizer: Tokenizer) -> np.ndarray:
    """The ids put between two documents: [eos] when the tokenizer has it, else encode("\n\n")."""
    if tokenizer.eos_id is not None:
        return np.array([tokenizer.eos_id], dtype=np.int64)
    return np.asarray(tokenizer.encode(DOC_SEPARATOR), dtype=np.int64)


def _encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if isinstance(tokenizer, CharTokenizer):
        return [tokenizer.encode_array(t) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_many(texts)]


def encode_documents(pieces: Iterable[Piece], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """The token ids of the documents `pieces` make up, joined by `separator_ids`, as arrays in order."""
    _checks.check_choice("tokenizer kind", tokenizer.kind, ("char", "bpe"))
    separator = separator_ids(tokenizer)
    between = False  # a document ended before the next chunk
    for group in _groups(document_chunks(pieces, ENCODE_CHUNK_CHARS)):
        for ids, (_, ends) in zip(_encode_texts(tokenizer, [text for text, _ in group]), group, strict=True):
            if between:
                yield separator
            yield ids
            between = ends


def _groups(chunks: Iterable[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    """Consecutive chunks holding ENCODE_GROUP * ENCODE_CHUNK_CHARS characters together (many short
    documents share one call)."""
    group, size = [], 0
    for chunk in chunks:
        group.append(chunk)
        size += len(chunk[0])
        if size >= ENCODE_GROUP * ENCODE_CHUNK_CHARS:
            yield group
            group, size = [], 0
    if group:
        yield group


def write_tokens(path: Path, arrays: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Write the arrays one after another to `path`, atomically; returns the number of tokens."""
    count = 0
    # f.write, not ndarray.tofile: on a full disk tofile raises an OSError without an errno.
    with reporting_full_disk(path, "the token cache"), atomic_path(path) as tmp, open(tmp, "wb") as f:
        for ids in arrays:
            f.write(ids.astype(dtype, copy=False).tobytes())
            count += len(ids)
    return count


def _pieces_of(documents: Iterable[str]) -> Iterator[Piece]:
    return (Piece(text, True) for text in documents)


class CharSet:
    """The distinct characters of the texts added, as a table of code points (a set of 1-character
    strings costs ten times more per character)."""

    def __init__(self, texts: Iterable[str] = ()):
        self.seen = np.zeros(sys.maxunicode + 1, dtype=bool)
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        self.seen[np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")] = True

    def tokenizer(self) -> CharTokenizer:
        """A char tokenizer of the characters seen and those of DOC_SEPARATOR."""
        self.add(DOC_SEPARATOR)
        return CharTokenizer("".join(map(chr, np.flatnonzero(self.seen))))


# ----------------------------------------------------------------------------- in memory: a TextSplit

def build_tokenizer(split: TextSplit, kind: str = "char", *, vocab_size: int | None = None,
                    special_tokens: Sequence[str] = (), cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """A tokenizer for `split`, loaded from the cache when an identical one was built before.

    "char": the sorted distinct characters of all the works and of DOC_SEPARATOR (so validation text
    always encodes; only the character set is shared). "bpe" / "wordpiece": trained on the training
    works only, with `vocab_size` tokens (BPE adds `special_tokens`, e.g. ("eos",)).
    """
    _checks.check_choice("tokenizer", kind, ("char", "bpe", "wordpiece"))
    if (kind == "char") != (vocab_size is None):
        raise ValueError(f"vocab_size must be {'None' if kind == 'char' else 'given'} for a {kind} "
                         f"tokenizer, got {vocab_size}")
    if special_tokens and kind != "bpe":
        raise ValueError(f"special_tokens apply to a bpe tokenizer only, got {tuple(special_tokens)} for {kind}")
    works = split.train_works + split.val_works if kind == "char" else split.train_works
    spans = [(w.start, w.end) for w in works]
    key = cache_key(FORMAT_VERSION, kind, split.text_sha256, spans, vocab_size, tuple(special_tokens),
                     hf.__version__)
    directory = Path(cache_dir or default_cache_dir()) / "tokenizers" / key
    if directory.is_dir():
        return load_tokenizer(directory)
    if kind == "char":
        tokenizer: Tokenizer = CharSet([*split.documents("train"), *split.documents("val")]).tokenizer()
    else:
        assert vocab_size is not None  # checked above: given for every kind but char
        texts = (text for text, _ in document_chunks(_pieces_of(split.documents("train")), TRAINING_CHUNK_CHARS))
        tokenizer = (BPETokenizer.train(texts, vocab_size, special_tokens=special_tokens) if kind == "bpe"
                     else WordPieceTokenizer.train(texts, vocab_size))
    save_tokenizer(tokenizer, directory)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(directory) as tmp:
            tokenizer.save(tmp)
    except OSError:
        if not directory.is_dir():  # else another process cached the same tokenizer first
            raise


def token_array(split: TextSplit, which: str, tokenizer: Tokenizer, *,
                cache_dir: str | os.PathLike | None = None) -> np.memmap:
    """The tokens of one split's works, joined by `separator_ids`, as a read-only memory map (N,),
    encoded once and cached on disk (the in-memory counterpart of `prepare_lm_data`)."""
    _checks.check_choice("tokenizer kind", tokenizer.kind, ("char", "bpe"))
    works = split.train_works if _checks.check_choice("split", which, SPLITS) == "train" else split.val_works
    dtype = token_dtype(tokenizer.vocab_size)
    key = cache_key(FORMAT_VERSION, split.text_sha256, [(w.start, w.end) for w in works], tokenizer.fingerprint)
    path = Path(cache_dir or default_cache_dir()) / "tokens" / f"{key}.bin"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tokens(path, encode_documents(_pieces_of(split.documents(which)), tokenizer), dtype)
    return np.memmap(path, dtype=dtype, mode="r")


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
        self.seed = _checks.check_int("seed", seed)
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
        check_batch_index(index, batch_size)
        T = self.block_size
        generator = torch.Generator().manual_seed(stable_seed(self.seed, split, index))
        starts = torch.randint(0, len(tokens) - T, (batch_size,), generator=generator).numpy()
        windows = torch.from_numpy(tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64))  # (B, T + 1)
        return {"idx": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}
