"""Tests for plainformer.data.parallel: the forms parallel data comes in, cleaning as clean-corpus-n does, and the
streamed, cached preparation into token arrays."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from plainformer.data.parallel import (
    Dropped,
    Pair,
    clean,
    open_parallel,
    prepare_parallel_data,
    read_pairs,
)
from plainformer.data.tokenizers import SentencePieceTokenizer

PAIRS = [("Ein Hund läuft.", "A dog runs."), ("Zwei Männer spielen Fußball.", "Two men play soccer."),
         ("Eine Frau liest ein Buch.", "A woman reads a book."), ("Kinder lachen.", "Children laugh.")]


def write_aligned(prefix: Path, pairs, compress: bool = False) -> Path:
    for lang, side in (("de", 0), ("en", 1)):
        text = "".join(p[side] + "\n" for p in pairs)
        path = prefix.parent / f"{prefix.name}.{lang}{'.gz' if compress else ''}"
        path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return prefix


@pytest.mark.parametrize("form", ["aligned", "aligned-gz", "tsv", "tsv-header", "tsv-gz", "jsonl"])
def test_every_form_reads_the_same_pairs_in_order(tmp_path, form):
    if form.startswith("aligned"):
        data = write_aligned(tmp_path / "train", PAIRS, compress=form.endswith("gz"))
    elif form.startswith("tsv"):
        rows = (["de\ten"] if form == "tsv-header" else []) + [f"{s}\t{t}" for s, t in PAIRS]
        text = "".join(row + "\n" for row in rows).encode()
        data = tmp_path / ("train.tsv.gz" if form == "tsv-gz" else "train.tsv")
        data.write_bytes(gzip.compress(text) if form == "tsv-gz" else text)
    else:
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps({"translation": {"en": t, "de": s}}) + "\n" for s, t in PAIRS))
    assert read_pairs(data, "de", "en") == ([s for s, _ in PAIRS], [t for _, t in PAIRS])
    if form in ("tsv", "tsv-gz"):
        return  # without a header, the first column is the source
    assert read_pairs(data, "en", "de") == ([t for _, t in PAIRS], [s for s, _ in PAIRS])


def test_files_of_different_lengths_are_refused_naming_both_files_and_counts(tmp_path):
    write_aligned(tmp_path / "train", PAIRS)
    (tmp_path / "train.en").write_text("".join(t + "\n" for _, t in PAIRS[:3]))
    with pytest.raises(ValueError, match=r"train\.de has 4 lines but .*train\.en has 3"):
        list(open_parallel(tmp_path / "train", "de", "en").pairs())
    (tmp_path / "train.en").write_text("".join(t + "\n" for _, t in PAIRS * 2))
    with pytest.raises(ValueError, match=r"train\.de has 4 lines but .*train\.en has 8"):
        list(open_parallel(tmp_path / "train", "de", "en").pairs())


@pytest.mark.parametrize("content, match", [
    ("a\tb\tc\n", r"train\.tsv:1: expected 2 tab-separated columns"),
    ('{"translation": {"de": "x"}}\n', r"train\.jsonl:1: translation\.en must be a string, got nothing"),
    ('{"text": "x"}\n', r"train\.jsonl:1: expected an object \{\"translation\""),
    ('["x"]\n', r"train\.jsonl:1: expected a JSON object, got list"),
    ('{"translation": \n', r"train\.jsonl:1: invalid JSON"),
    ("[" * 100_000 + "]" * 100_000 + "\n", r"train\.jsonl:1: the JSON nests too deeply"),
])
def test_a_bad_row_is_one_error_naming_the_file_and_line(tmp_path, content, match):
    data = tmp_path / ("train.tsv" if "\t" in content else "train.jsonl")
    data.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_pairs(data, "de", "en")


def test_missing_files_and_bad_languages_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no .*train\.de or .*train\.de\.gz"):
        open_parallel(tmp_path / "train", "de", "en")
    with pytest.raises(ValueError, match="source_lang and target_lang must differ"):
        open_parallel(tmp_path / "train", "de", "de")
    with pytest.raises(ValueError, match="target_lang must be a language code"):
        open_parallel(tmp_path / "train", "de", "e/n")


def test_clean_drops_and_counts_as_clean_corpus_n():
    long = " ".join(["word"] * 251)
    pairs = [Pair("kept", "kept too", "1"), Pair("", "empty source", "2"), Pair("empty target", "", "3"),
             Pair(long, long, "4"), Pair("one", " ".join(["many"] * 10), "5"), Pair("one", " ".join(["w"] * 9), "6")]
    dropped = Dropped()
    assert [p.where for p in clean(pairs, dropped)] == ["1", "6"]  # a ratio of 9 is kept, of 10 dropped
    assert (dropped.empty, dropped.too_long, dropped.ratio, dropped.total) == (2, 1, 1, 4)
    assert dropped.line(2) == "2 pairs kept, 4 dropped (2 with an empty side, 1 too long, 1 past the length ratio)"


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["Hund", "Katze", "Mann", "Frau", "läuft", "spielt", "im", "Park", "mit", "einem", "Ball"]
    pairs = [(" ".join(rng.choice(words, 5)) + ".", " ".join(rng.choice(words, 4)).upper() + ".") for _ in range(300)]
    train = write_aligned(tmp_path / "train", pairs + [("", "empty")])
    return train, write_aligned(tmp_path / "val", pairs[:20]), pairs


def test_the_prepared_ids_are_the_tokenizers_and_validation_is_kept_as_text(tmp_path, corpus):
    train, val, pairs = corpus
    data = prepare_parallel_data(train, val, source_lang="de", target_lang="en", vocab_size=60, cache_dir=tmp_path)
    tok = data.tokenizer
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 60
    assert len(data.train) == 300 and data.stats["train"] == "300 pairs kept, 1 dropped (1 with an empty side)"
    for i in (0, 7, 299):
        assert data.train.source(i).tolist() == tok.encode(pairs[i][0])
        assert data.train.target(i).tolist() == tok.encode(pairs[i][1])
    assert (data.val_sources, data.val_references) == ([s for s, _ in pairs[:20]], [t for _, t in pairs[:20]])


def test_a_second_preparation_reads_the_cache_and_a_given_tokenizer_is_used(tmp_path, corpus, monkeypatch):
    train, val, _ = corpus
    first = prepare_parallel_data(train, val, source_lang="de", target_lang="en", vocab_size=60, cache_dir=tmp_path)
    monkeypatch.setattr(SentencePieceTokenizer, "train", lambda *a, **k: pytest.fail("trained again"))
    again = prepare_parallel_data(train, val, source_lang="de", target_lang="en", vocab_size=60, cache_dir=tmp_path)
    assert again.directory == first.directory and again.tokenizer.fingerprint == first.tokenizer.fingerprint
    given = prepare_parallel_data(train, val, source_lang="de", target_lang="en", tokenizer=first.tokenizer,
                                  cache_dir=tmp_path)
    assert given.train.source(3).tolist() == first.train.source(3).tolist()


def test_a_refused_preparation_leaves_nothing_in_the_cache(tmp_path, corpus):
    train, val, _ = corpus
    (val.parent / "val.en").write_text("one line\n")
    with pytest.raises(ValueError, match="val.de has 20 lines but .*val.en has 1"):
        prepare_parallel_data(train, val, source_lang="de", target_lang="en", vocab_size=60, cache_dir=tmp_path / "c")
    assert [p for p in (tmp_path / "c").rglob("*") if p.is_file()] == []


def test_preparing_streams_its_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak Python allocations preparing 4x the pairs stay within 20% (the arrays are written as they go)."""
    val = write_aligned(tmp_path / "val", PAIRS)

    def peak(n: int) -> int:
        lines = ([f"Satz {i} mit einigen Wörtern darin." for i in range(n)],
                 [f"Sentence {i} with a few words." for i in range(n)])
        prefix = tmp_path / f"c{n}"
        for lang, side in (("de", 0), ("en", 1)):
            (tmp_path / f"c{n}.{lang}").write_text("\n".join(lines[side]) + "\n")
        tokenizer = SentencePieceTokenizer.train(lines[0][:500] + lines[1][:500], 80)
        tracemalloc.start()
        prepare_parallel_data(prefix, val, source_lang="de", target_lang="en", tokenizer=tokenizer,
                              cache_dir=tmp_path / "cache")
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(20_000), peak(80_000)
    assert large < 1.2 * small, (small, large)
