"""Text corpora, train/validation splits by whole works, memory-mapped token arrays, LM batches.

The bundled corpus is 38 works of Shakespeare (plays and poems, Project Gutenberg, 4,732,575
characters), listed with their lengths in `corpus/works.tsv` and separated by two blank lines.

Validation is the last ~10% of works, never random offsets, so that validation text is unseen text
rather than neighbours of training windows: n_val = max(1, round(0.1 · n_works)), kept below n_works.
For the bundled corpus that is the last 4 of the 38 works in `works.tsv` order — Troilus and Cressida,
Twelfth Night, Two Gentlemen of Verona and The Winter's Tale (524,941 characters, 11.1%).
For any other UTF-8 file (`--data PATH`), a work is a block of text between two or more blank lines;
a file with a single such block is split by lines instead, the last ~10% of its lines (at least one)
going to validation.

Token arrays are encoded chunk by chunk into a `.bin` file (uint16 when the vocabulary fits, else
uint32) in a cache directory, written atomically and opened with `np.memmap`, so a large text never
sits in memory twice and a second run starts at once. Cache entries are keyed by the sha256 of the
text, the split's span and the tokenizer's fingerprint; tokenizers built here are cached the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import itertools
import os
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import tokenizers as hf
import torch
from torch import Tensor

from . import _checks
from .tokenizers import (TRAINING_CHUNK_CHARS, BPETokenizer, CharTokenizer, Tokenizer, WordPieceTokenizer,
                         atomic_path, load_tokenizer, text_chunks)

SPLITS = ("train", "val")
VAL_FRACTION = 0.1
ENCODE_CHUNK_CHARS = 1 << 17
ENCODE_GROUP = 8  # chunks encoded at once: parallel for Hugging Face tokenizers, memory stays bounded
# Two or more blank (empty or spaces-only) lines end a work in a user's file.
_WORK_BREAK = re.compile(r"\n(?:[ \t]*\n){2,}")
_NON_SPACE = re.compile(r"\S")
_BUNDLED_SEPARATOR = "\n\n\n"


def _corpus_file(name: str) -> bytes:
    return importlib.resources.files("plainformer").joinpath("corpus", name).read_bytes()


def load_text(path: str | os.PathLike | None = None) -> str:
    """The bundled Shakespeare corpus when `path` is None, else the UTF-8 text of the file at `path`
    (a leading byte-order mark is dropped, line endings become "\\n")."""
    if path is None:
        return gzip.decompress(_corpus_file("shakespeare.txt.gz")).decode("utf-8")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"data file {path} is not UTF-8 text: byte 0x{err.object[err.start]:02x} at "
                         f"offset {err.start} cannot be decoded ({err.reason}); convert it to UTF-8 first, "
                         "e.g. with iconv") from None
    if not text.strip():
        raise ValueError(f"data file {path} is empty (or only whitespace)")
    return text


@dataclasses.dataclass(frozen=True)
class Work:
    """One work: text[start:end], without the blank lines around it."""

    title: str
    start: int
    end: int


def bundled_works(text: str) -> list[Work]:
    """The works of the bundled corpus, located from the titles and lengths in works.tsv."""
    rows = [line.split("\t") for line in _corpus_file("works.tsv").decode("utf-8").splitlines()[1:]]
    works, start = [], 0
    for title, length in rows:
        works.append(Work(title, start, start + int(length)))
        start += int(length) + len(_BUNDLED_SEPARATOR)
    gaps = [text[a.end:b.start] for a, b in zip(works, works[1:])]
    if works[-1].end != len(text) or any(gap != _BUNDLED_SEPARATOR for gap in gaps):
        raise ValueError("the bundled corpus does not match corpus/works.tsv; the installation is damaged")
    return works


def find_works(text: str) -> list[Work]:
    """Blocks of `text` separated by two or more blank lines; each titled by its first non-blank line."""
    works, start = [], 0
    for brk in [*_WORK_BREAK.finditer(text), None]:
        end = brk.start() if brk else len(text)
        first = _NON_SPACE.search(text, start, end)
        if first:
            title_end = text.find("\n", first.start(), end)
            title = text[first.start():end if title_end < 0 else title_end].strip()[:60]
            works.append(Work(title, start, end))
        start = brk.end() if brk else end
    return works


def _split_lines(work: Work, text: str, val_fraction: float) -> list[Work]:
    """A single work cut in two by lines, the last ~val_fraction of its lines (at least one) second."""
    start, end = work.start, work.end
    n_lines = text.count("\n", start, end) + (not text.endswith("\n", start, end))
    if n_lines < 2:
        raise ValueError("the text has a single line: it cannot be split into training and validation "
                         "parts (separate works by two blank lines, or add lines)")
    n_val = _n_val(n_lines, val_fraction)
    cut = end - 1 if text.endswith("\n", start, end) else end
    for _ in range(n_val):
        cut = text.rfind("\n", start, cut)
    cut += 1
    n_train = n_lines - n_val
    return [Work(f"lines 1-{n_train}", start, cut), Work(f"lines {n_train + 1}-{n_lines}", cut, end)]


def _n_val(count: int, val_fraction: float) -> int:
    return min(count - 1, max(1, round(val_fraction * count)))


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """A text and its works, the last ones held out for validation."""

    text: str = dataclasses.field(repr=False)
    train_works: tuple[Work, ...]
    val_works: tuple[Work, ...]

    def span(self, split: str) -> tuple[int, int]:
        """(start, end) character offsets of a split; its works are contiguous."""
        works = self.train_works if _checks.check_choice("split", split, SPLITS) == "train" else self.val_works
        return works[0].start, works[-1].end

    def chunks(self, split: str, chunk_chars: int = ENCODE_CHUNK_CHARS) -> Iterator[str]:
        """The split's text in pieces that encode independently (see `tokenizers.text_chunks`)."""
        return text_chunks(self.text, chunk_chars, *self.span(split))

    @functools.cached_property
    def text_sha256(self) -> str:
        """sha256 of the UTF-8 text, hashed slice by slice so that no second copy is ever whole."""
        digest, step = hashlib.sha256(), 1 << 20
        for i in range(0, len(self.text), step):
            digest.update(self.text[i:i + step].encode("utf-8", "surrogatepass"))
        return digest.hexdigest()


