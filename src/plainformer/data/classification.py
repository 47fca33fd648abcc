"""A sentence-classification task built offline from the bundled corpus: which play is a spoken
line from? Lines are assigned to train/validation by a hash of their text, so the split is stable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _checks
from .corpus import SPLITS, bundled_works, check_batch_index, load_text
from .mlm import _check_wordpiece, _generator
from .tokenizers import WordPieceTokenizer

DEFAULT_PLAYS = ("Macbeth", "A Midsummer Night's Dream")


# Speaker names, headings and cast lists open with a word in capitals ("MACBETH.", "ACT I.").
_SPEAKER = re.compile(r"^[A-Z]{2,}(?![a-z'])")


@dataclasses.dataclass(frozen=True)
class LineTask:
    """Lines of text labelled by the work they come from; `classes[label]` names the work."""

    classes: tuple[str, ...]
    train: tuple[tuple[str, int], ...]
    val: tuple[tuple[str, int], ...]

    def examples(self, split: str) -> tuple[tuple[str, int], ...]:
        return self.train if _checks.check_choice("split", split, SPLITS) == "train" else self.val

    def majority_baseline(self, split: str = "val") -> float:
        """Accuracy of always answering the most frequent class of `split`."""
        counts = Counter(label for _, label in self.examples(split))
        return max(counts.values()) / sum(counts.values())


def spoken_lines(text: str, min_words: int = 4) -> list[str]:
    """Lines of dialogue: at least min_words words, not a speaker name, heading or stage direction."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if len(line.split()) >= min_words and "[" not in line
            and "]" not in line and not _SPEAKER.match(line)]


def _in_val(line: str, val_fraction: float) -> bool:
    """A line's split is a function of its text alone, so a repeated line never straddles splits."""
    digest = hashlib.sha256(line.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2 ** 64 < val_fraction


def play_lines_task(plays: Sequence[str] = DEFAULT_PLAYS, *, val_fraction: float = 0.2,
                    min_words: int = 4) -> LineTask:
    """Which of the bundled corpus's `plays` (titles as in corpus/works.tsv) a line of dialogue comes from.

    A line whose text occurs in two of the plays is dropped (its label would be ambiguous); repeats
    within a play are kept once. Lines are assigned to validation by a hash of their text.
    """
    text = load_text()
    works = {work.title: work for work in bundled_works(text)}
    if len(plays) < 2 or len(set(plays)) != len(plays):
        raise ValueError(f"plays must name at least two different works, got {list(plays)}")
    unknown = [title for title in plays if title not in works]
    if unknown:
        raise ValueError(f"unknown play {unknown[0]!r}; the bundled works are: {', '.join(works)}")
    _checks.check_probability("val_fraction", val_fraction)
    labels: dict[str, set[int]] = {}
    for label, title in enumerate(plays):
        for line in spoken_lines(text[works[title].start:works[title].end], min_words):
            labels.setdefault(line, set()).add(label)
    examples = sorted((line, found.pop()) for line, found in labels.items() if len(found) == 1)
    val = tuple(e for e in examples if _in_val(e[0], val_fraction))
    train = tuple(e for e in examples if not _in_val(e[0], val_fraction))
    if not train or not val:
        raise ValueError(f"val_fraction={val_fraction} leaves an empty split "
                         f"({len(train)} training, {len(val)} validation lines)")
    return LineTask(tuple(plays), train, val)


class ClassificationBatchSource:
    """Batches of a `LineTask`, encoded as [CLS] line [SEP] and padded to the batch's longest.

    "train": B examples drawn uniformly with a generator seeded by (seed, "train", index).
    "val": the i-th slice of B examples in order, i = index mod ceil(N/B) (the last one may be shorter),
    so that indices 0 .. ceil(N/B) - 1 cover the validation lines exactly once.
    Returns {"input_ids", "attention_mask", "token_type_ids"} (B, n) and "labels" (B,).
    """

    def __init__(self, task: LineTask, tokenizer: WordPieceTokenizer, max_len: int, *, seed: int = 0):
        self.task, self.tokenizer = task, _check_wordpiece(tokenizer)
        self.max_len = _checks.check_positive_int("max_len", max_len)
        self.seed = seed

    def num_batches(self, split: str, batch_size: int) -> int:
        """Batches that cover `split` once."""
        return -(-len(self.task.examples(split)) // batch_size)

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        examples = self.task.examples(split)
        check_batch_index(index, batch_size)
        if split == "train":
            rows = torch.randint(0, len(examples), (batch_size,),
                                 generator=_generator(self.seed, split, index)).tolist()
        else:
            start = index % self.num_batches(split, batch_size) * batch_size
            rows = list(range(start, min(start + batch_size, len(examples))))
        batch = self.tokenizer.encode_batch([examples[r][0] for r in rows], max_length=self.max_len)
        return {**batch, "labels": torch.tensor([examples[r][1] for r in rows], dtype=torch.long)}
