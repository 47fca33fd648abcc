"""Labelled data files: TSV, CSV and JSON Lines read alike, the fields chosen or defaulted, class names in a
stable order, a stratified validation split, and each bad row refused in one line naming file, line and field."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from plainformer.data.labelled import (
    Fields,
    class_names,
    read_classification_data,
    read_labelled,
    stratified_split,
)

ROWS = [("a fine film", "pos"), ("dull , dull , dull", "neg"), ('he said "wow"', "pos"), ("meh", "neutral")]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _tsv(path: Path, rows=ROWS, header="sentence\tlabel") -> Path:
    return _write(path, header + "\n" + "".join(f"{text}\t{label}\n" for text, label in rows))


def _jsonl(path: Path, records) -> Path:
    return _write(path, "".join(json.dumps(record) + "\n" for record in records))


def test_tsv_csv_and_json_lines_read_the_same_rows(tmp_path):
    tsv = read_labelled(_tsv(tmp_path / "d.tsv"))
    csv_path = _write(tmp_path / "d.csv", 'text,label\n"a fine film",pos\n"dull , dull , dull",neg\n'
                                          '"he said ""wow""",pos\nmeh,neutral\n')
    jsonl = read_labelled(_jsonl(tmp_path / "d.jsonl", [{"text": t, "label": lab, "id": i}
                                                         for i, (t, lab) in enumerate(ROWS)]))
    for rows in (tsv, read_labelled(csv_path), jsonl):
        assert rows.texts == [text for text, _ in ROWS] and rows.labels == [label for _, label in ROWS]
        assert rows.pairs is None
    assert tsv.lines == [2, 3, 4, 5] and jsonl.lines == [1, 2, 3, 4]


def test_gzip_fields_pairs_and_blank_lines(tmp_path):
    path = tmp_path / "pairs.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("id\tq1\tq2\tis_same\n1\tHow old?\tWhat age?\t1\n\n2\tWhere?\tWhen?\t0\n")
    rows = read_labelled(path, Fields(text="q1", pair="q2", label="is_same"))
    assert rows.texts == ["How old?", "Where?"] and rows.pairs == ["What age?", "When?"]
    assert rows.labels == ["1", "0"] and rows.lines == [2, 4] and rows.blank_lines == 1


def test_sentence_is_preferred_to_text_and_json_labels_may_be_integers(tmp_path):
    rows = read_labelled(_jsonl(tmp_path / "d.jsonl", [{"text": "x", "sentence": "s1", "label": 1},
                                                       {"text": "y", "sentence": "s2", "label": 0}]))
    assert rows.texts == ["s1", "s2"] and rows.labels == ["1", "0"]


def test_integer_labels_sort_by_value_and_names_as_text():
    assert class_names(["10", "2", "2", "-1"]) == ("-1", "2", "10")
    assert class_names(["pos", "neg", "neutral", "2"]) == ("2", "neg", "neutral", "pos")


def test_the_stratified_split_keeps_each_class_share_and_does_not_depend_on_row_order(tmp_path):
    rows = [(f"text {i}", "a" if i % 4 else "b") for i in range(200)]  # 150 a, 50 b
    train, val = stratified_split(read_labelled(_tsv(tmp_path / "d.tsv", rows)))
    labels = read_labelled(tmp_path / "d.tsv").labels
    assert Counter(labels[r] for r in val) == {"a": 15, "b": 5}
    assert sorted(train + val) == list(range(200))
    shuffled = read_labelled(_tsv(tmp_path / "r.tsv", rows[::-1]))
    _, val_reversed = stratified_split(shuffled)
    assert {shuffled.texts[r] for r in val_reversed} == {rows[r][0] for r in val}


def test_a_class_of_one_row_stays_in_training(tmp_path):
    rows = read_labelled(_tsv(tmp_path / "d.tsv", [("x", "a"), ("y", "a"), ("z", "b")]))
    train, val = stratified_split(rows)
    assert [rows.labels[r] for r in val] == ["a"] and len(train) == 2


def test_classification_data_names_its_classes_and_maps_validation_labels(tmp_path):
    train = _tsv(tmp_path / "train.tsv", [(f"t{i}", ["neg", "pos"][i % 2]) for i in range(6)])
    val = _tsv(tmp_path / "val.tsv", [("v", "pos"), ("w", "neg"), ("u", "pos")])
    data = read_classification_data(train, val)
    assert data.classes == ("neg", "pos") and data.val.labels == (1, 0, 1) and len(data.train) == 6
    assert data.blank_lines == 0
    val.write_text(val.read_text() + "\n\n")
    assert read_classification_data(train, val).blank_lines == 2
    split = read_classification_data(train)
    assert len(split.train) + len(split.val) == 6 and set(split.val.labels) == {0, 1}


