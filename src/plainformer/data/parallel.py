"""Parallel data: sentence pairs in the forms people hold them, cleaned, and prepared once for training.

`open_parallel(data, source_lang, target_lang)` reads
- line-aligned files named by a prefix and the two languages, plain or gzipped: `DIR/train` with de and en
  reads `DIR/train.de[.gz]` and `DIR/train.en[.gz]`, line i of one translating line i of the other (the
  fairseq and Marian convention);
- a two-column TSV (`.tsv`, `.tsv.gz`): the source, a tab, the target; or, under a first row that names the
  two languages (`de<TAB>en`, in either order), the columns those names head;
- JSON Lines (`.jsonl`, `.jsonl.gz`) in the `datasets` shape: `{"translation": {"de": ..., "en": ...}}`.

Each is streamed: `ParallelSource.pairs()` yields one `Pair` at a time with the file and line it came from, and
a bad row is a ValueError naming them. Files whose line counts differ are refused naming both counts.

`clean` drops what Moses' clean-corpus-n.perl drops from training data, and counts it (`Dropped`): pairs with
an empty side, a side of more than `max_words` words, or a word ratio above `max_ratio` (defaults 250 and 9).

`prepare_parallel_data` learns one SentencePiece vocabulary on both sides of the cleaned training pairs (the
paper's shared vocabulary) and writes every pair's ids to memory-mapped arrays in the cache, in two streamed
passes: memory holds a chunk of pairs and SentencePiece's bounded sample, not the corpus. It does not depend on
the model: the batches leave out (and count) the pairs longer than a model's positions (`seq2seq.PairBatches`).
Validation pairs are kept whole as text too, for BLEU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import _checks
from ..files.atomic import atomic_path
from ..files.json_file import read_json_object
from ..files.run_lock import run_lock
from .lm import cache_key, default_cache_dir, token_dtype
from .sources import json_record, text_lines
from .tokenizers import SentencePieceTokenizer, Tokenizer, load_tokenizer

MAX_WORDS = 250  # clean-corpus-n's usual upper length in words
MAX_RATIO = 9.0  # clean-corpus-n's default ratio of the two sides' word counts
ENCODE_CHUNK = 10_000  # pairs encoded at once in the second pass
FORMAT_VERSION = 1
TSV_SUFFIXES = (".tsv", ".tsv.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


@dataclasses.dataclass(frozen=True)
class Pair:
    source: str
    target: str
    where: str  # "train.de:12", to name in an error


@dataclasses.dataclass(frozen=True)
class ParallelSource:
    """The file(s) of one --data or --val-data argument, and how they hold pairs: "aligned" (two files),
    "tsv" or "jsonl" (one)."""

    name: str
    layout: str
    files: tuple[Path, ...]
    source_lang: str
    target_lang: str

    def file_states(self) -> list[tuple[int, int]]:
        return [(stat.st_size, stat.st_mtime_ns) for stat in (path.stat() for path in self.files)]

    @property
    def fingerprint(self) -> str:
        return cache_key(self.layout, self.source_lang, self.target_lang,
                         *(f"{path.resolve()}:{size}:{mtime}" for path, (size, mtime)
                           in zip(self.files, self.file_states(), strict=True)))

    def pairs(self) -> Iterator[Pair]:
        """Every pair, in file order, its two sides stripped of surrounding whitespace."""
        return {"aligned": self._aligned, "tsv": self._tsv, "jsonl": self._jsonl}[self.layout]()

    def _aligned(self) -> Iterator[Pair]:
        source_file, target_file = self.files
        sources, targets = text_lines(source_file), text_lines(target_file)
        for number, (source, target) in enumerate(itertools.zip_longest(sources, targets), 1):
            if source is None or target is None:
                counted = number - 1 + sum(1 for _ in (sources if target is None else targets)) + 1
                counts = (counted, number - 1) if target is None else (number - 1, counted)
                raise ValueError(f"{source_file} has {counts[0]:,} lines but {target_file} has {counts[1]:,}: "
                                 "line-aligned files must have one line per pair")
            yield Pair(source.strip(), target.strip(), f"{source_file.name}:{number}")

    def _tsv(self) -> Iterator[Pair]:
        path = self.files[0]
        source = 0
        for number, line in enumerate(text_lines(path), 1):
            columns = line.rstrip("\n").split("\t")
            if len(columns) != 2:
                raise ValueError(f"{path}:{number}: expected 2 tab-separated columns (source, target), "
                                 f"got {len(columns)}")
            names = [c.strip() for c in columns]
            if number == 1 and sorted(names) == sorted((self.source_lang, self.target_lang)):
                source = names.index(self.source_lang)  # a header: its names say which column is which
                continue
            yield Pair(columns[source].strip(), columns[1 - source].strip(), f"{path.name}:{number}")

    def _jsonl(self) -> Iterator[Pair]:
        path = self.files[0]
        for number, line in enumerate(text_lines(path), 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            pair = json_record(line, where).get("translation")
            if not isinstance(pair, dict):
                raise ValueError(f"{where}: expected an object {{\"translation\": {{\"{self.source_lang}\": ..., "
                                 f"\"{self.target_lang}\": ...}}}}")
            sides = []
            for lang in (self.source_lang, self.target_lang):
                text = pair.get(lang)
                if not isinstance(text, str):
                    raise ValueError(f"{where}: translation.{lang} must be a string, got "
                                     f"{'nothing' if text is None else type(text).__name__}")
                sides.append(text.strip())
            yield Pair(sides[0], sides[1], f"{path.name}:{number}")


def open_parallel(data: str | os.PathLike, source_lang: str, target_lang: str) -> ParallelSource:
    """The pairs that `data` names (see the module docstring), its files checked to exist."""
    for name, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
        if not isinstance(lang, str) or not lang or any(c in lang for c in "/\\\0\t"):
            raise ValueError(f"{name} must be a language code such as 'de', got {lang!r}")
    if source_lang == target_lang:
        raise ValueError(f"source_lang and target_lang must differ, got {source_lang!r} twice")
    path = Path(data)
    layout = "tsv" if path.name.endswith(TSV_SUFFIXES) else "jsonl" if path.name.endswith(JSONL_SUFFIXES) else None
    if layout is not None:
        if not path.is_file():
            raise FileNotFoundError(f"parallel data file not found: {path}")
        return ParallelSource(str(path), layout, (path,), source_lang, target_lang)
    files = tuple(_side_file(path, lang) for lang in (source_lang, target_lang))
    return ParallelSource(str(path), "aligned", files, source_lang, target_lang)


def _side_file(prefix: Path, lang: str) -> Path:
    for name in (f"{prefix.name}.{lang}", f"{prefix.name}.{lang}.gz"):
        if (prefix.parent / name).is_file():
            return prefix.parent / name
    raise FileNotFoundError(f"no {prefix}.{lang} or {prefix}.{lang}.gz: give --data as PREFIX of the files "
                            f"PREFIX.{lang}[.gz] (or a .tsv or .jsonl file)")


# ----------------------------------------------------------------------------- cleaning

@dataclasses.dataclass
class Dropped:
    """Pairs left out of training, by reason."""

    empty: int = 0
    too_long: int = 0  # a side of more than max_words words
    ratio: int = 0  # one side more than max_ratio times as many words as the other

    @property
    def total(self) -> int:
        return self.empty + self.too_long + self.ratio

    def line(self, kept: int) -> str:
        reasons = ", ".join(f"{count:,} {what}" for count, what in (
            (self.empty, "with an empty side"), (self.too_long, "too long"), (self.ratio, "past the length ratio"))
            if count)
        return f"{kept:,} pairs kept, {self.total:,} dropped" + (f" ({reasons})" if reasons else "")


def clean(pairs: Iterable[Pair], dropped: Dropped, *, max_words: int = MAX_WORDS,
          max_ratio: float = MAX_RATIO) -> Iterator[Pair]:
    """The pairs clean-corpus-n.perl keeps: both sides non-empty, at most `max_words` words each, neither more
    than `max_ratio` times as many words as the other; the others are counted in `dropped`."""
    for pair in pairs:
        words = len(pair.source.split()), len(pair.target.split())
        if not all(words):
            dropped.empty += 1
        elif max(words) > max_words:
            dropped.too_long += 1
        elif max(words) > max_ratio * min(words):
            dropped.ratio += 1
        else:
            yield pair


# ----------------------------------------------------------------------------- encoded pairs

@dataclasses.dataclass(frozen=True, eq=False)
class EncodedPairs:
    """The token ids of N pairs: source i is source_ids[source_offsets[i]:source_offsets[i + 1]], likewise
    the target (neither holds bos or eos)."""

    source_ids: np.ndarray
    source_offsets: np.ndarray  # (N + 1,)
    target_ids: np.ndarray
    target_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.source_offsets) - 1

    def source(self, i: int) -> np.ndarray:
        return self.source_ids[self.source_offsets[i]:self.source_offsets[i + 1]]

    def target(self, i: int) -> np.ndarray:
        return self.target_ids[self.target_offsets[i]:self.target_offsets[i + 1]]

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        return np.diff(self.source_offsets), np.diff(self.target_offsets)


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelData:
    """A prepared corpus: its tokenizer, the encoded training and validation pairs, the validation pairs as
    text (sources and references, every one, for BLEU) and what was kept and dropped."""

    tokenizer: Tokenizer
    train: EncodedPairs
    val: EncodedPairs
    val_sources: list[str]
    val_references: list[str]
    stats: dict
    directory: Path


def prepare_parallel_data(train: str | os.PathLike, val: str | os.PathLike, *, source_lang: str, target_lang: str,
                          vocab_size: int | None = None, tokenizer: Tokenizer | None = None,
                          cache_dir: str | os.PathLike | None = None, progress: bool = False,
                          log: Callable[[str], None] | None = None) -> ParallelData:
    """Prepare `train` and `val` (see `open_parallel`): a SentencePiece vocabulary of `vocab_size` learnt on the
    cleaned training pairs, or the `tokenizer` given (a resumed run's), then the ids of every pair. Cached: a
    second call with the same files and settings reads the arrays. progress: the pairs read, on stderr."""
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("give either vocab_size (a vocabulary to learn) or tokenizer (one to use)")
    if vocab_size is not None:
        _checks.check_positive_int("vocab_size", vocab_size)
    sources = [open_parallel(path, source_lang, target_lang) for path in (train, val)]
    spec = tokenizer.fingerprint if tokenizer is not None else ("sentencepiece", vocab_size)
    directory = (Path(cache_dir or default_cache_dir()) / "parallel"
                 / cache_key(FORMAT_VERSION, *(s.fingerprint for s in sources), spec, MAX_WORDS, MAX_RATIO))
    data = _load(directory, tokenizer)
    if data is None:
        with run_lock(directory, wait=True):
            data = _load(directory, tokenizer)
            if data is None:
                try:
                    _prepare(directory, *sources, tokenizer=tokenizer, vocab_size=vocab_size, progress=progress)
                except BaseException:
                    _discard(directory)  # a refused or interrupted preparation leaves nothing behind
                    raise
                data = _load(directory, tokenizer)
                assert data is not None, "a preparation just written must load"
    if log:
        log(f"train {sources[0].name}: {data.stats['train']}")
        log(f"val {sources[1].name}: {data.stats['val']}")
    return data


def _prepare(directory: Path, train: ParallelSource, val: ParallelSource, *, tokenizer: Tokenizer | None,
             vocab_size: int | None, progress: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        assert vocab_size is not None
        with _counting("learning the vocabulary from", train, progress) as count:
            sides = (text for pair in clean(count(train.pairs()), Dropped()) for text in (pair.source, pair.target))
            tokenizer = SentencePieceTokenizer.train(sides, vocab_size)
    tokenizer.save(directory / "tokenizer")
    stats = {}
    dropped = Dropped()
    with _counting("encoding", train, progress) as count:
        kept = _write_pairs(directory / "train", clean(count(train.pairs()), dropped), tokenizer)
    stats["train"] = dropped.line(kept)
    val_pairs = list(val.pairs())  # a validation set is small: it is translated whole at each evaluation
    with atomic_path(directory / "val.jsonl") as tmp:
        tmp.write_text("".join(json.dumps([p.source, p.target], ensure_ascii=False) + "\n" for p in val_pairs),
                       encoding="utf-8")
    kept = _write_pairs(directory / "val", (p for p in val_pairs if p.source and p.target), tokenizer)
    stats["val"] = f"{len(val_pairs):,} pairs, {kept:,} of them with two sides, for the loss"
    with atomic_path(directory / "stats.json") as tmp:  # last: it makes the entry complete
        tmp.write_text(json.dumps(stats, indent=1), encoding="utf-8")


@contextlib.contextmanager
def _counting(what: str, source: ParallelSource, enabled: bool) -> Iterator[Callable[[Iterable[Pair]], Iterator[Pair]]]:
    """A function that passes pairs through, counting them on a progress bar on stderr."""
    with tqdm(desc=f"{what} {source.name}", unit=" pairs", unit_scale=True, disable=not enabled, file=sys.stderr,
              mininterval=0.5, leave=False) as bar:
        def count(pairs: Iterable[Pair]) -> Iterator[Pair]:
            for pair in pairs:
                bar.update()
                yield pair
        yield count


def _write_pairs(prefix: Path, pairs: Iterable[Pair], tokenizer: Tokenizer) -> int:
    """Encode `pairs` chunk by chunk into PREFIX.{src,tgt}.bin, their lengths into PREFIX.{src,tgt}.len (uint32),
    each file written as it goes (memory holds one chunk). Returns the pairs written."""
    dtype = token_dtype(tokenizer.vocab_size)
    written = 0
    with contextlib.ExitStack() as files:
        out = {}
        for name in ("src.bin", "tgt.bin", "src.len", "tgt.len"):
            tmp = files.enter_context(atomic_path(prefix.with_suffix(f".{name}")))
            out[name] = files.enter_context(open(tmp, "wb"))
        iterator = iter(pairs)
        while chunk := list(itertools.islice(iterator, ENCODE_CHUNK)):
            for side, texts in (("src", [p.source for p in chunk]), ("tgt", [p.target for p in chunk])):
                ids = tokenizer.encode_many(texts)
                out[f"{side}.bin"].write(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype).tobytes())
                out[f"{side}.len"].write(np.array([len(i) for i in ids], dtype=np.uint32).tobytes())
            written += len(chunk)
    return written


def _discard(directory: Path) -> None:
    """Remove what a preparation wrote in `directory` (all but the lock it holds)."""
    for path in directory.iterdir():
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name != ".lock":
            path.unlink(missing_ok=True)


def _load(directory: Path, tokenizer: Tokenizer | None) -> ParallelData | None:
    """The cache entry in `directory`, or None unless it is complete."""
    try:
        stats = read_json_object(directory / "stats.json")
        tok = tokenizer or load_tokenizer(directory / "tokenizer")
        splits = {split: _encoded(directory / split, token_dtype(tok.vocab_size)) for split in ("train", "val")}
        val_pairs = [json.loads(line) for line in (directory / "val.jsonl").read_text(encoding="utf-8").splitlines()]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ParallelData(tok, splits["train"], splits["val"], [s for s, _ in val_pairs], [t for _, t in val_pairs],
                        stats, directory)


def _encoded(prefix: Path, dtype: np.dtype) -> EncodedPairs:
    sides = []
    for side in ("src", "tgt"):
        offsets = np.concatenate(([0], np.cumsum(np.fromfile(prefix.with_suffix(f".{side}.len"), dtype=np.uint32),
                                                 dtype=np.int64)))
        path = prefix.with_suffix(f".{side}.bin")
        if path.stat().st_size != int(offsets[-1]) * dtype.itemsize:
            raise ValueError(f"{path} does not hold the {int(offsets[-1])} tokens its lengths count")
        sides.append((np.memmap(path, dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype), offsets))
    if len(sides[0][1]) != len(sides[1][1]):
        raise ValueError(f"{prefix}: the two sides hold different numbers of pairs")
    return EncodedPairs(sides[0][0], sides[0][1], sides[1][0], sides[1][1])


def read_pairs(data: str | os.PathLike, source_lang: str, target_lang: str) -> tuple[list[str], list[str]]:
    """The sources and targets of `data` (see `open_parallel`), every pair, in order: a test set to score."""
    pairs = list(open_parallel(data, source_lang, target_lang).pairs())
    return [p.source for p in pairs], [p.target for p in pairs]

