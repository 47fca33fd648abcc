"""Evaluation of trained models: language-model validation loss, accuracy, BLEU.

Each function puts the model in eval mode for the call (dropout off) and restores its mode after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import _checks
from ..constants import IGNORE_INDEX  # labels that are not scored
from ..nn.dtypes import at_least_float32
from ..nn.modes import eval_mode


@dataclasses.dataclass(frozen=True)
class Selection:
    """What chooses a run's best/ in place of the lowest validation loss: `score(model) -> {metric: value}`,
    run by the Trainer at each evaluation (the model in eval mode, without autograd, every rank alike; every
    value is logged as val_<metric>), and `metric`, the one of them whose best value keeps best/: the highest
    where `higher_is_better` (BLEU, accuracy), else the lowest. A "loss" among the scores, computed in the same
    pass over the validation data, is the run's validation loss; without one the Trainer computes its own."""

    score: Callable[[nn.Module], Mapping[str, float]]
    metric: str
    higher_is_better: bool = True

    def improves(self, value: float, best: float | None) -> bool:
        """Whether `value` is better than `best` (None: nothing yet); a NaN never is."""
        if best is None:
            return not math.isnan(value)
        return value > best if self.higher_is_better else value < best


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode and without autograd inside the block, in its previous mode after."""
    with eval_mode(model), torch.inference_mode():
        yield model


def validation_loss(model: nn.Module, tokens: np.ndarray, block_size: int, batch_size: int
                    ) -> tuple[float, int]:
    """Mean next-token cross entropy over every token of `tokens` after the first:

        loss = -1/(N-1) · Σ_{t=1}^{N-1} log p(x_t | x_{w(t)} .. x_{t-1}),

    predicted in consecutive windows of `block_size` tokens, each starting its context afresh
    (w(t) = the start of t's window). `model(idx)` maps (B, T) token ids to (B, T, V) logits first.
    Returns (loss, tokens scored = N - 1)."""
    _checks.check_positive_int("block_size", block_size)
    _checks.check_positive_int("batch_size", batch_size)
    if len(tokens) < 2:
        raise ValueError(f"the validation split has {len(tokens)} token(s); next-token loss needs at least 2: "
                         "give more text (or a larger validation share)")
    n_full = (len(tokens) - 1) // block_size
    scored = n_full * block_size  # tokens predicted in full windows
    inputs = np.asarray(tokens[:scored], dtype=np.int64).reshape(n_full, block_size)  # (W, T)
    targets = np.asarray(tokens[1:scored + 1], dtype=np.int64).reshape(n_full, block_size)  # (W, T)
    chunks = [(inputs[i:i + batch_size], targets[i:i + batch_size]) for i in range(0, n_full, batch_size)]
    if len(tokens) - 1 > scored:  # a last, shorter window: (1, < T)
        chunks.append((np.asarray(tokens[scored:-1], dtype=np.int64)[None],
                       np.asarray(tokens[scored + 1:], dtype=np.int64)[None]))
    total, count = 0.0, 0
    with evaluating(model):
        for chunk_inputs, chunk_targets in chunks:
            logits = model(torch.from_numpy(np.array(chunk_inputs)))[0]  # (B, T, V); np.array: a writable copy
            expected = torch.from_numpy(np.array(chunk_targets))  # (B, T)
            total += float(torch.nn.functional.cross_entropy(
                at_least_float32(logits.flatten(0, 1)), expected.flatten(), reduction="sum"))
            count += expected.numel()
    return total / count, count


def accuracy(model: nn.Module, source: Any, n_batches: int, batch_size: int) -> float:
    """Fraction of labelled targets (labels != -100) whose argmax logit is right, over the validation
    batches 0 .. n_batches-1 of `source` (`get_batch("val", index, batch_size)`). `model(**batch)`
    returns (logits, loss) with logits (N, C) for the N labelled targets of the batch in order: the
    masked tokens of a masked LM, the lines of a classifier."""
    correct = total = 0
    with evaluating(model):
        for index in range(n_batches):
            batch = source.get_batch("val", index, batch_size)
            logits, _ = model(**batch)
            labels = batch["labels"]
            targets = labels[labels != IGNORE_INDEX]  # (N,)
            correct += int((logits.argmax(dim=-1) == targets).sum())
            total += targets.numel()
    if total == 0:
        raise ValueError(f"accuracy needs labelled targets; the {n_batches} validation batches have none")
    return correct / total


BLEU_TOKENIZERS = ("13a", "char")


def score_translations(model: nn.Module, sources: Sequence[str], references: Sequence[str], *,
                       beam_size: int = 1, length_penalty: float = 0.6, batch_size: int = 100,
                       tokenize: str = "13a", target_lang: str | None = None) -> dict[str, Any]:
    """Translate `sources` with `model.translate` and compare with `references` (`translation_scores`), and
    time it."""
    if len(sources) != len(references) or not references:
        raise ValueError(f"sources and references must be equally long and non-empty, got "
                         f"{len(sources)} and {len(references)}")
    _checks.check_choice("tokenize", tokenize, BLEU_TOKENIZERS)
    start = time.perf_counter()
    with evaluating(model):
        hypotheses = model.translate(  # type: ignore[operator]  # any module with a translate method
            list(sources), beam_size=beam_size, length_penalty=length_penalty, batch_size=batch_size)
    elapsed = time.perf_counter() - start
    return {**translation_scores(hypotheses, references, tokenize=tokenize, target_lang=target_lang),
            "sentences": len(references), "beam": beam_size, "decode_s": elapsed,
            "sentences_per_s": len(references) / max(elapsed, 1e-9)}


def translation_scores(hypotheses: Sequence[str], references: Sequence[str], *, tokenize: str = "13a",
                       target_lang: str | None = None) -> dict[str, float]:
    """Corpus scores of `hypotheses` against `references` (one each), with sacrebleu:

    - bleu: BLEU (Papineni et al. 2002), 0 .. 100, on sacrebleu's 13a word tokens of the cased, detokenized
      text (its defaults), or with tokenize="char" on characters;
    - chrf: chrF (Popović 2015), the character n-gram F-score, 0 .. 100;
    - tokenized_bleu, given `target_lang`: BLEU of both sides lowercased, punctuation-normalised and
      tokenized as Moses' scripts do (sacremoses' MosesPunctNormalizer and MosesTokenizer(escape=True)),
      scored without further tokenization: the "tokenized BLEU" papers on Multi30k report;
    - exact_match: the fraction of sentences translated exactly.
    """
    import sacrebleu

    _checks.check_choice("tokenize", tokenize, BLEU_TOKENIZERS)
    if len(hypotheses) != len(references) or not references:
        raise ValueError(f"hypotheses and references must be equally long and non-empty, got "
                         f"{len(hypotheses)} and {len(references)}")
    hypotheses, references = list(hypotheses), list(references)
    scores = {"bleu": sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize).score,
              "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
              "exact_match": sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)}
    if target_lang is not None:
        moses = moses_tokenized(target_lang)
        tokenized = [moses(h) for h in hypotheses], [moses(r) for r in references]
        scores["tokenized_bleu"] = sacrebleu.corpus_bleu(tokenized[0], [tokenized[1]], tokenize="none").score
    return scores


def moses_tokenized(lang: str) -> Callable[[str], str]:
    """text -> lowercased, Moses-normalised, Moses-tokenized (with Moses' escapes), as the scripts
    `lowercase.perl | normalize-punctuation.perl -l L | tokenizer.perl -l L` write it."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return lambda text: tokenizer.tokenize(normalizer.normalize(text.lower()), escape=True, return_str=True)


def mean_loss(model: nn.Module, source: Any, n_batches: int, batch_size: int) -> float:
    """Mean of the losses `model(**batch)` returns over the validation batches 0 .. n_batches-1 of
    `source`: the trainer's validation loss, computed in the weights' precision."""
    with evaluating(model):
        losses = [at_least_float32(model(**source.get_batch("val", index, batch_size))[1])
                  for index in range(n_batches)]
    return float(torch.stack(losses).mean())
