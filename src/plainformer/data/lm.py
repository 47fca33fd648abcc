"""Language-model data: documents to memory-mapped token arrays, and LM batches.

`prepare_lm_data(path)` streams the data (see `sources`) in passes; none holds the corpus, so resident
memory is bounded by the chunk sizes and the tokenizer (plus 8 bytes per document, the lengths the
split rule needs), not by the corpus:
1. scan: each document's length in characters (for a char tokenizer, also the characters seen);
2. the split (`corpus.val_boundary`); when it cuts a document by lines, a read up to that document;
3. for a BPE tokenizer built here, training streamed to `train_from_iterator` over the training
   documents, or beyond TOKENIZER_SAMPLE_CHARS characters over an evenly spread sample of them: every
   s-th window of SAMPLE_WINDOW_CHARS characters, s = ceil(training characters / TOKENIZER_SAMPLE_CHARS);
4. encoding, chunk by chunk at cuts where tokenization is local, straight into `train.bin` / `val.bin`
   (uint16 when the vocabulary fits, else uint32), opened with `np.memmap`.

Within a split, documents are joined by the end-of-text token — "<eos>", a special token that a BPE
tokenizer built here gains — or, for a char tokenizer (and a given tokenizer without one), by the
ids of a blank line, DOC_SEPARATOR = "\n\n", so the model sees where documents end. The arrays equal
`encode(document)` for each document, joined by those ids (`token_array` computes the same from a
`TextSplit` in memory).

Cache: one directory per preparation, keyed by the files' paths, sizes and modification times, the
split settings and the tokenizer (its kind and size, or a given tokenizer's fingerprint). `stats.json`
is written last and atomically, and it records the token counts: an entry without it, or whose
arrays do not match it (a preparation killed midway), is prepared again, never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers as hf
import torch
from torch import Tensor
from tqdm import tqdm

from .. import _checks
from ..files.atomic import atomic_path, remove_stale_temporaries, reporting_full_disk
from ..files.run_lock import run_lock
from .corpus import (
    ENCODE_CHUNK_CHARS,
    SPLITS,
    VAL_FRACTION,
    TextSplit,
    check_batch_index,
    check_val_fraction,
    line_cut,
    stable_seed,
    val_boundary,
)
from .sources import Piece, Source, open_source
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


END_OF_TEXT = "eos"  # the role of the BPE special token "<eos>" between documents


TOKENIZER_SAMPLE_CHARS = 1 << 25  # ~33.5M characters: plenty for vocabularies of a few 10k tokens


SAMPLE_WINDOW_CHARS = 1 << 20


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


def _cache_key(*parts: object) -> str:
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


def _write_tokens(path: Path, arrays: Iterable[np.ndarray], dtype: np.dtype) -> int:
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


class _CharSet:
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
    key = _cache_key(FORMAT_VERSION, kind, split.text_sha256, spans, vocab_size, tuple(special_tokens),
                     hf.__version__)
    directory = Path(cache_dir or default_cache_dir()) / "tokenizers" / key
    if directory.is_dir():
        return load_tokenizer(directory)
    if kind == "char":
        tokenizer: Tokenizer = _CharSet([*split.documents("train"), *split.documents("val")]).tokenizer()
    else:
        assert vocab_size is not None  # checked above: given for every kind but char
        texts = (text for text, _ in document_chunks(_pieces_of(split.documents("train")), TRAINING_CHUNK_CHARS))
        tokenizer = (BPETokenizer.train(texts, vocab_size, special_tokens=special_tokens) if kind == "bpe"
                     else WordPieceTokenizer.train(texts, vocab_size))
    _save_tokenizer(tokenizer, directory)
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
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
    key = _cache_key(FORMAT_VERSION, split.text_sha256, [(w.start, w.end) for w in works], tokenizer.fingerprint)
    path = Path(cache_dir or default_cache_dir()) / "tokens" / f"{key}.bin"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_tokens(path, encode_documents(_pieces_of(split.documents(which)), tokenizer), dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# ----------------------------------------------------------------------------- streamed: files

@dataclasses.dataclass(frozen=True)
class SplitStats:
    documents: int
    characters: int  # of the documents, separators not counted
    tokens: int


@dataclasses.dataclass(frozen=True)
class DataStats:
    """What a preparation produced; `note` says why validation's share of the characters lies outside
    [0.5, 2] x val_fraction, or that validation came from separate data."""

    train: SplitStats
    val: SplitStats
    val_fraction: float | None  # None: validation is separate data
    note: str | None = None

    @property
    def val_share(self) -> float:
        return self.val.characters / (self.train.characters + self.val.characters)

    def lines(self) -> list[str]:
        """The log of the split: one line per split, then the note if any."""
        lines = [f"{which}: {stats.documents:,} documents, {stats.characters:,} characters, "
                 f"{stats.tokens:,} tokens" for which, stats in (("train", self.train), ("val", self.val))]
        lines[1] += f" ({self.val_share:.1%} of the characters" + (
            f"; val_fraction {self.val_fraction:g})" if self.val_fraction is not None else ")")
        return lines + ([f"note: {self.note}"] if self.note else [])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"val_share": self.val_share}

    @classmethod
    def from_dict(cls, state: dict) -> DataStats:
        return cls(SplitStats(**state["train"]), SplitStats(**state["val"]), state["val_fraction"], state["note"])


@dataclasses.dataclass(frozen=True, eq=False)
class LMData:
    """Everything a language-model run reads: the tokenizer, both token arrays and their statistics."""

    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    stats: DataStats
    directory: Path  # the cache entry holding the arrays


def _progress_bar(sources: Sequence[Source], what: str, enabled: bool) -> tqdm:
    """Bytes read from disk, MB/s and ETA on stderr."""
    return tqdm(total=sum(s.total_bytes for s in sources), desc=f"{what} {sources[0].name}", unit="B",
                unit_scale=True, unit_divisor=1000, disable=not enabled, file=sys.stderr, mininterval=0.5,
                leave=False)


def _scan(source: Source, chars: _CharSet | None, progress: bool) -> array:
    """Each document's length in characters; adds the characters seen to `chars` unless None."""
    lengths, length = array("q"), 0
    with _progress_bar([source], "scanning", progress) as bar:
        for piece in source.pieces(bar.update):
            length += len(piece.text)
            if chars is not None:
                chars.add(piece.text)
            if piece.last:
                lengths.append(length)
                length = 0
    if not lengths:
        raise ValueError(f"{source.name} holds no non-blank document")
    return lengths


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Documents before `index` train, after it validate; document `index` validates whole when
    `cut` is None, else up to character `cut` it trains."""

    index: int
    cut: int | None
    note: str | None


def _plan(source: Source, lengths: array, val_fraction: float, progress: bool) -> _Plan:
    boundary = val_boundary(np.frombuffer(lengths, dtype=np.int64), val_fraction)
    if boundary.need is None:
        return _Plan(boundary.index, None, None)
    with _progress_bar([source], "finding the line to cut in", progress) as bar:
        texts = _document_texts(source.pieces(bar.update), boundary.index)
        cut = line_cut(boundary, lengths[boundary.index], texts)
    where = f"document {boundary.index + 1} of {len(lengths)} ({lengths[boundary.index]:,} characters)"
    if cut is None:
        return _Plan(boundary.index, None, f"{where} goes to validation whole: it holds more than twice "
                                           "val_fraction of the text, but no line break in it leaves "
                                           "validation at least val_fraction")
    early = boundary.index == 0 and cut > lengths[0] - boundary.need
    return _Plan(boundary.index, cut, f"{where} is cut by lines" + (
        ": its first line is longer than the training share allows, so validation gets the rest" if early else ""))


def _document_texts(pieces: Iterable[Piece], index: int) -> Iterator[str]:
    """The texts of the pieces of document `index` (0-based), reading no further."""
    count = 0
    for piece in pieces:
        if count == index:
            yield piece.text
        if piece.last:
            count += 1
            if count > index:
                return


def _route(source: Source, plan: _Plan, progress: Callable[[int], None]) -> Iterator[tuple[str, Piece]]:
    """(split, piece) for each piece of `source` by the plan: all training first, then validation."""
    index = offset = 0  # the document a piece belongs to, and where in it the piece starts
    for piece in source.pieces(progress):
        end = offset + len(piece.text)
        cut = plan.cut if index == plan.index else None
        if index < plan.index or (cut is not None and end <= cut):
            yield "train", Piece(piece.text, piece.last or end == cut)
        elif cut is None or offset >= cut:
            yield "val", piece
        else:  # the cut falls inside this piece
            yield "train", Piece(piece.text[:cut - offset], True)
            yield "val", Piece(piece.text[cut - offset:], piece.last)
        offset = 0 if piece.last else end
        index += piece.last


def _training_sample(pieces: Iterable[Piece], train_chars: int) -> Iterator[str]:
    """The training text in chunks, every s-th window of SAMPLE_WINDOW_CHARS (see the module docstring)."""
    stride = max(1, math.ceil(train_chars / TOKENIZER_SAMPLE_CHARS))
    offset = 0
    for text, _ in document_chunks(pieces, TRAINING_CHUNK_CHARS):
        if (offset // SAMPLE_WINDOW_CHARS) % stride == 0:
            yield text
        offset += len(text)


class _Counter:
    """Counts the documents and characters of the pieces passing through."""

    def __init__(self, pieces: Iterable[Piece]):
        self.pieces, self.documents, self.characters = pieces, 0, 0

    def __iter__(self) -> Iterator[Piece]:
        for piece in self.pieces:
            self.characters += len(piece.text)
            self.documents += piece.last
            yield piece


def prepare_lm_data(path: str | os.PathLike | None = None, *, tokenizer: str | Tokenizer = "char",
                    vocab_size: int | None = None, cache_dir: str | os.PathLike | None = None,
                    val_fraction: float = VAL_FRACTION, val_path: str | os.PathLike | None = None,
                    text_field: str = "text", progress: bool = False,
                    log: Callable[[str], None] | None = None) -> LMData:
    """Read, split, tokenize (a kind to build here, "char" or "bpe", or a given tokenizer, e.g. a
    checkpoint's) and encode `path` (see `sources.open_source`; None: the bundled corpus), streamed.

    val_path: validation data of its own; then all of `path` trains and val_fraction is unused.
    progress: a progress bar (bytes, MB/s, ETA) on stderr per pass. log: told the split's statistics.
    After a first run nothing is read again: the cache entry is found from the files' metadata.
    """
    if isinstance(tokenizer, str):
        _checks.check_choice("tokenizer", tokenizer, ("char", "bpe"))
        if (tokenizer == "char") != (vocab_size is None):
            raise ValueError(f"vocab_size must be {'None' if tokenizer == 'char' else 'given'} for a "
                             f"{tokenizer} tokenizer, got {vocab_size}")
        spec: tuple[object, ...] = (tokenizer, vocab_size, hf.__version__, TOKENIZER_SAMPLE_CHARS)
    elif vocab_size is not None:
        raise ValueError("vocab_size only applies when the tokenizer is built here (tokenizer given as a kind)")
    else:
        _checks.check_choice("tokenizer kind", tokenizer.kind, ("char", "bpe"))
        spec = (tokenizer.fingerprint,)
    source = open_source(path, text_field=text_field)
    val_source = None if val_path is None else open_source(val_path, text_field=text_field)
    split_spec = val_source.fingerprint if val_source else check_val_fraction(val_fraction)
    directory = (Path(cache_dir or default_cache_dir()) / "lm"
                 / _cache_key(FORMAT_VERSION, source.fingerprint, split_spec, *spec))
    data = _load_prepared(directory, tokenizer)
    if data is None:
        # One preparer at a time (e.g. the ranks of one torchrun): a second one would remove the first's
        # tokenizer as a leftover; it waits, then finds the entry complete.
        with run_lock(directory, wait=True):
            data = _load_prepared(directory, tokenizer)
            if data is None:
                _prepare(directory, source, val_source, tokenizer, vocab_size, val_fraction, progress)
                data = _load_prepared(directory, tokenizer)
                assert data is not None, "a preparation just written must load"
    if log:
        for line in data.stats.lines():
            log(line)
    return data


def _load_prepared(directory: Path, tokenizer: str | Tokenizer) -> LMData | None:
    """The cache entry in `directory`, or None unless it is complete."""
    try:
        stats = DataStats.from_dict(json.loads((directory / "stats.json").read_text(encoding="utf-8")))
        tok = load_tokenizer(directory / "tokenizer") if isinstance(tokenizer, str) else tokenizer
    except (OSError, ValueError, KeyError, TypeError):
        return None
    dtype = token_dtype(tok.vocab_size)
    arrays = []
    for which, split in (("train", stats.train), ("val", stats.val)):
        file = directory / f"{which}.bin"
        if not file.is_file() or file.stat().st_size != split.tokens * dtype.itemsize:
            return None
        arrays.append(np.memmap(file, dtype=dtype, mode="r"))
    train, val = arrays
    return LMData(tok, train, val, stats, directory)


def _remove_leftovers(directory: Path) -> None:
    """What a preparation that did not finish left in `directory`: its tokenizer, and the temporary
    files whose writer is gone (a kill -9)."""
    shutil.rmtree(directory / "tokenizer", ignore_errors=True)
    remove_stale_temporaries(directory)


def _prepare(directory: Path, source: Source, val_source: Source | None, tokenizer: str | Tokenizer,
             vocab_size: int | None, val_fraction: float, progress: bool) -> None:
    chars = _CharSet() if tokenizer == "char" else None
    lengths = _scan(source, chars, progress)
    sources = [source]
    if val_source is None:
        plan = _plan(source, lengths, val_fraction, progress)
    else:
        _scan(val_source, chars, progress)
        plan = _Plan(len(lengths), None, f"validation is {val_source.name}")
        sources.append(val_source)

    def routed(bar: tqdm) -> Iterator[tuple[str, Piece]]:
        if val_source is None:
            return _route(source, plan, bar.update)
        return itertools.chain((("train", p) for p in source.pieces(bar.update)),
                               (("val", p) for p in val_source.pieces(bar.update)))

    directory.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(directory)
    if chars is not None:  # the tokenizer is "char"
        tokenizer = chars.tokenizer()
        _save_tokenizer(tokenizer, directory / "tokenizer")
    elif isinstance(tokenizer, str):
        assert vocab_size is not None  # checked by prepare_lm_data: given for a bpe tokenizer
        train_chars = int(sum(lengths[:plan.index])) + (plan.cut or 0)
        with _progress_bar([source], "training the tokenizer on", progress) as bar:
            train = itertools.takewhile(lambda item: item[0] == "train", routed(bar))
            sample = _training_sample((piece for _, piece in train), train_chars)
            tokenizer = BPETokenizer.train(sample, vocab_size, special_tokens=(END_OF_TEXT,))
        _save_tokenizer(tokenizer, directory / "tokenizer")
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {}
    with _progress_bar(sources, "encoding", progress) as bar:
        for which, group in itertools.groupby(routed(bar), key=lambda item: item[0]):
            counter = _Counter(piece for _, piece in group)
            tokens = _write_tokens(directory / f"{which}.bin", encode_documents(counter, tokenizer), dtype)
            splits[which] = SplitStats(counter.documents, counter.characters, tokens)
    stats = DataStats(splits["train"], splits["val"], None if val_source else val_fraction, plan.note)
    with atomic_path(directory / "stats.json") as tmp:
        tmp.write_text(json.dumps(stats.to_dict(), indent=1), encoding="utf-8")


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
