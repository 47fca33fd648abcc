"""MLM masking statistics and invariants, and the MLM batch source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plainformer.data.mlm import MLMBatchSource, encode_stream, mask_tokens
from plainformer.data.tokenizers import WordPieceTokenizer
from plainformer.models.bert import IGNORE_INDEX

VOCAB = 1000
SPECIAL = [0, 1, 2, 3, 4]  # [PAD] [UNK] [CLS] [SEP] [MASK]
PAD, CLS, SEP, MASK = 0, 2, 3, 4


@pytest.fixture(scope="module")
def tokenizer():
    text = "Now is the winter of our discontent made glorious summer by this sun of York. " * 30
    return WordPieceTokenizer.train([text], vocab_size=120)


def _padded_batch(seed: int = 0, batch: int = 800, n: int = 300):
    """[CLS] tokens [SEP] then padding, rows of random lengths: (ids, attention mask)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch, n), generator=generator)
    lengths = torch.randint(3, n + 1, (batch,), generator=generator)
    positions = torch.arange(n)[None, :]
    ids[:, 0] = CLS
    ids = torch.where(positions == (lengths[:, None] - 1), SEP, ids)
    mask = positions < lengths[:, None]
    return ids.masked_fill(~mask, PAD), mask


def _mask(ids, attention_mask, seed=1):
    return mask_tokens(ids, mask_id=MASK, special_ids=SPECIAL, vocab_size=VOCAB,
                       generator=torch.Generator().manual_seed(seed), attention_mask=attention_mask)


def test_selection_and_80_10_10_split_hold_over_100k_tokens():
    ids, attention = _padded_batch()
    eligible = attention & ~torch.isin(ids, torch.tensor(SPECIAL))
    assert eligible.sum() >= 100_000
    masked, labels = _mask(ids, attention)
    selected = labels != IGNORE_INDEX
    # Binomial standard deviations: 0.0011 for the 15%, 0.003 and 0.0025 for the 80% and 10% shares.
    assert abs(selected.sum().item() / eligible.sum().item() - 0.15) < 0.005
    n = selected.sum().item()
    to_mask = (masked == MASK) & selected
    kept = (masked == ids) & selected
    replaced = selected & ~to_mask & ~kept
    assert abs(to_mask.sum().item() / n - 0.8) < 0.015
    assert abs(replaced.sum().item() / n - 0.1) < 0.01
    assert abs(kept.sum().item() / n - 0.1) < 0.01


def test_special_and_padding_tokens_are_never_selected_or_changed():
    ids, attention = _padded_batch(seed=3)
    masked, labels = _mask(ids, attention, seed=4)
    protected = ~attention | torch.isin(ids, torch.tensor(SPECIAL))
    assert torch.all(labels[protected] == IGNORE_INDEX)
    assert torch.equal(masked[protected], ids[protected])
    assert not torch.any(masked[~protected & (labels == IGNORE_INDEX)] != ids[~protected & (labels == IGNORE_INDEX)])


def test_random_replacements_are_never_special_tokens():
    ids, attention = _padded_batch(seed=5)
    masked, labels = _mask(ids, attention, seed=6)
    replaced = (labels != IGNORE_INDEX) & (masked != MASK) & (masked != ids)
    assert replaced.sum() > 1000
    assert not torch.isin(masked[replaced], torch.tensor(SPECIAL)).any()


def test_labels_hold_the_original_token_where_selected():
    ids, attention = _padded_batch(seed=7, batch=20)
    _, labels = _mask(ids, attention)
    selected = labels != IGNORE_INDEX
    assert torch.equal(labels[selected], ids[selected])


def test_masking_is_a_function_of_the_generator():
    ids, attention = _padded_batch(batch=10)
    first, second = _mask(ids, attention, seed=9), _mask(ids, attention, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[1], _mask(ids, attention, seed=10)[1])


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(mask_id=99), ValueError, "mask_id"),
    (dict(select_prob=1.5), ValueError, "select_prob"),
    (dict(mask_prob=0.7, random_prob=0.5), ValueError, "mask_prob"),
    (dict(vocab_size=10), ValueError, "input_ids"),
])
def test_bad_masking_arguments_are_named(kwargs, error, word):
    ids, _ = _padded_batch(batch=2, n=8)
    arguments = {**dict(mask_id=MASK, special_ids=SPECIAL, vocab_size=VOCAB), **kwargs}
    with pytest.raises(error, match=word):
        mask_tokens(ids, **arguments)


# ----------------------------------------------------------------------------- MLM batches

def _mlm_source(tokenizer, seed=0):
    stream = np.arange(5, tokenizer.vocab_size, dtype=np.int32)  # distinct ids: a window shows its start
    return MLMBatchSource(stream, stream[:20], tokenizer, seq_len=16, seed=seed)


def test_mlm_batches_are_framed_windows_and_deterministic(tokenizer):
    source = _mlm_source(tokenizer)
    batch = source.get_batch("train", 3, 8)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (8, 16)
    labels = batch["labels"]
    assert torch.all(batch["input_ids"][:, 0] == tokenizer.cls_id)
    assert torch.all(batch["input_ids"][:, -1] == tokenizer.sep_id)
    assert torch.all(labels[:, [0, -1]] == IGNORE_INDEX)
    original = torch.where(labels == IGNORE_INDEX, batch["input_ids"], labels)[:, 1:-1]
    assert torch.all(original[:, 1:] - original[:, :-1] == 1)  # consecutive tokens of the stream
    again = _mlm_source(tokenizer).get_batch("train", 3, 8)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(batch["input_ids"], source.get_batch("train", 4, 8)["input_ids"])
    assert not torch.equal(batch["input_ids"], _mlm_source(tokenizer, seed=1).get_batch("train", 3, 8)["input_ids"])


def test_mlm_source_refuses_a_split_shorter_than_a_window(tokenizer):
    with pytest.raises(ValueError, match="val split"):
        MLMBatchSource(np.arange(5, 100), np.arange(5, 10), tokenizer, seq_len=16)
    with pytest.raises(ValueError, match="split"):
        _mlm_source(tokenizer).get_batch("test", 0, 2)


def test_encode_stream_drops_the_framing(tokenizer):
    from plainformer.data.corpus import split_text

    split = split_text("the winter of our discontent\n\n\n\nmade glorious summer\n\n\n\nby this sun of York\n")
    stream = encode_stream(split, "val", tokenizer)
    assert stream.tolist() == tokenizer.encode("by this sun of York")[1:-1]
