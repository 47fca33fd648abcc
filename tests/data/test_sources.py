import gzip
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plainformer.data import sources
from plainformer.data.corpus import find_works
from plainformer.data.sources import open_source

# Documents as they come out: no blank line before, no whitespace after; inside they may hold a
# single blank line, indentation, trailing spaces on inner lines and non-ASCII text.
DOCUMENTS = [
    "THE FIRST\n\nIt was a dark night, said  the clown.\n  Indented: été, naïve, 日本語 🤖",
    "  second, indented first line   \nand a line after",
    "third\n\nfourth line of the third \n\n end",
]


def documents(source, **kwargs) -> list[str]:
    """The documents of a source, each joined from its pieces."""
    docs, current = [], []
    for piece in source.pieces(**kwargs):
        assert piece.text or piece.last
        current.append(piece.text)
        if piece.last:
            docs.append("".join(current))
            current = []
    assert not current
    return docs


def write_forms(root: Path, docs: list[str]) -> dict[str, str]:
    """The same documents in every form `--data` accepts; returns form -> the argument naming it."""
    root.mkdir(parents=True, exist_ok=True)
    one_file = "\n\n\n".join(docs) + "\n"
    (root / "corpus.txt").write_text(one_file, encoding="utf-8")
    (root / "corpus.txt.gz").write_bytes(gzip.compress(one_file.encode("utf-8")))
    folder = root / "folder"
    for i, doc in enumerate(docs):
        # Nested folders and .md files; sorted by relative path: a/000.md, a/001.txt, b/002.md, ...
        path = folder / ("a" if i < 2 else "b") / f"{i:03d}.{'md' if i % 2 == 0 else 'txt'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n" + doc + "\n\n", encoding="utf-8")  # blank lines around do not count
    (folder / "a" / "ignored.json").write_text("{}")
    lines = "".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(docs))
    (root / "corpus.jsonl").write_text(lines + "\n", encoding="utf-8")
    (root / "corpus.jsonl.gz").write_bytes(gzip.compress(lines.encode("utf-8")))
    (root / "body.jsonl").write_text("".join(json.dumps({"body": doc}) + "\n" for doc in docs))
    return {"file": str(root / "corpus.txt"), "gz": str(root / "corpus.txt.gz"), "folder": str(folder),
            "glob": str(folder / "**" / "[0-9]*.*"), "jsonl": str(root / "corpus.jsonl"),
            "jsonl.gz": str(root / "corpus.jsonl.gz")}


@pytest.mark.parametrize("form", ["file", "gz", "folder", "glob", "jsonl", "jsonl.gz"])
def test_every_form_of_input_gives_the_same_documents(tmp_path, form):
    assert documents(open_source(write_forms(tmp_path, DOCUMENTS)[form])) == DOCUMENTS


def test_glob_reads_json_lines_by_record_and_text_files_whole(tmp_path):
    write_forms(tmp_path, DOCUMENTS)
    assert documents(open_source(tmp_path / "corpus.jsonl*")) == DOCUMENTS * 2  # .jsonl, .jsonl.gz
    assert documents(open_source(tmp_path / "*.txt")) == ["\n\n\n".join(DOCUMENTS)]


def test_text_field_is_configurable(tmp_path):
    write_forms(tmp_path, DOCUMENTS)
    assert documents(open_source(tmp_path / "body.jsonl", text_field="body")) == DOCUMENTS


def test_line_endings_and_byte_order_mark_are_normalised(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes("\ufeffone\r\ntwo\r\n\r\n\r\nthree\r\n".encode("utf-8"))
    assert documents(open_source(path)) == ["one\ntwo", "three"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["word", "  x", "é 🤖", "", " ", "\t", "a b"]), max_size=40),
       st.integers(1, 9))
