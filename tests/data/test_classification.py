"""Classification data: the play-lines task, texts and sentence pairs encoded as Hugging Face's
BertTokenizerFast encodes them (token type ids included), and the batches of the classification source."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import transformers

from plainformer.data.classification import (
    GROUP_BATCHES,
    ClassificationBatchSource,
    ClassificationData,
    EncodedTexts,
    Examples,
    play_lines_task,
    spoken_lines,
)
from plainformer.hf.bert import load_hf_bert_tokenizer, minilm_path

FIRST = ["To be, or not to be, that is the question.", "Hello!", "a gripping , funny film",
         "Ünïcödé café naïve résumé — Œuvre d’art", "the quick brown fox jumps over the lazy dog " * 4]
SECOND = ["Whether 'tis nobler in the mind to suffer", "Hi there.", "it is not funny at all , and long " * 5,
          "déjà vu", "a dog"]


@pytest.fixture(scope="module")
def minilm_tokenizer():
    return load_hf_bert_tokenizer("minilm")


@pytest.fixture(scope="module")
def reference_tokenizer():
    return transformers.BertTokenizerFast.from_pretrained(minilm_path())


@pytest.fixture(scope="module")
def task():
    return play_lines_task()


# ----------------------------------------------------------------------------- encoding

@pytest.mark.parametrize("max_len", [None, 12, 24])
def test_sentence_pairs_have_the_ids_and_segment_ids_of_bert_tokenizer_fast(minilm_tokenizer, reference_tokenizer,
                                                                           max_len):
    encoded = EncodedTexts(minilm_tokenizer, FIRST, SECOND, max_len)
    ours = encoded.batch(range(len(FIRST)))
    theirs = reference_tokenizer(FIRST, SECOND, padding=True, truncation=max_len is not None, max_length=max_len,
                                 return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["token_type_ids"], theirs["token_type_ids"])
    assert torch.equal(ours["attention_mask"].long(), theirs["attention_mask"])
    assert set(ours["token_type_ids"][0].tolist()) == {0, 1}  # both segments are there


def test_single_texts_have_the_ids_of_bert_tokenizer_fast_and_segment_zero(minilm_tokenizer, reference_tokenizer):
    ours = EncodedTexts(minilm_tokenizer, FIRST, max_len=10).batch([4, 1, 2])
    theirs = reference_tokenizer([FIRST[4], FIRST[1], FIRST[2]], padding=True, truncation=True, max_length=10,
                                 return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"]) and not ours["token_type_ids"].any()
    assert torch.equal(ours["attention_mask"].long(), theirs["attention_mask"])


def test_batches_by_length_hold_every_row_once_shortest_first(minilm_tokenizer):
    encoded = EncodedTexts(minilm_tokenizer, FIRST + SECOND)
    batches = encoded.by_length(3)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(10)) and [len(b) for b in batches] == [3, 3, 3, 1]
    assert np.all(np.diff(encoded.lengths[rows]) >= 0)


# ----------------------------------------------------------------------------- the source

def _data(n_train: int, n_val: int) -> ClassificationData:
    texts = [" ".join(["word"] * (1 + i % 17)) + f" {i}" for i in range(n_train + n_val)]
    labels = [i % 3 for i in range(n_train + n_val)]
    return ClassificationData(("a", "b", "c"), Examples(tuple(texts[:n_train]), tuple(labels[:n_train])),
                              Examples(tuple(texts[n_train:]), tuple(labels[n_train:])))


def test_validation_batches_cover_each_example_once(minilm_tokenizer):
    data = _data(20, 23)
    source = ClassificationBatchSource(data, minilm_tokenizer, max_len=16)
    n = source.num_batches("val", 5)
    batches = [source.get_batch("val", i, 5) for i in range(n)]
    assert n == 5 and sum(len(b["labels"]) for b in batches) == 23
    assert sorted(torch.cat([b["labels"] for b in batches]).tolist()) == sorted(data.val.labels)
    assert max(b["input_ids"].shape[1] for b in batches) <= 16
    assert torch.equal(source.get_batch("val", n, 5)["input_ids"], batches[0]["input_ids"])  # index mod n


def test_training_batches_read_each_epoch_once_grouped_by_length_and_repeat_exactly(minilm_tokenizer):
    data = _data(100, 3)  # a group of 50 batches of 4 rows reads 2 epochs
    source = ClassificationBatchSource(data, minilm_tokenizer, max_len=32, seed=3)
    batches = [source.get_batch("train", i, 4) for i in range(GROUP_BATCHES)]
    assert all(b["input_ids"].shape[0] == 4 for b in batches)
    ids = {tuple(row[row != 0].tolist()) for b in batches for row in b["input_ids"]}
    assert len(ids) == 100  # every training text, each read twice in the 200 rows
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    assert real / padded > 0.9  # a batch's rows are of like length
    again = ClassificationBatchSource(data, minilm_tokenizer, max_len=32, seed=3)
    for index in (7, 63, 2):
        assert all(torch.equal(again.get_batch("train", index, 4)[k], source.get_batch("train", index, 4)[k])
                   for k in batches[0])
    other_seed = ClassificationBatchSource(data, minilm_tokenizer, max_len=32, seed=4)
    assert not torch.equal(other_seed.get_batch("train", 0, 4)["input_ids"], batches[0]["input_ids"])


def test_training_batches_of_pairs_keep_both_segments(minilm_tokenizer):
    data = ClassificationData(("no", "yes"), Examples(tuple(FIRST), (0, 1, 0, 1, 0), tuple(SECOND)),
                              Examples(tuple(FIRST[:2]), (0, 1), tuple(SECOND[:2])))
    batch = ClassificationBatchSource(data, minilm_tokenizer, max_len=64).get_batch("train", 0, 5)
    assert all(set(row[mask].tolist()) == {0, 1} for row, mask in zip(batch["token_type_ids"],
                                                                        batch["attention_mask"], strict=True))


def test_examples_must_be_equally_long():
    with pytest.raises(ValueError, match="equally long"):
        Examples(("a", "b"), (0,))


# ----------------------------------------------------------------------------- the play-lines task

def test_no_line_is_in_two_splits_or_two_classes(task):
    train, val = set(task.train.texts), set(task.val.texts)
    assert not train & val
    assert len(train) == len(task.train) and len(val) == len(task.val)
    assert set(task.train.labels + task.val.labels) == {0, 1}
    assert 0.1 < len(task.val) / (len(task.train) + len(task.val)) < 0.3


def test_majority_baseline_is_the_share_of_the_largest_class(task):
    labels = list(task.val.labels)
    assert task.majority_baseline() == max(labels.count(0), labels.count(1)) / len(labels)
    toy = ClassificationData(("a", "b"), Examples(("x",), (0,)), Examples(("y", "z", "w"), (1, 1, 0)))
    assert toy.majority_baseline("val") == 2 / 3 and toy.counts("val") == {"a": 1, "b": 2}


def test_spoken_lines_skip_speakers_headings_and_stage_directions():
    text = "ACT I.\nSCENE II. A Camp near Forres.\nDUNCAN.\nWhat bloody man is that? He can report,\n" \
           "[Enter a bleeding Soldier.]\nI'll see it done myself.\nAy."
    assert spoken_lines(text) == ["What bloody man is that? He can report,", "I'll see it done myself."]


def test_unknown_plays_are_named():
    with pytest.raises(ValueError, match="Hamlet II"):
        play_lines_task(["Macbeth", "Hamlet II"])
    with pytest.raises(ValueError, match="two"):
        play_lines_task(["Macbeth"])
