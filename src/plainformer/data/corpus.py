"""Text corpora and their train/validation split by whole works.

The bundled corpus is 38 works of Shakespeare (plays and poems, Project Gutenberg, 4,732,575
characters), listed with their lengths in `corpus/works.tsv` and separated by two blank lines.

Validation is the last ~10% of works, never random offsets, so that validation text is unseen text
rather than neighbours of training windows: n_val = max(1, round(0.1 · n_works)), kept below n_works.
For the bundled corpus that is the last 4 of the 38 works in `works.tsv` order — Troilus and Cressida,
Twelfth Night, Two Gentlemen of Verona and The Winter's Tale (524,941 characters, 11.1%).
For any other UTF-8 file (`--data PATH`), a work is a block of text between two or more blank lines;
a file with a single such block is split by lines instead, the last ~10% of its lines (at least one)
going to validation.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import os
import re
from pathlib import Path
from typing import Iterator, Sequence

from .. import _checks
from .tokenizers import (
    text_chunks,
)

SPLITS = ("train", "val")


VAL_FRACTION = 0.1


ENCODE_CHUNK_CHARS = 1 << 17


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


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
