"""Labelled data in the forms people hold it, read as `classification.ClassificationData` for a classifier:
TSV or CSV with a header line, or JSON Lines (one object a line, the `datasets` shape); each may be gzipped.

    text field:   `text_field`, else "sentence" (GLUE's name) when the header or first record has one, else "text"
    pair field:   `pair_field`, the second sentence of a pair task (MRPC, RTE, NLI); none by default
    label field:  `label_field`, else "label"

A label is an integer or a name (in JSON Lines a string or an integer). The classes are the distinct labels
of the training data in a stable order, numeric when every one is an integer (GLUE's 0 and 1), else sorted
as text; label i names classes[i], which the model keeps as its id2label. The validation data is given
(`val_data`), or else a stratified split of the training file: VAL_FRACTION of each class (at least one row
of a class that has two), the rows taken in the order of a hash of their text, so that the split does not
depend on the order of the file.

What cannot be read is refused with one ValueError naming the file, the line and the field: a row without
a text or a label, a row with fewer or more fields than the header, a line that is no JSON object, a
validation label the training data never had, training data of a single class. Blank lines are skipped and
counted. Files are streamed: only the fields used are kept.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from .classification import ClassificationData, Examples
from .sources import json_record

VAL_FRACTION = 0.1
TEXT_FIELDS = ("sentence", "text")
LABEL_FIELD = "label"
FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl"}
_INTEGER = re.compile(r"[+-]?\d+")


@dataclasses.dataclass(frozen=True)
class Fields:
    """The names of the text, pair and label fields; None: the defaults the module docstring gives."""

    text: str | None = None
    pair: str | None = None
    label: str | None = None


@dataclasses.dataclass
class LabelledRows:
    """The rows of one labelled file: texts, pairs (None without a pair field), labels as written, and the
    line each row ends on, for messages."""

    path: Path
    texts: list[str]
    pairs: list[str] | None
    labels: list[str]
    lines: list[int]
    blank_lines: int = 0

    def __len__(self) -> int:
        return len(self.texts)

    def examples(self, classes: Sequence[str], rows: Sequence[int] | None = None, *,
                 known: str = "the model's classes") -> Examples:
        """`rows` (default all) as Examples of `classes`; a label that is none of them is refused naming its
        line (and `known`, what the classes are). An integer label i also names class i where the classes are
        the unnamed LABEL_0, LABEL_1, ... (a Hugging Face classifier saved without id2label)."""
        rows = range(len(self)) if rows is None else rows
        ids = {name: i for i, name in enumerate(classes)}
        unnamed = all(name == f"LABEL_{i}" for i, name in enumerate(classes))
        labels = []
        for row in rows:
            label = self.labels[row]
            if label not in ids and unnamed and _INTEGER.fullmatch(label) and 0 <= int(label) < len(classes):
                label = classes[int(label)]
            if label not in ids:
                raise ValueError(f"{self.path}:{self.lines[row]}: label {label!r} is not among {known} "
                                 f"({_few(classes)})")
            labels.append(ids[label])
        return Examples(tuple(self.texts[r] for r in rows), tuple(labels),
                        None if self.pairs is None else tuple(self.pairs[r] for r in rows))


def read_labelled(path: str | os.PathLike, fields: Fields = Fields()) -> LabelledRows:
    """Every row of a labelled .tsv, .csv or .jsonl file (optionally .gz), checked as the module says."""
    path = Path(path)
    form = file_format(path)
    try:
        with _open(path) as stream:
            rows = _read_json_lines(path, stream, fields) if form == "jsonl" else \
                _read_delimited(path, stream, fields, form)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte offset {error.start})") from None
    except (EOFError, gzip.BadGzipFile) as error:
        raise ValueError(f"{path}: not a readable gzip file ({error})") from None
    if not rows.texts:
        raise ValueError(f"{path} holds no labelled rows")
    return rows


def file_format(path: Path) -> str:
    """"tsv", "csv" or "jsonl", from the name (a .gz after it is allowed)."""
    suffix = Path(path.name.removesuffix(".gz")).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: labelled data is a .tsv, .csv or .jsonl file (optionally .gz), "
                         f"not {suffix or 'a file without a suffix'}")
    return FORMATS[suffix]


def _open(path: Path) -> TextIO:
    if not path.is_file():
        raise FileNotFoundError(f"no labelled data file at {path}")
    raw = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")
    # "" newline: the csv module sees a quoted field's own line breaks; utf-8-sig: a leading BOM dropped.
    return io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")


def _read_delimited(path: Path, stream: TextIO, fields: Fields, form: str) -> LabelledRows:
    # GLUE's TSV files are read as they are written: tabs between fields and no quoting (a sentence may
    # hold a quote); CSV is RFC 4180 quoting, strictly.
    reader = csv.reader(stream, delimiter="\t", quoting=csv.QUOTE_NONE) if form == "tsv" else \
        csv.reader(stream, strict=True)
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        raise ValueError(f"{path} is empty: a header line naming the fields comes first") from None
    except csv.Error as error:
        raise ValueError(f"{path}:1: {error}") from None
    names = _field_names(path, fields, header, "the header")
    columns = {role: header.index(name) for role, name in names.items()}
    rows = LabelledRows(path, [], [] if "pair" in names else None, [], [])
    try:
        for row in reader:
            if not row or row == [""]:
                rows.blank_lines += 1
                continue
            if len(row) != len(header):
                raise ValueError(f"{path}:{reader.line_num}: {len(row)} fields, the header has {len(header)} "
                                 f"({', '.join(header)})")
            _add(rows, reader.line_num, names, {role: row[column] for role, column in columns.items()})
    except csv.Error as error:
        raise ValueError(f"{path}:{reader.line_num}: {error}") from None
    return rows


def _read_json_lines(path: Path, stream: TextIO, fields: Fields) -> LabelledRows:
    names: dict[str, str] | None = None
    rows: LabelledRows | None = None
    blank = 0
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            blank += 1
            continue
        record = json_record(line, f"{path}:{number}")
        if names is None:  # the first record decides the default text field
            names = _field_names(path, fields, list(record), f"line {number}'s record", line=number)
            rows = LabelledRows(path, [], [] if "pair" in names else None, [], [])
        assert rows is not None
        values = {}
        for role, name in names.items():
            if name not in record or record[name] is None:
                raise ValueError(f"{path}:{number}: no {_role(role)} (field {name!r})")
            values[role] = _json_value(path, number, role, name, record[name])
        _add(rows, number, names, values)
    if rows is None:
        raise ValueError(f"{path} holds no labelled rows")
    rows.blank_lines = blank
    return rows


def _json_value(path: Path, number: int, role: str, name: str, value: Any) -> str:
    """A field of a JSON record as text: a label may be a string or an integer, a text only a string."""
    if isinstance(value, str):
        return value
    if role == "label" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    expected = "a string or an integer" if role == "label" else "a string"
    raise ValueError(f"{path}:{number}: field {name!r} must be {expected}, got {json.dumps(value)[:40]}")


def _field_names(path: Path, fields: Fields, present: list[str], where: str, line: int = 1) -> dict[str, str]:
    """role ("text", "pair", "label") -> field name, each checked to be `present`."""
    text = fields.text or next((name for name in TEXT_FIELDS if name in present), None)
    if text is None:
        raise ValueError(f"{path}:{line}: {where} has no field 'sentence' or 'text' ({_few(present)}); "
                         "name the text field with --text-field")
    names = {"text": text, "label": fields.label or LABEL_FIELD}
    if fields.pair is not None:
        names["pair"] = fields.pair
    for role, name in names.items():
        if name not in present:
            raise ValueError(f"{path}:{line}: {where} has no field {name!r}, the {_role(role)} ({_few(present)})")
    return names


def _add(rows: LabelledRows, line: int, names: dict[str, str], values: dict[str, str]) -> None:
    for role in ("text", "pair", "label"):
        if role in values and not values[role].strip():
            raise ValueError(f"{rows.path}:{line}: no {_role(role)} (field {names[role]!r} is empty)")
    rows.texts.append(values["text"])
    if rows.pairs is not None:
        rows.pairs.append(values["pair"])
    rows.labels.append(values["label"].strip())
    rows.lines.append(line)


def _role(role: str) -> str:
    return {"text": "text", "pair": "second text", "label": "label"}[role]


def _few(names: Sequence[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


# ----------------------------------------------------------------------------- classes and splits

def class_names(labels: Sequence[str]) -> tuple[str, ...]:
    """The distinct labels in their stable order: by value when all are integers, else as text."""
    distinct = set(labels)
    if all(_INTEGER.fullmatch(label) for label in distinct):
        return tuple(sorted(distinct, key=lambda label: (int(label), label)))
    return tuple(sorted(distinct))


def stratified_split(rows: LabelledRows, fraction: float = VAL_FRACTION) -> tuple[list[int], list[int]]:
    """(training rows, validation rows): of each class's n rows, round(fraction · n) (at least 1 when n >= 2,
    at most n - 1) go to validation, the first in the order of the sha256 of their text (and pair)."""
    by_class: dict[str, list[int]] = {}
    for row, label in enumerate(rows.labels):
        by_class.setdefault(label, []).append(row)
    val: list[int] = []
    for members in by_class.values():
        if len(members) >= 2:
            take = min(len(members) - 1, max(1, round(fraction * len(members))))
            val += sorted(members, key=lambda row: _digest(rows, row))[:take]
    chosen = set(val)
    return [row for row in range(len(rows)) if row not in chosen], sorted(val)


def _digest(rows: LabelledRows, row: int) -> bytes:
    text = rows.texts[row] if rows.pairs is None else f"{rows.texts[row]}\t{rows.pairs[row]}"
    return hashlib.sha256(text.encode("utf-8")).digest()


def read_classification_data(data: str | os.PathLike, val_data: str | os.PathLike | None = None,
                             fields: Fields = Fields(), val_fraction: float = VAL_FRACTION) -> ClassificationData:
    """The training data of `data` and the validation data of `val_data`, else a stratified split of `data`;
    the classes are those of the training labels (refused when there is only one)."""
    rows = read_labelled(data, fields)
    train_rows, val_rows = stratified_split(rows, val_fraction) if val_data is None else (list(range(len(rows))), [])
    classes = class_names([rows.labels[row] for row in train_rows])
    if len(classes) < 2:
        label = fields.label or LABEL_FIELD
        raise ValueError(f"{rows.path}: field {label!r} holds one class, {classes[0]!r}, in all {len(train_rows)} "
                         "training rows: a classifier needs two or more")
    if val_data is None:
        if not val_rows:
            raise ValueError(f"{rows.path}: {len(rows)} rows are too few to split off validation rows; "
                             "give --val-data")
        return ClassificationData(classes, rows.examples(classes, train_rows), rows.examples(classes, val_rows),
                                  rows.blank_lines)
    held_out = read_labelled(val_data, fields)
    if (held_out.pairs is None) != (rows.pairs is None):
        raise ValueError(f"{held_out.path} and {rows.path} must both have the pair field, or neither")
    return ClassificationData(classes, rows.examples(classes),
                              held_out.examples(classes, known=f"the labels of the training data {rows.path}"),
                              rows.blank_lines + held_out.blank_lines)
