"""Evaluation against independent computations: the windowed validation loss against a float64 loop
over the windows one by one, accuracy against numpy on fixed logits, BLEU against a hand-written
corpus BLEU (Papineni et al. 2002). The GPT is float64: batched windows and one window at a time differ
only in the order of their sums, so the losses agree to 1e-10 whatever the CPU."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

import plainformer as pf
from plainformer.training.evaluation import accuracy, mean_loss, score_translations, validation_loss


@pytest.fixture(scope="module")
def gpt() -> pf.GPT:
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32, dropout=0.3)
    return pf.GPT(config).double()


def _loss_window_by_window(model: pf.GPT, tokens: np.ndarray, block: int) -> tuple[float, int]:
    """Σ -log p(x_t | its window's earlier tokens) in float64, one window at a time."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, block):
            window = torch.as_tensor(tokens[start:start + block + 1], dtype=torch.long)
            logits = model(window[None, :-1])[0][0].double()  # (T, V)
            log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            total -= float(log_p[torch.arange(len(window) - 1), window[1:]].sum())
            count += len(window) - 1
    return total / count, count


# shorter than one window (2, 5, 8 tokens); one window; two exactly; three and a ragged tail
@pytest.mark.parametrize("length", [2, 5, 8, 9, 17, 30])
@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_validation_loss_matches_a_float64_loop_over_windows(gpt, length, batch_size):
    tokens = np.random.default_rng(length).integers(0, 11, length)
    expected, expected_count = _loss_window_by_window(gpt, tokens, 8)
    gpt.train()  # dropout is on outside: validation_loss must switch it off, then restore it
    loss, count = validation_loss(gpt, tokens, 8, batch_size)
    assert gpt.training
    assert count == expected_count == length - 1
    assert loss == pytest.approx(expected, rel=1e-10)


class FixedLogits(nn.Module):
    """A 'model' whose logits for the labelled targets come with the batch."""

    def forward(self, logits, labels):
        assert not self.training
        return logits[labels != -100], None


class Batches:
    def __init__(self, batches):
        self.batches = batches

    def get_batch(self, split, index, batch_size):
        assert split == "val"
        return self.batches[index]


def _random_batches(rng, n_batches, rows=5, classes=4):
    batches = []
    for _ in range(n_batches):
        labels = torch.as_tensor(rng.integers(0, classes, rows))
        labels[torch.as_tensor(rng.random(rows) < 0.3)] = -100
        batches.append({"logits": torch.as_tensor(rng.normal(size=(rows, classes))), "labels": labels})
    return batches


def test_accuracy_counts_right_argmaxes_over_labelled_targets_only():
    rng = np.random.default_rng(0)
    batches = _random_batches(rng, 3)
    right = total = 0
    for batch in batches[:2]:  # only the first n_batches count
        logits, labels = batch["logits"].numpy(), batch["labels"].numpy()
        keep = labels != -100
        right += int((logits[keep].argmax(axis=1) == labels[keep]).sum())
        total += int(keep.sum())
    assert accuracy(FixedLogits(), Batches(batches), 2, 5) == right / total


def test_accuracy_without_labelled_targets_is_an_error():
    batch = {"logits": torch.zeros(2, 3), "labels": torch.full((2,), -100)}
    with pytest.raises(ValueError, match="no"):
        accuracy(FixedLogits(), Batches([batch]), 1, 2)


def test_mean_loss_is_the_mean_of_the_batch_losses(gpt):
    rng = np.random.default_rng(1)
    batches = [{"idx": torch.as_tensor(rng.integers(0, 11, (2, 8))),
                "targets": torch.as_tensor(rng.integers(0, 11, (2, 8)))} for _ in range(3)]
    gpt.eval()
    with torch.no_grad():
        expected = sum(float(gpt(**batch)[1]) for batch in batches) / 3
    assert mean_loss(gpt, Batches(batches), 3, 2) == pytest.approx(expected, rel=1e-10)


class FixedTranslations(nn.Module):
    def __init__(self, outputs):
        super().__init__()
        self.outputs = dict(outputs)

    def translate(self, sources, *, beam_size, length_penalty, batch_size):
        return [self.outputs[source] for source in sources]


def _corpus_bleu(hypotheses, references):
    """BLEU-4 with uniform weights and the brevity penalty, on whitespace tokens."""
    matches, totals = [0] * 4, [0] * 4
    for hyp, ref in zip(hypotheses, references, strict=True):
        h, r = hyp.split(), ref.split()
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, r_grams[g]) for g, c in h_grams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    c, r = sum(len(h.split()) for h in hypotheses), sum(len(x.split()) for x in references)
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    return 100 * brevity * math.exp(sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4)


def test_score_translations_matches_hand_computed_bleu_and_exact_match():
    sources = ["s1", "s2", "s3"]
    references = ["the cat sat on the mat today", "a dog ran in the park", "one two three four five"]
    hypotheses = ["the cat sat on a mat today", "a dog ran in the park", "one two three four"]
    scores = score_translations(FixedTranslations(zip(sources, hypotheses, strict=True)), sources, references)
    assert scores["exact_match"] == 1 / 3 and scores["sentences"] == 3
    assert scores["bleu"] == pytest.approx(_corpus_bleu(hypotheses, references), abs=1e-9)


def test_score_translations_scores_one_word_sentences_by_characters():
    # The symbol tasks' sentences are single words: word BLEU has no 2- to 4-grams there.
    sources = ["s1", "s2"]
    references, hypotheses = ["abcdefghij", "jihgfedcba"], ["abcdefghji", "jihgfedcba"]
    model = FixedTranslations(zip(sources, hypotheses, strict=True))
    scores = score_translations(model, sources, references, tokenize="char")
    by_hand = _corpus_bleu([" ".join(h) for h in hypotheses], [" ".join(r) for r in references])
    assert scores["bleu"] == pytest.approx(by_hand, abs=1e-9) and 60 < by_hand < 100
    assert score_translations(model, sources, references)["bleu"] == 0.0
    with pytest.raises(ValueError, match="tokenize must be one of '13a', 'char'"):
        score_translations(model, sources, references, tokenize="words")


def test_score_translations_needs_one_reference_per_source():
    with pytest.raises(ValueError, match="equally long"):
        score_translations(FixedTranslations({}), ["a", "b"], ["a"])
