"""Built-in tasks: reproducible from the seed, splits that share no source, correct targets, one BPE
for both sides; length-grouped batches deterministic in (seed, split, index) that cover each epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plainformer.data.seq2seq import (
    SPLITS,
    TASKS,
    PairBatches,
    Seq2SeqBatches,
    make_task,
    split_of,
    train_tokenizer,
)

SMALL = {"train": 300, "val": 30, "test": 30}


@pytest.fixture(scope="module")
def numbers():
    return make_task("numbers-en-fr", sizes=SMALL)


@pytest.fixture(scope="module")
def copy_data():
    task = make_task("copy", sizes=SMALL)
    return task, train_tokenizer(task)


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_the_same_seed_gives_the_same_pairs_and_another_seed_others(name):
    assert make_task(name, sizes=SMALL).pairs == make_task(name, sizes=SMALL).pairs
    assert make_task(name, sizes=SMALL, seed=1).pairs["test"] != make_task(name, sizes=SMALL).pairs["test"]


@pytest.mark.parametrize("name", list(TASKS))
def test_splits_share_no_source_sentence(name, numbers):
    task = numbers if name == "numbers-en-fr" else make_task(name, sizes=SMALL)
    sources = {split: set(task.sources(split)) for split in SPLITS}
    for split in SPLITS:
        assert len(sources[split]) == len(task.pairs[split]) == SMALL[split]  # distinct, as many as asked
    assert not sources["train"] & sources["val"]
    assert not sources["train"] & sources["test"]
    assert not sources["val"] & sources["test"]


def test_a_sources_split_does_not_depend_on_the_sizes_asked_for():
    small, large = make_task("copy", sizes=SMALL), make_task("copy", sizes={"train": 600, "test": 60})
    assert set(small.sources("test")) <= set(large.sources("test"))
    assert all(split_of(s, 0) == "test" for s in large.sources("test"))


def test_copy_and_reverse_targets():
    for source, target in make_task("copy", sizes=SMALL).pairs["train"]:
        assert target == source and 1 <= len(source) <= 10 and set(source) <= set("abcdefghij")
    for source, target in make_task("reverse", sizes=SMALL).pairs["train"]:
        assert target == source[::-1]


def test_numbers_are_english_words_to_french_words(numbers):
    spec = TASKS["numbers-en-fr"]
    assert (spec.source(71080), spec.target(71080)) == ("seventy-one thousand and eighty",
                                                      "soixante et onze mille quatre-vingts")
    assert (spec.source(80000), spec.target(80000)) == ("eighty thousand", "quatre-vingt mille")
    english_to_french = dict(pair for split in SPLITS for pair in numbers.pairs[split])
    known = {spec.source(n): spec.target(n) for n in range(1000)}
    assert all(english_to_french[s] == known[s] for s in english_to_french if s in known)
    assert any(s not in known for s in english_to_french)  # numbers beyond 999 occur too


def test_one_tokenizer_encodes_both_sides_and_round_trips(numbers):
    tokenizer = train_tokenizer(numbers)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    for source, target in numbers.pairs["test"]:
        assert tokenizer.decode(tokenizer.encode(source)) == source
        assert tokenizer.decode(tokenizer.encode(target)) == target
    assert len(tokenizer.encode("quatre-vingt-dix-neuf")) < len("quatre-vingt-dix-neuf")  # subwords


def test_batches_are_deterministic_in_seed_split_and_index(copy_data):
    task, tokenizer = copy_data
    one, two = Seq2SeqBatches(task, tokenizer, seed=3), Seq2SeqBatches(task, tokenizer, seed=3)
    for split, index in (("train", 0), ("train", 17), ("val", 1), ("train", 5)):
        a, b = one.get_batch(split, index, 8), two.get_batch(split, index, 8)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(one.get_batch("train", 0, 8)["src"], one.get_batch("train", 1, 8)["src"])
    other = Seq2SeqBatches(task, tokenizer, seed=4).get_batch("train", 0, 8)["src"]
    assert not torch.equal(one.get_batch("train", 0, 8)["src"], other)


def test_targets_are_shifted_by_one_with_bos_eos_and_padding(copy_data):
    task, tokenizer = copy_data
    batch = Seq2SeqBatches(task, tokenizer).get_batch("train", 2, 16)
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    assert (tgt_in[:, 0] == tokenizer.bos_id).all()
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1].masked_fill(tgt_out[:, :-1] == tokenizer.eos_id, 0))
    lengths = (tgt_out != 0).sum(dim=1)
    assert (tgt_out[torch.arange(16), lengths - 1] == tokenizer.eos_id).all()
    assert torch.equal((src != 0).sum(dim=1), lengths - 1)  # copy: target length = source length


def test_an_epoch_covers_each_example_once_in_length_grouped_batches(copy_data):
    task, tokenizer = copy_data
    batches = Seq2SeqBatches(task, tokenizer, pool_batches=4)
    epoch = [batches.get_batch("train", i, 10) for i in range(30)]  # 300 examples / 10
    seen = sorted(tokenizer.decode(row[row != 0]) for b in epoch for row in b["src"])
    assert seen == sorted(task.sources("train"))
    grouped_padding = sum((b["src"] == 0).sum().item() for b in epoch)
    examples = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in task.pairs["train"]]
    order = torch.randperm(300, generator=torch.Generator().manual_seed(0)).tolist()
    random_padding = sum((batches.collate([examples[i] for i in order[start:start + 10]])["src"] == 0).sum().item()
                         for start in range(0, 300, 10))
    assert grouped_padding < 0.5 * random_padding


@pytest.mark.parametrize("call, error, match", [
    (lambda: make_task("nope"), ValueError, "task"),
    (lambda: make_task("copy", sizes={"dev": 3}), ValueError, "split"),
    (lambda: make_task("copy", sizes={"train": 0}), ValueError, "train"),
])
def test_bad_task_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bad_batch_arguments_raise(copy_data):
    batches = Seq2SeqBatches(*copy_data)
    with pytest.raises(ValueError, match="split"):
        batches.get_batch("dev", 0, 4)
    with pytest.raises(ValueError, match="index"):
        batches.get_batch("train", -1, 4)
    with pytest.raises(ValueError, match="batch_size"):
        batches.get_batch("train", 0, 0)


def _random_pairs(n: int, seed: int = 0, longest: int = 40) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    def ids() -> list[int]:
        return rng.integers(4, 50, rng.integers(1, longest)).tolist()

    return [(ids(), ids()) for _ in range(n)]


def test_token_batches_hold_at_most_batch_tokens_a_side_and_batch_size_rows_and_cover_an_epoch():
    pairs = _random_pairs(500)
    batches = PairBatches({"train": pairs}, pad_id=0, bos_id=1, eos_id=2, batch_tokens=200, source_eos=True,
                          pool_batches=4)
    per_epoch = batches.batches_per_epoch("train", 16)
    seen = []
    for index in range(per_epoch):
        batch = batches.get_batch("train", index, 16)
        assert batch["src"].numel() <= 200 and batch["tgt_in"].numel() <= 200 and len(batch["src"]) <= 16
        for src, tgt in zip(batch["src"], batch["tgt_out"], strict=True):
            source = src[src != 0].tolist()
            assert source[-1] == 2  # the source ends with eos
            seen.append((tuple(source[:-1]), tuple(tgt[tgt != 0].tolist()[:-1])))
    assert sorted(seen) == sorted((tuple(s), tuple(t)) for s, t in pairs)
    first, next_epoch = batches.get_batch("train", 0, 16)["src"], batches.get_batch("train", per_epoch, 16)["src"]
    assert first.shape != next_epoch.shape or not torch.equal(first, next_epoch)  # another order


def test_pairs_longer_than_max_len_are_left_out_and_counted():
    pairs = _random_pairs(200, longest=30)
    batches = PairBatches({"train": pairs}, pad_id=0, bos_id=1, eos_id=2, batch_tokens=300, source_eos=True,
                          max_len=20)
    fits = [len(s) + 1 <= 20 and len(t) + 1 <= 20 for s, t in pairs]
    assert batches.left_out("train") == fits.count(False) > 0
    widths = [batches.get_batch("train", i, 64)["src"].shape[1] for i in range(batches.batches_per_epoch("train", 64))]
    assert max(widths) <= 20
    rows = sum(len(batches.get_batch("train", i, 64)["src"]) for i in range(batches.batches_per_epoch("train", 64)))
    assert rows == fits.count(True)
    with pytest.raises(ValueError, match="holds no pair within max_len"):
        PairBatches({"train": pairs}, pad_id=0, bos_id=1, eos_id=2, max_len=1).get_batch("train", 0, 4)


def test_token_batches_are_deterministic_in_seed_split_and_index():
    pairs = _random_pairs(300)
    one, two = (PairBatches({"train": pairs}, pad_id=0, bos_id=1, eos_id=2, batch_tokens=256, seed=5) for _ in "ab")
    for index in (0, 7, 40):  # 40: an epoch later
        assert torch.equal(one.get_batch("train", index, 32)["src"], two.get_batch("train", index, 32)["src"])
