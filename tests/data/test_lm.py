import gzip
import hashlib
import importlib.resources
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plainformer.data import lm as data
from plainformer.data import prepared
from plainformer.data.corpus import find_works, load_split, load_text, split_text
from plainformer.data.lm import LMBatchSource, build_tokenizer, token_array
from plainformer.data.prepared import prepare_lm_data
from plainformer.data.tokenizers import BPETokenizer, CharTokenizer

# From shared/data/README.md, the corpus' own documentation.
BUNDLED_SHA256 = "8be6e3cff1865c21aabad2463b27e49772e821b13eb8a3b57ca21630ed81285e"


def make_works(n: int) -> str:
    """n works separated by 2-4 blank lines; each holds a single blank line and an indented line."""
    works = [f"WORK {i}\n\nLine one of {i}, said  the clown.\nLine two:\n  three,\nfour: {i}!" for i in range(n)]
    return "".join(w + "\n" * (3 + i % 3) for i, w in enumerate(works))


@pytest.fixture(scope="module")
def bundled():
    return load_split()


def test_bundled_corpus_is_the_documented_text(bundled):
    assert hashlib.sha256(bundled.text.encode("utf-8")).hexdigest() == BUNDLED_SHA256
    assert len(bundled.text) == 4_732_575 and len(set(bundled.text)) == 84


def test_bundled_validation_works_are_the_last_works_in_works_tsv(bundled):
    tsv = importlib.resources.files("plainformer").joinpath("corpus", "works.tsv").read_text("utf-8")
    titles = [line.split("\t")[0] for line in tsv.splitlines()[1:]]
    assert len(titles) == 38
    assert [w.title for w in bundled.train_works] == titles[:34]
    assert [w.title for w in bundled.val_works] == titles[34:]
    train_start, train_end = bundled.span("train")
    val_start, val_end = bundled.span("val")
    assert (train_start, val_end) == (0, len(bundled.text) - 1) and train_end < val_start
    assert bundled.text[val_start:].startswith("THE HISTORY OF TROILUS AND CRESSIDA")
    assert bundled.text[train_end:val_start] == "\n\n\n\n"  # each work's final newline, then the separator
    val_chars = sum(w.end - w.start for w in bundled.val_works)
    assert val_chars == 524_941 - 4 and round(val_chars / len(bundled.text), 3) == 0.111


def test_user_text_is_split_by_blocks_between_two_blank_lines():
    text = "\n\n\n" + make_works(20) + "\n \n\n"
    split = split_text(text)
    assert [w.title for w in split.train_works] == [f"WORK {i}" for i in range(18)]
    assert [w.title for w in split.val_works] == ["WORK 18", "WORK 19"]
    for work in split.train_works + split.val_works:
        assert text[work.start:work.end].startswith("WORK") and text[work.end - 1] == "!"
    train_text = text[slice(*split.span("train"))]
    val_text = text[slice(*split.span("val"))]
    assert "WORK 17" in train_text and "WORK 18" not in train_text
    assert val_text.startswith("WORK 18") and "WORK 17" not in val_text


def test_a_last_work_above_twice_the_share_is_cut_by_lines_and_training_keeps_a_part():
    # Three works of equal length: the last is 33% of the text, above 2 x 10%, so only its last lines go.
    split = split_text(make_works(3))
    assert [w.title for w in split.train_works] == ["WORK 0", "WORK 1", "WORK 2 (lines 1-3)"]
    assert [w.title for w in split.val_works] == ["WORK 2 (lines 4-6)"]
    assert split.text[slice(*split.span("val"))] == "Line two:\n  three,\nfour: 2!"
    # val_fraction 0.9 reaches into the first work, which training needs: it is cut too.
    split = split_text(make_works(2), val_fraction=0.9)
    assert [w.title for w in split.train_works] == ["WORK 0 (lines 1-2)"]
    assert [w.title for w in split.val_works] == ["WORK 0 (lines 3-6)", "WORK 1"]