def split_text(text: str, works: Sequence[Work] | None = None, *, val_fraction: float = VAL_FRACTION) -> TextSplit:
    """Hold out the last works of `text` (found by `find_works` unless given) for validation."""
    _checks.check_probability("val_fraction", val_fraction)
    if val_fraction == 0:
        raise ValueError("val_fraction must be in (0, 1), got 0")
    works = list(find_works(text) if works is None else works)
    if not works:
        raise ValueError("the text holds no non-blank work to split")
    if len(works) == 1:
        works = _split_lines(works[0], text, val_fraction)
    n_train = len(works) - _n_val(len(works), val_fraction)
    return TextSplit(text, tuple(works[:n_train]), tuple(works[n_train:]))


def load_split(path: str | os.PathLike | None = None, *, val_fraction: float = VAL_FRACTION) -> TextSplit:
    """`load_text(path)` split by works: works.tsv for the bundled corpus, blank lines otherwise."""
    text = load_text(path)
    return split_text(text, bundled_works(text) if path is None else None, val_fraction=val_fraction)


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
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            while group := list(itertools.islice(chunks, ENCODE_GROUP)):
                for ids in tokenizer.encode_many(group):
                    np.asarray(ids, dtype=dtype).tofile(f)
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


def _stable_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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

    def num_tokens(self, split: str) -> int:
        return len(self.tokens[_checks.check_choice("split", split, SPLITS)])

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        """{"idx": (B, T) long, "targets": (B, T) long}, a function of (seed, split, index) only."""
        tokens = self.tokens[_checks.check_choice("split", split, SPLITS)]
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}")
        _checks.check_positive_int("batch_size", batch_size)
        T = self.block_size
        generator = torch.Generator().manual_seed(_stable_seed(self.seed, split, index))
        starts = torch.randint(0, len(tokens) - T, (batch_size,), generator=generator).numpy()
        windows = torch.from_numpy(tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64))  # (B, T + 1)
        return {"idx": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}
