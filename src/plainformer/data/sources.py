"""Documents from the user's data, read lazily: a corpus is never held whole in memory.

`open_source(data)` accepts
- nothing (None): the bundled Shakespeare corpus, one document per work of `corpus/works.tsv`;
- a text file, optionally gzipped (`.gz`): documents are the blocks between two or more blank lines;
- a folder: every `*.txt` / `*.md` file below it, in sorted order of their relative paths, one
  document per file;
- a glob (`data/*.txt`, `logs/**/*.md`): the matching files in sorted order, one document per text
  file, one per record for JSON Lines;
- JSON Lines (`.jsonl`, `.jsonl.gz`): one document per line, the string in field `text_field`.

Every document is normalised the same way whatever its origin: blank lines before its first
non-blank line and whitespace after its last non-space character are dropped; documents left empty
are skipped. So the same documents give the same text from any of the forms above.

`Source.pieces()` yields each document as consecutive `Piece`s of at most about `BLOCK_CHARS`
characters (a JSON record is one piece), the last one flagged. Text is decoded as UTF-8 (a leading
byte-order mark dropped, line endings made "\\n"); an undecodable byte or a bad JSON line raises a
ValueError naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import hashlib
import importlib.resources
import io
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .corpus import DOCUMENT_BREAK, bundled_works, load_text

BLOCK_CHARS = 1 << 20  # characters decoded per read


TEXT_SUFFIXES = (".txt", ".md")


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


_NON_SPACE = re.compile(r"\S")


_GLOB_CHARS = re.compile(r"[*?[]")
_SURROGATE = re.compile("[\ud800-\udfff]")


Progress = Callable[[int], None]  # told the number of bytes read from disk since its last call


@dataclasses.dataclass(frozen=True)
class Piece:
    """Consecutive text of one document; `last` marks the document's final piece."""

    text: str
    last: bool


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A file and how it holds documents: "blocks" (separated by two blank lines), "file" (the whole
    file is one document), "jsonl" (one per line) or "bundled" (the works of works.tsv)."""

    path: Path
    layout: str

    @property
    def compressed(self) -> bool:
        return self.path.name.endswith(".gz")


@dataclasses.dataclass(frozen=True)
class Source:
    """The files of one `--data` (or `--val-data`) argument, in reading order."""

    name: str
    files: tuple[DataFile, ...]
    text_field: str = "text"

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over each file's path, layout, size and modification time (and the JSON field):
        a changed, added or removed file changes it."""
        digest = hashlib.sha256(f"{self.text_field}\0".encode())
        for file, (size, mtime_ns) in zip(self.files, self.file_states(), strict=True):
            digest.update(f"{file.path.resolve()}\0{file.layout}\0{size}\0{mtime_ns}\0".encode())
        return digest.hexdigest()

    def file_states(self) -> list[tuple[int, int]]:
        """Each file's (size in bytes, modification time in ns) now: a file edited meanwhile differs."""
        return [(stat.st_size, stat.st_mtime_ns) for stat in (file.path.stat() for file in self.files)]

    def check_unchanged(self, states: Sequence[tuple[int, int]]) -> None:
        """Raise ValueError naming the first file whose size or modification time differs from `states`."""
        for file, before, now in zip(self.files, states, self.file_states(), strict=True):
            if before != now:
                raise ValueError(f"{file.path} changed while it was being read ({before[0]:,} bytes then, "
                                 f"{now[0]:,} now); run again once nothing writes to it")

    @property
    def total_bytes(self) -> int:
        """Bytes on disk (compressed size for .gz files): what a progress bar counts."""
        return sum(file.path.stat().st_size for file in self.files)

    def pieces(self, progress: Progress | None = None) -> Iterator[Piece]:
        """Every non-empty document of every file, in order, as pieces (see the module docstring)."""
        progress = progress or (lambda n: None)
        for file in self.files:
            yield from _documents(_RAW_READERS[file.layout](file, self.text_field, progress))


def open_source(data: str | os.PathLike | None = None, *, text_field: str = "text") -> Source:
    """The files that `data` names (see the module docstring), checked to exist."""
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    if data is None:
        return Source("the bundled corpus", (DataFile(_bundled_path("shakespeare.txt.gz"), "bundled"),))
    path = Path(data)
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise FileNotFoundError(f"folder {path} holds no {' or '.join('*' + s for s in TEXT_SUFFIXES)} file")
        return Source(str(path), tuple(DataFile(p, "file") for p in files), text_field)
    if path.is_file():
        return Source(str(path), (DataFile(path, "jsonl" if _is_jsonl(path) else "blocks"),), text_field)
    if _GLOB_CHARS.search(str(data)):
        matches = sorted(Path(p) for p in glob.glob(str(data), recursive=True) if Path(p).is_file())
        if not matches:
            raise FileNotFoundError(f"no file matches {data}")
        return Source(str(data), tuple(DataFile(p, "jsonl" if _is_jsonl(p) else "file") for p in matches),
                      text_field)
    if path.exists():  # a device, a pipe, a socket: nothing a size and a second pass can be had from
        raise ValueError(f"data {path} is not a regular file: give a text file, .gz, folder, glob or .jsonl[.gz]")
    raise FileNotFoundError(f"data file not found: {path}")


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES)


def _bundled_path(name: str) -> Path:
    return Path(str(importlib.resources.files("plainformer").joinpath("corpus", name)))


# ----------------------------------------------------------------------------- reading

def _open_binary(file: DataFile) -> io.BufferedIOBase:
    return gzip.open(file.path, "rb") if file.compressed else open(file.path, "rb")