def test_a_single_work_is_cut_by_lines_at_a_tenth_of_its_characters():
    lines = [f"line {i}\n" for i in range(1, 51)]
    split = split_text("".join(lines))
    assert split.text[slice(*split.span("val"))] == "".join(lines[45:]).rstrip()  # 39 of 390 characters
    assert split.text[slice(*split.span("train"))] == "".join(lines[:45])
    assert [w.title for w in split.val_works] == ["line 1 (lines 46-50)"]
    short = split_text("first\nsecond")  # no final newline
    assert short.text[slice(*short.span("val"))] == "second"
    with pytest.raises(ValueError, match="single line"):
        split_text("only one line\n")


def test_find_works_ignores_blank_blocks():
    assert find_works("\n\n\n \n\n\n") == []
    with pytest.raises(ValueError, match="no non-blank work"):
        split_text("   \n\n\n\n")


def test_load_text_reads_utf8_and_reports_bad_files(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes("\ufeffline one\r\nline two é\r\n".encode("utf-8"))
    assert load_text(good) == "line one\nline two é\n"
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_text(tmp_path / "missing.txt")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text: byte 0xe9 at offset 3"):
        load_text(latin)
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        load_text(empty)


def joined_encoding(tok, docs):
    """The reference: each document encoded whole, joined by [eos] or, without it, by encode("\\n\\n")."""
    separator = [tok.eos_id] if tok.eos_id is not None else tok.encode("\n\n")
    ids = tok.encode(docs[0])
    for doc in docs[1:]:
        ids += separator + tok.encode(doc)
    return ids


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(data, "ENCODE_CHUNK_CHARS", 21)
    monkeypatch.setattr(data, "ENCODE_GROUP", 3)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_memmap_token_arrays_equal_direct_encoding(tmp_path, small_chunks, kind):
    split = split_text(make_works(30))
    vocab_size = None if kind == "char" else 300
    tok = build_tokenizer(split, kind, vocab_size=vocab_size, cache_dir=tmp_path)
    assert len(list(split.chunks("val", data.ENCODE_CHUNK_CHARS))) > data.ENCODE_GROUP
    for which in ("train", "val"):
        tokens = token_array(split, which, tok, cache_dir=tmp_path)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        assert tokens.tolist() == joined_encoding(tok, list(split.documents(which)))
    assert not [p for p in (tmp_path / "tokens").iterdir() if p.name.startswith(".")]


def test_cached_tokens_and_tokenizers_are_reused(tmp_path, monkeypatch):
    split = split_text(make_works(10))
    tok = build_tokenizer(split, "bpe", vocab_size=280, cache_dir=tmp_path)
    first = token_array(split, "train", tok, cache_dir=tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(BPETokenizer, "train", fail)
    monkeypatch.setattr(BPETokenizer, "encode_many", fail)
    again = build_tokenizer(split, "bpe", vocab_size=280, cache_dir=tmp_path)
    assert again.fingerprint == tok.fingerprint
    assert np.array_equal(token_array(split, "train", again, cache_dir=tmp_path), first)


def test_an_interrupted_encoding_leaves_no_cache_entry(tmp_path, small_chunks, monkeypatch):
    split = split_text(make_works(10))
    tok = CharTokenizer(split.text)
    calls = []

    def encode_then_fail(text):
        calls.append(len(text))
        if len(calls) == 5:
            raise KeyboardInterrupt
        return CharTokenizer.encode_array(tok, text)

    monkeypatch.setattr(tok, "encode_array", encode_then_fail)
    with pytest.raises(KeyboardInterrupt):
        token_array(split, "train", tok, cache_dir=tmp_path)
    assert list((tmp_path / "tokens").iterdir()) == []


def test_token_ids_need_uint32_beyond_65536():
    assert data.token_dtype(65536) == np.uint16
    assert data.token_dtype(65537) == np.uint32


def test_build_tokenizer_validates_its_arguments():
    split = split_text(make_works(3))
    with pytest.raises(ValueError, match="vocab_size must be given for a bpe tokenizer"):
        build_tokenizer(split, "bpe")
    with pytest.raises(ValueError, match="vocab_size must be None for a char tokenizer"):
        build_tokenizer(split, "char", vocab_size=10)
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        build_tokenizer(split, "unigram", vocab_size=10)


def test_prepare_lm_data_on_the_bundled_corpus(tmp_path, bundled):
    prepared = prepare_lm_data(cache_dir=tmp_path)
    assert prepared.tokenizer.vocab_size == 84
    # 34 training works joined by 33 blank lines of two characters each.
    assert len(prepared.train_tokens) == sum(w.end - w.start for w in bundled.train_works) + 2 * 33
    assert prepared.val_tokens.tolist() == prepared.tokenizer.encode("\n\n".join(bundled.documents("val")))
    assert prepared.stats.val.documents == 4 and round(prepared.stats.val_share, 3) == 0.111


def test_prepare_lm_data_with_a_given_tokenizer_encodes_a_user_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(make_works(10))
    tok = CharTokenizer(make_works(10) + "xyz")
    prepared = prepare_lm_data(path, tokenizer=tok, cache_dir=tmp_path / "cache")
    assert prepared.tokenizer is tok
    split = split_text(make_works(10))
    assert tok.decode(prepared.val_tokens) == "\n\n".join(split.documents("val"))



def test_concurrent_preparers_of_one_entry_prepare_it_once(tmp_path, monkeypatch):
    # The ranks of one torchrun prepare the same fresh entry at once: the second must wait for the
    # first (not remove its tokenizer as a leftover) and then load what it wrote.
    path = tmp_path / "corpus.txt"
    path.write_text(make_works(10))
    prepared_in = []
    prepare = prepared._prepare

    def slow_prepare(directory, *args):
        prepared_in.append(directory)
        time.sleep(0.3)  # the other thread reaches the entry meanwhile
        return prepare(directory, *args)

    monkeypatch.setattr(prepared, "_prepare", slow_prepare)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: prepare_lm_data(path, cache_dir=tmp_path / "cache"), range(2))
    assert len(prepared_in) == 1
    assert np.array_equal(first.train_tokens, second.train_tokens)
    assert first.tokenizer.fingerprint == second.tokenizer.fingerprint

@pytest.fixture
def source():
    return LMBatchSource(np.arange(1000, dtype=np.uint16), torch.arange(2000, 2100), block_size=8, seed=3)


def test_targets_are_the_inputs_shifted_by_one_token(source):
    batch = source.get_batch("train", 0, 5)
    assert batch["idx"].shape == batch["targets"].shape == (5, 8)
    assert batch["idx"].dtype == batch["targets"].dtype == torch.long
    # The tokens are consecutive integers, so every window is start, start+1, ...
    assert torch.equal(batch["targets"], batch["idx"] + 1)
    assert torch.equal(batch["idx"], batch["idx"][:, :1] + torch.arange(8))
    assert int(batch["targets"].max()) <= 999
    val = source.get_batch("val", 0, 5)
    assert int(val["idx"].min()) >= 2000 and int(val["targets"].max()) <= 2099


def test_batches_depend_only_on_seed_split_and_index(source):
    again = LMBatchSource(np.arange(1000, dtype=np.uint16), torch.arange(2000, 2100), block_size=8, seed=3)
    torch.manual_seed(0)
    first = source.get_batch("train", 7, 4)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    assert torch.equal(again.get_batch("train", 7, 4)["idx"], first["idx"])
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left alone
    assert not torch.equal(source.get_batch("train", 8, 4)["idx"], first["idx"])
    other_seed = LMBatchSource(np.arange(1000), np.arange(100), block_size=8, seed=4)
    assert not torch.equal(other_seed.get_batch("train", 7, 4)["idx"], first["idx"])


def test_every_window_start_can_be_drawn():
    source = LMBatchSource(np.arange(12), np.arange(9), block_size=8, seed=0)
    starts = {int(source.get_batch("train", i, 16)["idx"][b, 0]) for i in range(20) for b in range(16)}
    assert starts == {0, 1, 2, 3}
    assert torch.equal(source.get_batch("val", 0, 2)["idx"], torch.arange(8).expand(2, 8))


def test_batch_source_rejects_bad_arguments(source):
    with pytest.raises(ValueError, match=r"the val split has 8 tokens but block_size=8 needs at least 9"):
        LMBatchSource(np.arange(100), np.arange(8), block_size=8)
    with pytest.raises(TypeError, match="train_tokens must be a 1-D integer array"):
        LMBatchSource(np.zeros(100), np.arange(100), block_size=8)
    with pytest.raises(ValueError, match="split must be one of 'train', 'val'"):
        source.get_batch("test", 0, 2)
    with pytest.raises(ValueError, match="index must be a non-negative int"):
        source.get_batch("train", -1, 2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        source.get_batch("train", 0, 0)


# ----------------------------------------------------------------------------- prepare_lm_data: files

def random_documents(sizes, seed=0):
    """Documents of about the given sizes in characters: lines of words, single blank lines inside."""
    rng = np.random.default_rng(seed)
    words = ["the", "king", "said", "and", "été", "naïve", "thou", "art", "a", "fool", "Ἀθῆναι", "to", "be"]
    docs = []
    for size in sizes:
        lines, length = [], 0
        while length < size:
            line = " ".join(rng.choice(words, rng.integers(1, 12)))
            line = "" if rng.random() < 0.05 and lines and lines[-1] else line  # never two blank lines
            lines.append(line)
            length += len(line) + 1
        docs.append("\n".join(lines).strip())
    return docs


def write_corpus(path, docs):
    path.write_text("\n\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def test_long_last_documents_hold_out_a_share_true_to_the_characters(tmp_path):
    # By count of documents (the last 10% of 30) validation would be the 3 long ones: 77% of the text.
    docs = random_documents([10_000] * 27 + [300_000] * 3)
    prepared = prepare_lm_data(write_corpus(tmp_path / "c.txt", docs), cache_dir=tmp_path / "cache")
    val_share = len(prepared.val_tokens) / (len(prepared.train_tokens) + len(prepared.val_tokens))
    assert 0.05 <= val_share <= 0.2
    assert 0.1 <= prepared.stats.val_share < 0.1 + 0.001  # at least 10% of the characters, by whole lines
    assert (prepared.stats.train.documents, prepared.stats.val.documents) == (30, 1)  # the last one is cut
    assert "document 30 of 30" in prepared.stats.note and "cut by lines" in prepared.stats.note
    val_text = prepared.tokenizer.decode(prepared.val_tokens)
    assert docs[-1].endswith(val_text) and docs[-1][-len(val_text) - 1] == "\n"


def test_whole_documents_go_to_validation_when_they_fit_twice_the_share(tmp_path):
    docs = random_documents([2_000] * 20, seed=1)
    logged = []
    prepared = prepare_lm_data(write_corpus(tmp_path / "c.txt", docs), cache_dir=tmp_path / "cache",
                               log=logged.append)
    lengths = np.array([len(d) for d in docs])
    n_val = next(k for k in range(1, 21) if lengths[-k:].sum() >= 0.1 * lengths.sum())
    assert prepared.stats.val == type(prepared.stats.val)(n_val, int(lengths[-n_val:].sum()), len(prepared.val_tokens))
    assert prepared.stats.note is None
    assert logged[0] == (f"train: {20 - n_val} documents, {lengths[:-n_val].sum():,} characters, "
                         f"{len(prepared.train_tokens):,} tokens")
    assert logged[1].startswith(f"val: {n_val} documents") and len(logged) == 2


def test_a_one_document_corpus_splits_by_lines(tmp_path):
    doc = random_documents([20_000], seed=2)[0]
    prepared = prepare_lm_data(write_corpus(tmp_path / "one.txt", [doc]), cache_dir=tmp_path / "cache")
    train, val = (prepared.tokenizer.decode(t) for t in (prepared.train_tokens, prepared.val_tokens))
    assert train + val == doc and train.endswith("\n")
    assert 0.1 <= len(val) / len(doc) < 0.11


def test_a_boundary_document_without_a_line_break_goes_whole_and_the_log_says_why(tmp_path):
    docs = random_documents([1_000] * 5, seed=3) + ["x " * 3_000]
    logged = []
    prepared = prepare_lm_data(write_corpus(tmp_path / "c.txt", docs), cache_dir=tmp_path / "cache",
                               log=logged.append)
    assert prepared.stats.val.documents == 1 and prepared.stats.val_share > 0.5
    assert logged[-1].startswith("note: document 6 of 6") and "no line break" in logged[-1]


def test_the_split_is_the_same_in_every_run(tmp_path):
    path = write_corpus(tmp_path / "c.txt", random_documents([3_000] * 7 + [40_000], seed=4))
    first, second = (prepare_lm_data(path, cache_dir=tmp_path / name) for name in ("a", "b"))
    assert first.directory != second.directory
    assert np.array_equal(first.train_tokens, second.train_tokens)
    assert np.array_equal(first.val_tokens, second.val_tokens)
    assert first.stats == second.stats


def test_val_data_is_the_validation_split(tmp_path):
    docs = random_documents([1_000] * 6, seed=5)
    train_path = write_corpus(tmp_path / "train.txt", docs[:4])
    val_path = write_corpus(tmp_path / "val.txt", docs[4:])
    prepared = prepare_lm_data(train_path, val_path=val_path, cache_dir=tmp_path / "cache")
    tok = prepared.tokenizer
    assert prepared.train_tokens.tolist() == tok.encode("\n\n".join(docs[:4]))
    assert prepared.val_tokens.tolist() == tok.encode("\n\n".join(docs[4:]))
    assert prepared.stats.note == f"validation is {val_path}" and prepared.stats.val_fraction is None
    again = prepare_lm_data(train_path, cache_dir=tmp_path / "cache")
    assert len(again.train_tokens) < len(prepared.train_tokens)  # without it, the end of train.txt validates


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("form", ["gz", "folder", "glob", "jsonl", "jsonl.gz"])
def test_every_input_form_gives_the_tokens_of_one_text_file(tmp_path, form, kind):
    from tests.data.test_sources import write_forms

    docs = random_documents([700] * 12, seed=6)
    forms = write_forms(tmp_path / "data", docs)
    vocab_size = None if kind == "char" else 320
    reference = prepare_lm_data(forms["file"], tokenizer=kind, vocab_size=vocab_size, cache_dir=tmp_path / "c")
    prepared = prepare_lm_data(forms[form], tokenizer=kind, vocab_size=vocab_size, cache_dir=tmp_path / "c")
    assert prepared.directory != reference.directory
    assert prepared.tokenizer.fingerprint == reference.tokenizer.fingerprint
    assert np.array_equal(prepared.train_tokens, reference.train_tokens)
    assert np.array_equal(prepared.val_tokens, reference.val_tokens)


def test_a_bpe_tokenizer_built_here_ends_documents_with_eos(tmp_path):
    docs = random_documents([800] * 10, seed=7)
    prepared = prepare_lm_data(write_corpus(tmp_path / "c.txt", docs), tokenizer="bpe", vocab_size=300,
                               cache_dir=tmp_path / "cache")
    tok = prepared.tokenizer
    assert tok.special_tokens == {"eos": "<eos>"} and tok.eos_id == 0
    n_train = prepared.stats.train.documents
    assert prepared.train_tokens.tolist() == joined_encoding(tok, docs[:n_train])
    assert int((prepared.train_tokens == tok.eos_id).sum()) == n_train - 1


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_streamed_preparation_equals_the_in_memory_path(tmp_path, monkeypatch, kind):
    from plainformer.data import sources

    # Reading blocks and encoding chunks many times smaller than the file; one line longer than
    # LONG_LINE_CHUNKS chunks exercises the cut between words.
    monkeypatch.setattr(sources, "BLOCK_CHARS", 1_000)
    monkeypatch.setattr(data, "ENCODE_CHUNK_CHARS", 300)
    docs = random_documents([4_000] * 9 + [12_000], seed=8)
    docs[3] = docs[3] + "\n" + " ".join(["word"] * 1_500) + "\nend"
    path = write_corpus(tmp_path / "c.txt", docs)
    assert path.stat().st_size > 20 * sources.BLOCK_CHARS
    split = split_text(path.read_text(encoding="utf-8"))
    tok = (build_tokenizer(split, "char", cache_dir=tmp_path) if kind == "char"
           else BPETokenizer.train(docs, 400, special_tokens=("eos",)))
    prepared = prepare_lm_data(path, tokenizer=tok, cache_dir=tmp_path / "cache")
    assert prepared.stats.train.documents == len(split.train_works)
    for which, tokens in (("train", prepared.train_tokens), ("val", prepared.val_tokens)):
        in_memory = token_array(split, which, tok, cache_dir=tmp_path / "memory")
        assert np.array_equal(tokens, in_memory)
        assert tokens.tolist() == joined_encoding(tok, list(split.documents(which)))


def test_a_changed_file_is_prepared_again(tmp_path):
    path = write_corpus(tmp_path / "c.txt", random_documents([1_000] * 5, seed=9))
    first = prepare_lm_data(path, cache_dir=tmp_path / "cache")
    stat = path.stat()
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("king", "KING"), encoding="utf-8")  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = prepare_lm_data(path, cache_dir=tmp_path / "cache")
    assert second.directory != first.directory
    assert "KING" in second.tokenizer.decode(second.train_tokens)


def test_a_cache_entry_is_reused_without_reading_the_data(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "c.txt", random_documents([1_000] * 5, seed=10))
    first = prepare_lm_data(path, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache")

    def fail(*args, **kwargs):
        raise AssertionError("the data was read again")

    monkeypatch.setattr(prepared, "_prepare", fail)
    again = prepare_lm_data(path, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache")
    assert again.tokenizer.fingerprint == first.tokenizer.fingerprint
    assert np.array_equal(again.val_tokens, first.val_tokens)


def test_an_interrupted_preparation_is_done_again_not_trusted(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "c.txt", random_documents([1_000] * 8, seed=11))
    reference = prepare_lm_data(path, cache_dir=tmp_path / "reference")
    writes = []
    real_write = prepared.write_tokens

    def write_train_then_stop(target, arrays, dtype):
        writes.append(target.name)
        if target.name == "val.bin":
            next(iter(arrays))
            raise KeyboardInterrupt  # Ctrl-C while the validation tokens are written
        return real_write(target, arrays, dtype)

    monkeypatch.setattr(prepared, "write_tokens", write_train_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare_lm_data(path, cache_dir=tmp_path / "cache")
    assert writes == ["train.bin", "val.bin"]
    (entry,) = (tmp_path / "cache" / "lm").iterdir()
    assert not any((entry / name).exists() for name in ("train.bin", "val.bin", "stats.json", "tokenizer"))
    monkeypatch.setattr(prepared, "write_tokens", real_write)
    redone = prepare_lm_data(path, cache_dir=tmp_path / "cache")
    assert np.array_equal(redone.val_tokens, reference.val_tokens)

    # What a kill -9 after the statistics but with a damaged array would leave: sizes disagree.
    with open(entry / "train.bin", "r+b") as f:
        f.truncate(10)
    redone = prepare_lm_data(path, cache_dir=tmp_path / "cache")
    assert np.array_equal(redone.train_tokens, reference.train_tokens)


def test_prepare_lm_data_validates_its_arguments(tmp_path):
    path = write_corpus(tmp_path / "c.txt", ["a\nb", "c\nd"])
    with pytest.raises(ValueError, match="vocab_size must be given for a bpe tokenizer"):
        prepare_lm_data(path, tokenizer="bpe", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="tokenizer must be one of 'char', 'bpe'"):
        prepare_lm_data(path, tokenizer="wordpiece", vocab_size=100, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        prepare_lm_data(path, val_fraction=0.0, cache_dir=tmp_path)
    (tmp_path / "blank.txt").write_text("\n \n\n")
    with pytest.raises(ValueError, match="holds no non-blank document"):
        prepare_lm_data(tmp_path / "blank.txt", cache_dir=tmp_path)
    (tmp_path / "line.txt").write_text("just one line\n")
    with pytest.raises(ValueError, match="single line"):
        prepare_lm_data(tmp_path / "line.txt", cache_dir=tmp_path)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["ab", "c d", "", "éé", "  x"]), min_size=1, max_size=12)
                .map("\n".join).filter(str.strip), min_size=1, max_size=6),
       st.integers(1, 40), st.sampled_from([0.1, 0.3, 0.6]))
def test_streamed_split_equals_the_in_memory_split_for_any_block_size(docs, block_chars, val_fraction):
    from plainformer.data import sources

    text = "\n\n\n".join(docs)
    split = None
    try:
        split = split_text(text, val_fraction=val_fraction)
    except ValueError as err:
        assert "single line" in str(err)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.txt"
        path.write_text(text, encoding="utf-8")
        original = sources.BLOCK_CHARS
        sources.BLOCK_CHARS = block_chars
        try:
            if split is None:
                with pytest.raises(ValueError, match="single line"):
                    prepare_lm_data(path, val_fraction=val_fraction, cache_dir=tmp)
                return
            prepared = prepare_lm_data(path, val_fraction=val_fraction, cache_dir=tmp)
        finally:
            sources.BLOCK_CHARS = original
        tok = prepared.tokenizer
        assert tok.decode(prepared.train_tokens) == "\n\n".join(split.documents("train"))
        assert tok.decode(prepared.val_tokens) == "\n\n".join(split.documents("val"))
        assert prepared.stats.val.documents == len(split.val_works)


KILLED_CHILD = """
import sys, time
from plainformer.data import lm, prepared
real_write = prepared.write_tokens

def write_then_hang(path, arrays, dtype):
    if path.name == "val.bin":
        def slow():
            for i, ids in enumerate(arrays):
                yield ids
                if i == 1:
                    print("ready", flush=True)
                    time.sleep(600)
        return real_write(path, slow(), dtype)
    return real_write(path, arrays, dtype)

prepared.write_tokens = write_then_hang
lm.ENCODE_CHUNK_CHARS = 200
prepared.prepare_lm_data(sys.argv[1], cache_dir=sys.argv[2])
"""


def test_a_preparation_killed_midway_is_done_again(tmp_path):
    import signal
    import subprocess
    import sys

    path = write_corpus(tmp_path / "c.txt", random_documents([3_000] * 20, seed=12))
    env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(path), str(tmp_path / "cache")],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"  # midway through the validation tokens
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (entry,) = (tmp_path / "cache" / "lm").iterdir()
    leftovers = sorted(p.name for p in entry.iterdir())
    assert "train.bin" in leftovers and "stats.json" not in leftovers
    assert any(name.startswith(".val.bin.tmp-") for name in leftovers)
    redone = prepare_lm_data(path, cache_dir=tmp_path / "cache")
    reference = prepare_lm_data(path, cache_dir=tmp_path / "reference")
    assert redone.directory == entry
    assert np.array_equal(redone.val_tokens, reference.val_tokens)
    assert np.array_equal(redone.train_tokens, reference.train_tokens)
    assert sorted(p.name for p in entry.iterdir()) == ["stats.json", "tokenizer", "train.bin", "val.bin"]


def test_a_large_training_part_trains_the_tokenizer_on_evenly_spread_windows(monkeypatch):
    from plainformer.data.sources import Piece

    monkeypatch.setattr(prepared, "TOKENIZER_SAMPLE_CHARS", 1_000)
    monkeypatch.setattr(prepared, "SAMPLE_WINDOW_CHARS", 100)
    monkeypatch.setattr(prepared, "TRAINING_CHUNK_CHARS", 10)
    lines = [f"{i:09d}" for i in range(1_000)]  # 10 characters a line with its newline
    text = "\n".join(lines)
    sample = "".join(prepared._training_sample([Piece(text, True)], len(text)))
    # stride = ceil(10,000 / 1,000) = 10: windows 0, 10, 20, ... of 100 characters, i.e. lines 0-9, 100-109, ...
    assert sample.split() == [line for i, line in enumerate(lines) if (i // 10) % 10 == 0]
    assert len(sample) <= 1_000


def test_progress_shows_bytes_and_rate_on_stderr(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.txt", random_documents([1_000] * 5, seed=13))
    prepare_lm_data(path, cache_dir=tmp_path / "cache", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "scanning" in captured.err and "encoding" in captured.err and "B/s" in captured.err


def test_a_gzip_file_that_expands_a_hundredfold_is_said_to_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepared, "EXPANSION_NOTE_CHARS", 100_000)
    bomb, text = tmp_path / "bomb.txt.gz", tmp_path / "text.txt.gz"
    bomb.write_bytes(gzip.compress((("To be, or not to be.\n" * 20 + "\n\n") * 2_000).encode()))  # 844,000 characters
    text.write_bytes(gzip.compress(write_corpus(tmp_path / "c.txt", random_documents([50_000] * 10)).read_bytes()))
    prepare_lm_data(bomb, cache_dir=tmp_path / "cache")
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "fold" in line]
    assert re.fullmatch(r"plainformer: .*bomb\.txt\.gz expands more than 100-fold \([\d,]+ characters so far from "
                        r"[\d.]+ kB on disk\): each pass over it reads all of them; Ctrl-C stops", line), line
    prepare_lm_data(text, cache_dir=tmp_path / "cache")  # text compresses a few fold: nothing said
    assert "fold" not in capsys.readouterr().err
