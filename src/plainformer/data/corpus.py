"""Text corpora and their train/validation split by whole documents, true to its size.

The bundled corpus is 38 works of Shakespeare (plays and poems, Project Gutenberg, 4,732,575
characters), listed with their lengths in `corpus/works.tsv` and separated by two blank lines. For
any other text a document ("work") is a block between two or more blank lines, without the blank
lines before it and the whitespace after it (see `sources` for folders, globs and JSON Lines).

Validation is the end of the corpus, never random offsets, so that validation text is unseen text
rather than neighbours of training windows. With document lengths c_1..c_n (characters) and
C = sum c_i, validation takes whole documents from the end until they hold at least
val_fraction * C characters. Only when that last document taken would carry validation past
2 * val_fraction * C (or is the first document, which training needs) is it cut instead, at the
line start that gives validation at least val_fraction * C: validation then holds that document's
last lines. The split depends on the lengths alone, so it is the same in every run.

For the bundled corpus that is the last 4 of the 38 works in `works.tsv` order — Troilus and Cressida,
Twelfth Night, Two Gentlemen of Verona and The Winter's Tale (524,941 characters, 11.1%; the last 3
hold 7.8%), the split it had when validation was the last 10% of the works by count.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import itertools
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .. import _checks
from .tokenizers import (
    text_chunks,
)

SPLITS = ("train", "val")


VAL_FRACTION = 0.1


# Two or more blank (empty or spaces-only) lines end a document inside one text file.
DOCUMENT_BREAK = re.compile(r"\n(?:[ \t]*\n){2,}")


ENCODE_CHUNK_CHARS = 1 << 17


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
    gaps = [text[a.end:b.start] for a, b in itertools.pairwise(works)]
    if works[-1].end != len(text) or any(gap != _BUNDLED_SEPARATOR for gap in gaps):
        raise ValueError("the bundled corpus does not match corpus/works.tsv; the installation is damaged")
    # Each work ends with a newline; like any document it goes without its trailing whitespace.
    return [Work(w.title, w.start, w.start + len(text[w.start:w.end].rstrip())) for w in works]


def find_works(text: str) -> list[Work]:
    """Blocks of `text` separated by two or more blank lines, each from its first non-blank line to its
    last non-space character; titled by its first line."""
    works, start = [], 0
    for brk in [*DOCUMENT_BREAK.finditer(text), None]:
        end = brk.start() if brk else len(text)
        block = text[start:end]
        body = block.rstrip()
        first = len(body) - len(body.lstrip())
        if body:
            begin = start + block.rfind("\n", 0, first) + 1
            title = body[first:].partition("\n")[0].strip()[:60]
            works.append(Work(title, begin, start + len(body)))
        start = brk.end() if brk else end
    return works


def check_val_fraction(val_fraction: float) -> float:
    _checks.check_probability("val_fraction", val_fraction)
    if val_fraction == 0:
        raise ValueError("val_fraction must be in (0, 1), got 0")
    return val_fraction


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Where validation starts: at document `index`, whole when `need` is None, else only its last
    lines, enough to give validation `need` more characters (see the module docstring)."""

    index: int
    need: int | None


def val_boundary(lengths: Sequence[int] | np.ndarray, val_fraction: float = VAL_FRACTION) -> Boundary:
    """The split rule on document lengths c_1..c_n (characters, each > 0)."""
    check_val_fraction(val_fraction)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        raise ValueError("the text holds no non-blank work to split")
    target = val_fraction * int(lengths.sum())
    suffix = np.cumsum(lengths[::-1])  # characters of the last 1, 2, ... documents
    taken = int(np.searchsorted(suffix, target))  # the last taken + 1 documents reach the target
    index = len(lengths) - 1 - taken
    if index == 0 or suffix[taken] > 2 * target:
        return Boundary(index, math.ceil(target - (int(suffix[taken]) - int(lengths[index]))))
    return Boundary(index, None)


def line_cut(boundary: Boundary, length: int, pieces: Iterable[str]) -> int | None:
    """Where to cut the boundary document (`length` characters, its text given in pieces): the last
    line start leaving validation at least `boundary.need` characters; failing that, for the first
    document, which cannot go whole, the first line start. None: no line start fits, the document
    goes to validation whole."""
    assert boundary.need is not None, "a boundary document cut by lines has a need"
    limit = length - boundary.need  # cut at or before this offset
    before = after = None
    offset = 0
    for piece in pieces:
        if limit - offset > 0 and (i := piece.rfind("\n", 0, limit - offset)) >= 0:
            before = offset + i + 1
        if (j := piece.find("\n", max(0, limit - offset))) >= 0:
            after = offset + j + 1
            break
        offset += len(piece)
    if before is None and boundary.index == 0:
        if after is None:
            raise ValueError("the text is a single line: it cannot be split into training and validation "
                             "parts (separate documents by two blank lines, or add lines)")
        return after
    return before


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """A text and its works, the last ones held out for validation (the boundary work possibly cut in two)."""

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

    def documents(self, split: str) -> Iterator[str]:
        """The text of each work of a split, in order."""
        works = self.train_works if _checks.check_choice("split", split, SPLITS) == "train" else self.val_works
        return (self.text[w.start:w.end] for w in works)

    @functools.cached_property
    def text_sha256(self) -> str:
        """sha256 of the UTF-8 text, hashed slice by slice so that no second copy is ever whole."""
        digest, step = hashlib.sha256(), 1 << 20
        for i in range(0, len(self.text), step):
            digest.update(self.text[i:i + step].encode("utf-8", "surrogatepass"))
        return digest.hexdigest()


def split_text(text: str, works: Sequence[Work] | None = None, *, val_fraction: float = VAL_FRACTION) -> TextSplit:
    """Hold out the last works of `text` (found by `find_works` unless given) for validation, by the
    rule of the module docstring."""
    works = list(find_works(text) if works is None else works)
    boundary = val_boundary([w.end - w.start for w in works], val_fraction)
    k = boundary.index
    work = works[k]
    cut = None if boundary.need is None else line_cut(boundary, work.end - work.start, [text[work.start:work.end]])
    if cut is None:
        return TextSplit(text, tuple(works[:k]), tuple(works[k:]))
    head_lines = text.count("\n", work.start, work.start + cut)
    lines = head_lines + 1 + text.count("\n", work.start + cut, work.end)
    head = Work(f"{work.title} (lines 1-{head_lines})", work.start, work.start + cut)
    tail = Work(f"{work.title} (lines {head_lines + 1}-{lines})", work.start + cut, work.end)
    return TextSplit(text, (*works[:k], head), (tail, *works[k + 1:]))


def load_split(path: str | os.PathLike | None = None, *, val_fraction: float = VAL_FRACTION) -> TextSplit:
    """`load_text(path)` split by works: works.tsv for the bundled corpus, blank lines otherwise."""
    text = load_text(path)
    return split_text(text, bundled_works(text) if path is None else None, val_fraction=val_fraction)


def check_batch_index(index: object, batch_size: object) -> None:
    """The arguments of a batch source's get_batch(split, index, batch_size): index >= 0, batch_size >= 1."""
    if not _checks.is_int(index) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    _checks.check_positive_int("batch_size", batch_size)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
