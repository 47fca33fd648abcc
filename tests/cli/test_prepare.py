import json
from pathlib import Path

import numpy as np
import pytest

from plainformer.cli import main
from plainformer.data import prepared
from plainformer.data.prepared import prepare_lm_data


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def test_prepare_prints_one_json_line_of_statistics_and_fills_the_cache(capsys, tmp_path):
    docs = [f"document {i}\n" + "a line of text\n" * (5 + i) for i in range(12)]
    data = write_jsonl(tmp_path / "c.jsonl", docs)
    code = main(["prepare", "--data", str(data), "--text-field", "body", "--cache-dir", str(tmp_path / "cache"),
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0
    (line,) = captured.out.splitlines()
    stats = json.loads(line)
    assert stats["tokenizer"] == "char" and stats["train"]["documents"] + stats["val"]["documents"] == 12
    assert 0.1 <= stats["val_share"] <= 0.2
    assert "train: " in captured.err and "val: " in captured.err
    # The cache entry it names is what training reads.
    prepared = prepare_lm_data(data, text_field="body", cache_dir=tmp_path / "cache")
    assert str(prepared.directory) == stats["cache"]
    assert len(prepared.val_tokens) == stats["val"]["tokens"]


def test_prepare_reports_bad_data_in_one_line(capsys, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", ["one", "two"])
    code = main(["prepare", "--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"plainformer: error: {data} line 1: no field 'text' (fields: 'body'); "
                   "name the text field with --text-field"]


@pytest.mark.parametrize("verb", ["prepare", "train"])
def test_a_record_nested_100000_deep_or_a_device_is_one_line_naming_it(verb, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    extra = ["--out", str(tmp_path / "run")] if verb == "train" else ["--cache-dir", str(tmp_path / "cache")]
    for data, message in ((deep, f"{deep} line 1: the JSON nests too deeply to read"),
                          (Path("/dev/zero"), "data /dev/zero is not a regular file")):
        code = main([verb, "--data", str(data), "--no-progress", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"plainformer: error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_prepare_with_val_data_holds_out_that_data(capsys, tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("to be or not to be\nthat is the question\n")
    val = tmp_path / "val"
    val.mkdir()
    (val / "a.md").write_text("whether tis nobler\n")
    code = main(["prepare", "--data", str(train), "--val-data", str(val), "--tokenizer", "bpe",
                 "--bpe-vocab-size", "270", "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    stats = json.loads(capsys.readouterr().out)
    assert code == 0 and stats["tokenizer"] == "bpe"
    assert (stats["train"]["documents"], stats["val"]["documents"]) == (1, 1)
    assert stats["val"]["characters"] == len("whether tis nobler")
    assert np.fromfile(Path(stats["cache"]) / "val.bin", dtype=np.uint16).size == stats["val"]["tokens"]


def test_a_file_edited_while_it_is_read_is_refused_in_one_line_and_leaves_no_array(capsys, tmp_path, monkeypatch):
    data = tmp_path / "c.txt"
    text = "\n\n\n".join(f"document {i}\n" + "a line of text\n" * 20 for i in range(12))
    data.write_text(text)
    size = data.stat().st_size
    real_write = prepared.write_tokens

    def edit_then_write(path, tokens, dtype):  # the file shrinks as the encoding pass starts reading it
        if path.name == "train.bin":
            data.write_text(text[:len(text) // 2])
        return real_write(path, tokens, dtype)

    monkeypatch.setattr(prepared, "write_tokens", edit_then_write)
    argv = ["prepare", "--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"plainformer: error: {data} changed while it was being read ({size:,} bytes then, "
        f"{data.stat().st_size:,} now); run again once nothing writes to it"]
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    monkeypatch.undo()
    assert main(argv) == 0  # the file as it now is
    stats = json.loads(capsys.readouterr().out)
    assert stats["train"]["documents"] + stats["val"]["documents"] == 6