def _text_lines_or_blocks(file: DataFile, progress: Progress, *, lines: bool) -> Iterator[str]:
    """The decoded text of `file`, line by line or in blocks of BLOCK_CHARS characters."""
    with open(file.path, "rb") as raw:
        binary = gzip.GzipFile(fileobj=raw, mode="rb") if file.compressed else raw
        text = io.TextIOWrapper(binary, encoding="utf-8-sig", newline=None)
        reported = 0
        try:
            for count, chunk in enumerate(text if lines else iter(lambda: text.read(BLOCK_CHARS), "")):
                yield chunk
                if not lines or count % 1024 == 0:
                    progress(raw.tell() - reported)
                    reported = raw.tell()
        except UnicodeDecodeError:
            raise _utf8_error(file) from None
        except (gzip.BadGzipFile, EOFError) as err:
            raise ValueError(f"{file.path} is not a valid gzip file ({err})") from None
        progress(raw.tell() - reported)


def text_lines(path: Path, progress: Progress | None = None) -> Iterator[str]:
    """The lines of a text file, plain or gzipped (`.gz`), decoded as UTF-8 (a leading BOM dropped, line ends
    made "\\n" and kept), read lazily; a byte that is not UTF-8 is a ValueError naming the file and line."""
    return _text_lines_or_blocks(DataFile(Path(path), "file"), progress or (lambda n: None), lines=True)


def _utf8_error(file: DataFile) -> ValueError:
    """The first undecodable byte of `file`, located by line (no UTF-8 sequence spans a newline)."""
    with _open_binary(file) as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return ValueError(f"{file.path} line {number}: byte 0x{line[err.start]:02x} at column "
                                  f"{err.start + 1} is not UTF-8 ({err.reason}); convert the file to UTF-8 "
                                  "first, e.g. with iconv")
    return ValueError(f"{file.path} is not UTF-8 text")


def _raw_blocks(file: DataFile, text_field: str, progress: Progress) -> Iterator[str | None]:
    """Documents of a text file as raw pieces, None after each: they end at two blank lines."""
    held = ""
    for block in _text_lines_or_blocks(file, progress, lines=False):
        text = held + block
        # A break is all whitespace, so none crosses the last non-space character: text up to it is
        # split exactly as the whole file would be; the whitespace after it waits for the next block.
        safe = len(text.rstrip())
        start = 0
        for brk in DOCUMENT_BREAK.finditer(text, 0, safe):
            yield text[start:brk.start()]
            yield None
            start = brk.end()
        yield text[start:safe]
        held = text[safe:]
    yield None


def _raw_file(file: DataFile, text_field: str, progress: Progress) -> Iterator[str | None]:
    yield from _text_lines_or_blocks(file, progress, lines=False)
    yield None


def json_record(line: str, where: str) -> dict[str, Any]:
    """The JSON object of one line of JSON Lines; a ValueError opening with `where` (file and line) otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: the JSON nests too deeply to read") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _raw_jsonl(file: DataFile, text_field: str, progress: Progress) -> Iterator[str | None]:
    for number, line in enumerate(_text_lines_or_blocks(file, progress, lines=True), 1):
        if not line.strip():
            continue
        record = json_record(line, f"{file.path} line {number}")
        if text_field not in record:
            fields = ", ".join(map(repr, list(record)[:8])) or "none"
            raise ValueError(f"{file.path} line {number}: no field {text_field!r} (fields: {fields}); "
                             "name the text field with --text-field")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{file.path} line {number}: field {text_field!r} must be a string, got "
                             f"{type(text).__name__}")
        if "\\u" in line:  # only a \u escape can write a lone surrogate, which no UTF-8 text holds
            _check_no_surrogate(text, f"{file.path} line {number}")
        yield text
        yield None


def _check_no_surrogate(text: str, where: str) -> None:
    surrogate = _SURROGATE.search(text)
    if surrogate is not None:
        raise ValueError(f"{where}: the text holds a lone surrogate \\u{ord(surrogate.group()):04x} at character "
                         f"{surrogate.start()}, which is not a Unicode character; fix or drop that escape")


def _raw_bundled(file: DataFile, text_field: str, progress: Progress) -> Iterator[str | None]:
    """The bundled works, cut by the lengths in works.tsv (4.7 MB: read at once)."""
    text = load_text()
    progress(file.path.stat().st_size)
    for work in bundled_works(text):
        yield text[work.start:work.end]
        yield None


_RAW_READERS: dict[str, Callable[[DataFile, str, Progress], Iterator[str | None]]] = {
    "blocks": _raw_blocks, "file": _raw_file, "jsonl": _raw_jsonl, "bundled": _raw_bundled}


def _documents(raw: Iterable[str | None]) -> Iterator[Piece]:
    """Raw pieces (None ends a document) -> normalised pieces: leading blank lines and trailing
    whitespace dropped, empty documents skipped. Held back: at most the whitespace of one line
    before a document, the whitespace after its latest non-space character."""
    lead, pending, started = "", "", False
    for item in raw:
        if item is None:
            if started:
                yield Piece(pending.rstrip(), True)
            lead, pending, started = "", "", False
        elif not started:
            first = _NON_SPACE.search(item)
            if first is None:
                lead = (lead + item).rpartition("\n")[2]
                continue
            line_start = item.rfind("\n", 0, first.start()) + 1
            pending = item[line_start:] if line_start else lead + item
            started = True
        elif _NON_SPACE.search(item):
            yield Piece(pending, False)
            pending = item
        else:
            pending += item