def test_unnamed_classes_take_integer_labels_by_index(tmp_path):
    rows = read_labelled(_tsv(tmp_path / "d.tsv", [("x", "1"), ("y", "0")]))
    assert rows.examples(("LABEL_0", "LABEL_1")).labels == (1, 0)
    with pytest.raises(ValueError, match=r"d\.tsv:2: label '1' is not among the model's classes \(neg, pos\)"):
        rows.examples(("neg", "pos"))


@pytest.mark.parametrize("name, text, fields, message", [
    ("train.tsv", "sentence\tlabel\ngood\t1\nbad\t\n", Fields(), r"train\.tsv:3: no label \(field 'label' is empty\)"),
    ("train.tsv", "sentence\tlabel\n \t1\n", Fields(), r"train\.tsv:2: no text \(field 'sentence' is empty\)"),
    ("train.tsv", "sentence\tlabel\ngood\t1\nbad\t0\textra\n", Fields(),
     r"train\.tsv:3: 3 fields, the header has 2 \(sentence, label\)"),
    ("train.csv", "text,label\n\"unclosed,1\n", Fields(), r"train\.csv:\d+: "),
    ("train.csv", "text,label\ngood,1\nbad\n", Fields(), r"train\.csv:3: 1 fields, the header has 2"),
    ("train.tsv", "review\tstars\nok\t1\n", Fields(),
     r"train\.tsv:1: the header has no field 'sentence' or 'text' \(review, stars\); name the text field"),
    ("train.tsv", "sentence\tstars\nok\t1\n", Fields(),
     r"train\.tsv:1: the header has no field 'label', the label \(sentence, stars\)"),
    ("train.tsv", "a\tb\nok\t1\n", Fields(text="a", label="b", pair="c"), r"train\.tsv:1: .*no field 'c', the second"),
    ("train.jsonl", '{"text": "ok", "label": 1}\n{"text": "no label"}\n', Fields(),
     r"train\.jsonl:2: no label \(field 'label'\)"),
    ("train.jsonl", '{"text": "ok", "label": 1.5}\n', Fields(),
     r"train\.jsonl:1: field 'label' must be a string or an integer, got 1\.5"),
    ("train.jsonl", '{"text": ["x"], "label": 1}\n', Fields(), r"train\.jsonl:1: field 'text' must be a string"),
    ("train.jsonl", '{"text": "ok", "label": 1}\n[1, 2]\n', Fields(), r"train\.jsonl:2: expected a JSON object"),
    ("train.jsonl", '{"text": "ok", "label": 1}\n{"text": \n', Fields(), r"train\.jsonl:2: invalid JSON"),
    ("train.tsv", "", Fields(), r"train\.tsv is empty: a header line"),
    ("train.tsv", "sentence\tlabel\n", Fields(), r"train\.tsv holds no labelled rows"),
    ("train.txt", "x", Fields(), r"train\.txt: labelled data is a \.tsv, \.csv or \.jsonl file"),
])
def test_bad_files_are_refused_naming_file_line_and_field(tmp_path, name, text, fields, message):
    with pytest.raises(ValueError, match=message):
        read_labelled(_write(tmp_path / name, text), fields)


def test_a_validation_label_training_never_had_is_refused_naming_its_line(tmp_path):
    train = _tsv(tmp_path / "train.tsv", [("x", "neg"), ("y", "pos")])
    val = _tsv(tmp_path / "val.tsv", [("v", "pos"), ("w", "neutral")])
    with pytest.raises(ValueError, match=r"val\.tsv:3: label 'neutral' is not among the labels of the training "
                                         r"data .*train\.tsv \(neg, pos\)"):
        read_classification_data(train, val)


def test_a_single_class_is_refused_naming_the_file_and_the_field(tmp_path):
    train = _tsv(tmp_path / "train.tsv", [("x", "pos"), ("y", "pos")], header="sentence\tlabel")
    with pytest.raises(ValueError, match=r"train\.tsv: field 'label' holds one class, 'pos', in all 2 training rows"):
        read_classification_data(train, train)


def test_text_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_bytes(b"sentence\tlabel\ncaf\xe9\t1\n")
    with pytest.raises(ValueError, match=r"train\.tsv is not UTF-8 text"):
        read_labelled(path)