def test_streamed_documents_equal_the_blocks_of_the_whole_text(lines, block_chars):
    """Reading in blocks of a few characters finds the documents `find_works` finds in the whole text."""
    text = "\n".join(lines)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.txt"
        path.write_text(text, encoding="utf-8")
        original = sources.BLOCK_CHARS
        sources.BLOCK_CHARS = block_chars
        try:
            streamed = documents(open_source(path))
        finally:
            sources.BLOCK_CHARS = original
    assert streamed == [text[w.start:w.end] for w in find_works(text)]


def test_progress_counts_every_byte_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BLOCK_CHARS", 16)
    forms = write_forms(tmp_path, DOCUMENTS)
    for form in ("file", "gz", "folder", "jsonl.gz"):
        source, seen = open_source(forms[form]), []
        documents(source, progress=seen.append)
        assert sum(seen) == source.total_bytes


def test_a_json_line_without_the_field_names_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"title": "b", "body": "c"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl line 3: no field 'text' \(fields: 'title', 'body'\)"):
        documents(open_source(path))


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": "b",}\n'))
    with pytest.raises(ValueError, match=r"c\.jsonl\.gz line 2: invalid JSON \(.* at column 14\)"):
        documents(open_source(path))
    path.write_bytes(gzip.compress(b'["a list"]\n'))
    with pytest.raises(ValueError, match="line 1: expected a JSON object, got list"):
        documents(open_source(path))
    path.write_bytes(gzip.compress(b'{"text": 3}\n'))
    with pytest.raises(ValueError, match="line 1: field 'text' must be a string, got int"):
        documents(open_source(path))


def test_a_record_nested_too_deeply_to_read_names_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"^.*c\.jsonl line 2: the JSON nests too deeply to read$"):
        documents(open_source(path))


def test_a_non_utf8_file_in_a_folder_names_file_and_line(tmp_path):
    (tmp_path / "a.txt").write_text("fine\n")
    (tmp_path / "b.txt").write_bytes("first line\nsecond\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"b\.txt line 3: byte 0xe9 at column 4 is not UTF-8"):
        documents(open_source(tmp_path))


def test_missing_or_empty_inputs_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        open_source(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="no file matches"):
        open_source(tmp_path / "*.txt")
    with pytest.raises(FileNotFoundError, match=r"holds no \*\.txt or \*\.md file"):
        open_source(tmp_path)
    (tmp_path / "bad.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="is not a valid gzip file"):
        documents(open_source(tmp_path / "bad.txt.gz"))
    with pytest.raises(ValueError, match="text_field must be a non-empty string"):
        open_source(tmp_path, text_field="")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_device_or_a_pipe_is_named_as_no_regular_file_not_as_missing(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    for path in (Path("/dev/zero"), tmp_path / "pipe"):
        if path.exists():
            with pytest.raises(ValueError, match=rf"^data {path} is not a regular file: give a text file"):
                open_source(path)


def test_fingerprint_follows_size_mtime_and_the_set_of_files(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    before = open_source(tmp_path).fingerprint
    assert open_source(tmp_path).fingerprint == before
    stat = (tmp_path / "a.txt").stat()
    (tmp_path / "a.txt").write_text("two")  # same size
    os.utime(tmp_path / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = open_source(tmp_path).fingerprint
    assert touched != before
    (tmp_path / "b.md").write_text("three")
    assert open_source(tmp_path).fingerprint != touched
    assert open_source(tmp_path / "a.txt", text_field="body").fingerprint != open_source(tmp_path / "a.txt").fingerprint


def test_the_bundled_corpus_is_its_38_works():
    docs = documents(open_source())
    assert len(docs) == 38
    assert docs[0].startswith("ALL'S WELL THAT ENDS WELL") and docs[-1].endswith("[Exeunt.]")


def test_a_lone_surrogate_escape_in_json_lines_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine \\u00e9 and \\ud83d\\ude00"}\n{"text": "abc \\ud800 def"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"c.jsonl line 2: the text holds a lone surrogate \\ud800 at character 4"):
        list(sources.open_source(path).pieces())
