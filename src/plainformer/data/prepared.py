"""A corpus prepared once, from files, into memory-mapped token arrays: `prepare_lm_data`.

It streams the data (see `sources`) in passes; none holds the corpus, so resident memory is bounded by
the chunk sizes and the tokenizer (plus 8 bytes per document, the lengths the split rule needs), not by
the corpus:
1. scan: each document's length in characters (for a char tokenizer, also the characters seen);
2. the split (`corpus.val_boundary`); when it cuts a document by lines, a read up to that document;
3. for a BPE tokenizer built here, training streamed to `train_from_iterator` over the training
   documents, or beyond TOKENIZER_SAMPLE_CHARS characters over an evenly spread sample of them: every
   s-th window of SAMPLE_WINDOW_CHARS characters, s = ceil(training characters / TOKENIZER_SAMPLE_CHARS);
4. encoding, chunk by chunk at cuts where tokenization is local, straight into `train.bin` / `val.bin`
   (uint16 when the vocabulary fits, else uint32), opened with `np.memmap`.

The arrays are those `lm.token_array` computes from a `TextSplit` in memory: each document encoded,
joined by the end-of-text token (a BPE tokenizer built here gains "<eos>") or the ids of a blank line.

Cache: one directory per preparation, keyed by the files' paths, sizes and modification times, the
split settings and the tokenizer (its kind and size, or a given tokenizer's fingerprint). `stats.json`
is written last and atomically, and it records the token counts: an entry without it, or whose
arrays do not match it (a preparation killed midway), is prepared again, never trusted. A file whose
size or modification time changed while it was read is refused, and a preparation that fails leaves
no array or tokenizer behind.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers as hf
from tqdm import tqdm

from .. import _checks
from ..files.atomic import atomic_path, remove_stale_temporaries
from ..files.json_file import read_json_object
from ..files.run_lock import run_lock
from ..log import log
from ..memory import format_size
from .corpus import VAL_FRACTION, check_val_fraction, line_cut, val_boundary
from .lm import (
    FORMAT_VERSION,
    CharSet,
    cache_key,
    default_cache_dir,
    document_chunks,
    encode_documents,
    save_tokenizer,
    token_dtype,
    write_tokens,
)
from .sources import Piece, Source, open_source
from .tokenizers import TRAINING_CHUNK_CHARS, BPETokenizer, Tokenizer, load_tokenizer

END_OF_TEXT = "eos"  # the role of the BPE special token "<eos>" between documents
TOKENIZER_SAMPLE_CHARS = 1 << 25  # ~33.5M characters: plenty for vocabularies of a few 10k tokens
SAMPLE_WINDOW_CHARS = 1 << 20


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


# A source whose text passes EXPANSION_NOTE_CHARS characters and EXPANSION_NOTE characters per byte it holds on disk
# (a .gz: text compresses 3-4 fold, a gzip bomb a thousand fold) is said to, once: its size, and so the time of each
# pass over it, is not what the progress bar's bytes on disk suggest.
EXPANSION_NOTE = 100
EXPANSION_NOTE_CHARS = 10**8


def _scan(source: Source, chars: CharSet | None, progress: bool) -> array:
    """Each document's length in characters; adds the characters seen to `chars` unless None."""
    lengths, length, characters, noted = array("q"), 0, 0, False
    on_disk = source.total_bytes
    with _progress_bar([source], "scanning", progress) as bar:
        for piece in source.pieces(bar.update):
            length += len(piece.text)
            characters += len(piece.text)
            if not noted and characters > max(EXPANSION_NOTE_CHARS, EXPANSION_NOTE * on_disk):
                noted = True
                bar.clear()
                log(f"plainformer: {source.name} expands more than {EXPANSION_NOTE}-fold ({characters:,} characters "
                    f"so far from {format_size(on_disk)} on disk): each pass over it reads all of them; Ctrl-C stops")
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
    sources = [source] if val_source is None else [source, val_source]
    states = [s.file_states() for s in sources]  # before the fingerprints: what the entry is keyed on
    split_spec = val_source.fingerprint if val_source else check_val_fraction(val_fraction)
    directory = (Path(cache_dir or default_cache_dir()) / "lm"
                 / cache_key(FORMAT_VERSION, source.fingerprint, split_spec, *spec))
    data = _load_prepared(directory, tokenizer)
    if data is None:
        # One preparer at a time (e.g. the ranks of one torchrun): a second one would remove the first's
        # tokenizer as a leftover; it waits, then finds the entry complete.
        with run_lock(directory, wait=True):
            data = _load_prepared(directory, tokenizer)
            if data is None:
                try:
                    stats = _prepare(directory, source, val_source, tokenizer, vocab_size, val_fraction, progress)
                    _check_unchanged(sources, states)
                except BaseException:
                    _discard(directory)
                    _check_unchanged(sources, states)  # a file edited midway is the cause to report
                    raise
                with atomic_path(directory / "stats.json") as tmp:  # last: it makes the entry complete
                    tmp.write_text(json.dumps(stats.to_dict(), indent=1), encoding="utf-8")
                data = _load_prepared(directory, tokenizer)
                assert data is not None, "a preparation just written must load"
    if log:
        for line in data.stats.lines():
            log(line)
    return data


def _load_prepared(directory: Path, tokenizer: str | Tokenizer) -> LMData | None:
    """The cache entry in `directory`, or None unless it is complete."""
    try:
        stats = DataStats.from_dict(read_json_object(directory / "stats.json"))
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


def _check_unchanged(sources: Sequence[Source], states: Sequence[list[tuple[int, int]]]) -> None:
    for source, before in zip(sources, states, strict=True):
        source.check_unchanged(before)


def _discard(directory: Path) -> None:
    """Remove what a preparation that failed wrote (all but the lock it holds)."""
    _remove_leftovers(directory)
    for name in ("train.bin", "val.bin", "stats.json"):
        (directory / name).unlink(missing_ok=True)


def _prepare(directory: Path, source: Source, val_source: Source | None, tokenizer: str | Tokenizer,
             vocab_size: int | None, val_fraction: float, progress: bool) -> DataStats:
    """Write the tokenizer and the arrays into `directory`; their statistics, for stats.json."""
    chars = CharSet() if tokenizer == "char" else None
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
        save_tokenizer(tokenizer, directory / "tokenizer")
    elif isinstance(tokenizer, str):
        assert vocab_size is not None  # checked by prepare_lm_data: given for a bpe tokenizer
        train_chars = int(sum(lengths[:plan.index])) + (plan.cut or 0)
        with _progress_bar([source], "training the tokenizer on", progress) as bar:
            train = itertools.takewhile(lambda item: item[0] == "train", routed(bar))
            sample = _training_sample((piece for _, piece in train), train_chars)
            tokenizer = BPETokenizer.train(sample, vocab_size, special_tokens=(END_OF_TEXT,))
        save_tokenizer(tokenizer, directory / "tokenizer")
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {}
    with _progress_bar(sources, "encoding", progress) as bar:
        for which, group in itertools.groupby(routed(bar), key=lambda item: item[0]):
            counter = _Counter(piece for _, piece in group)
            tokens = write_tokens(directory / f"{which}.bin", encode_documents(counter, tokenizer), dtype)
            splits[which] = SplitStats(counter.documents, counter.characters, tokens)
    return DataStats(splits["train"], splits["val"], None if val_source else val_fraction, plan.note)


