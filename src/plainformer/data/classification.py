"""Sentence classification data for a BERT: labelled examples (single sentences or sentence pairs), encoded
once and batched by length; and a task built offline from the bundled corpus, which play a spoken line is
from (`play_lines_task`). Users' own labelled files are read by `labelled.py` into the same form.

A text is encoded as [CLS] a [SEP], a pair as [CLS] a [SEP] b [SEP] with token type 0 up to the first [SEP]
and 1 after it, truncated longest-first to max_len tokens: what Hugging Face's BertTokenizerFast gives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .. import _checks
from .corpus import SPLITS, bundled_works, check_batch_index, load_text
from .mlm import _check_wordpiece, _generator
from .tokenizers import WordPieceTokenizer

DEFAULT_PLAYS = ("Macbeth", "A Midsummer Night's Dream")
#: Training batches are drawn GROUP_BATCHES at a time, whose rows are sorted by length before they are cut
#: into batches (Hugging Face's group_by_length takes 50 too): a batch pads to a length close to its rows'.
GROUP_BATCHES = 50
_ENCODE_CHUNK = 8192  # rows handed to the tokenizer at once: its objects for a whole corpus would be large


@dataclasses.dataclass(frozen=True)
class Examples:
    """One split: texts[i] (with pairs[i], the second sentence of a pair task) is of class labels[i]."""

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    pairs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.texts) or (self.pairs is not None and len(self.pairs) != len(self.texts)):
            raise ValueError(f"texts, labels and pairs must be equally long, got {len(self.texts)}, "
                             f"{len(self.labels)} and {None if self.pairs is None else len(self.pairs)}")

    def __len__(self) -> int:
        return len(self.texts)


@dataclasses.dataclass(frozen=True)
class ClassificationData:
    """Training and validation examples of `classes` (label i names classes[i]); `blank_lines`: those of the
    files read, skipped."""

    classes: tuple[str, ...]
    train: Examples
    val: Examples
    blank_lines: int = 0

    def examples(self, split: str) -> Examples:
        return self.train if _checks.check_choice("split", split, SPLITS) == "train" else self.val

    def counts(self, split: str) -> dict[str, int]:
        """Examples of each class in `split`, in class order."""
        counts = Counter(self.examples(split).labels)
        return {name: counts[label] for label, name in enumerate(self.classes)}

    def majority_baseline(self, split: str = "val") -> float:
        """Accuracy of always answering the most frequent class of `split`."""
        counts = self.counts(split)
        return max(counts.values()) / sum(counts.values())


# ----------------------------------------------------------------------------- encoding and batches

class EncodedTexts:
    """Texts (and their pairs) encoded once by a WordPiece tokenizer, truncated to `max_len` tokens, kept as
    one flat array; `batch(rows)` pads the rows asked for to the longest of them."""

    def __init__(self, tokenizer: WordPieceTokenizer, texts: Sequence[str], pairs: Sequence[str] | None = None,
                 max_len: int | None = None):
        tokenizer = _check_wordpiece(tokenizer)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        ids: list[np.ndarray] = []
        second: list[int] = []  # where each row's type-1 tokens start (its length without a pair)
        for start in range(0, len(texts), _ENCODE_CHUNK):
            chunk_pairs = None if pairs is None else pairs[start:start + _ENCODE_CHUNK]
            for row_ids, types in tokenizer.encode_each(texts[start:start + _ENCODE_CHUNK], max_len, chunk_pairs):
                ids.append(np.asarray(row_ids, dtype=np.int32))
                second.append(types.index(1) if 1 in types else len(row_ids))
        self.lengths = np.array([len(row) for row in ids], dtype=np.int64)  # (N,)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)])  # (N + 1,)
        self._ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
        self._second = np.array(second, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, rows: Sequence[int] | np.ndarray) -> dict[str, Tensor]:
        """input_ids (B, n) long, attention_mask (B, n) bool and token_type_ids (B, n) long of `rows`, right-
        padded (pad id, type 0) to n, the longest of them."""
        rows = np.asarray(rows, dtype=np.int64)
        n = int(self.lengths[rows].max())
        input_ids = np.full((len(rows), n), self.pad_id, dtype=np.int64)
        types = np.zeros((len(rows), n), dtype=np.int64)
        for j, row in enumerate(rows):
            start, length = self._offsets[row], self.lengths[row]
            input_ids[j, :length] = self._ids[start:start + length]
            types[j, self._second[row]:length] = 1
        mask = np.arange(n)[None, :] < self.lengths[rows][:, None]  # (B, n)
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                "token_type_ids": torch.from_numpy(types)}

    def by_length(self, batch_size: int) -> list[np.ndarray]:
        """Every row once, in batches of `batch_size` (the last may be shorter) of the shortest rows first:
        the order that pads least."""
        order = np.argsort(self.lengths, kind="stable")
        return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


class ClassificationBatchSource:
    """Batches of a `ClassificationData`, each text encoded once as [CLS] a [SEP] (b [SEP]), at most `max_len`
    tokens, padded to the longest of its batch. Returns {"input_ids", "attention_mask", "token_type_ids"}
    (B, n) and "labels" (B,).

    "train": the training rows in epochs, each in an order shuffled by (seed, epoch), read as one stream;
    every GROUP_BATCHES batches' rows of it are sorted by length, cut into batches, and the batches shuffled
    by (seed, group): batch `index` is a function of (seed, index, batch_size), and pads little.
    "val": the validation rows sorted by length and cut into ceil(N/B) batches, taken in an order shuffled by
    the seed (so that batch 0 is of a typical length, as the kernels measured on it want): batch index mod
    ceil(N/B), so that indices 0 .. ceil(N/B) - 1 cover the validation examples exactly once.
    """

    def __init__(self, data: ClassificationData, tokenizer: WordPieceTokenizer, max_len: int, *, seed: int = 0):
        self.data = data
        self.max_len = _checks.check_positive_int("max_len", max_len)
        self.seed = seed
        self.encoded = {split: EncodedTexts(tokenizer, data.examples(split).texts, data.examples(split).pairs,
                                            max_len) for split in SPLITS}
        self._labels = {split: np.asarray(data.examples(split).labels, dtype=np.int64) for split in SPLITS}
        self._group: tuple[int, int, list[np.ndarray]] | None = None  # (batch size, group, its batches)
        self._val_batches: dict[int, list[np.ndarray]] = {}  # batch size -> the validation batches
        self._orders: dict[int, np.ndarray] = {}  # the row order of the epochs drawn lately

    def num_batches(self, split: str, batch_size: int) -> int:
        """Batches that cover `split` once."""
        return -(-len(self.data.examples(split)) // batch_size)

    def _val_rows(self, index: int, batch_size: int) -> np.ndarray:
        if batch_size not in self._val_batches:
            batches = self.encoded["val"].by_length(batch_size)
            order = torch.randperm(len(batches), generator=_generator(self.seed, "val", batch_size)).tolist()
            self._val_batches[batch_size] = [batches[i] for i in order]
        batches = self._val_batches[batch_size]
        return batches[index % len(batches)]

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        check_batch_index(index, batch_size)
        if _checks.check_choice("split", split, SPLITS) == "train":
            rows = self._train_rows(index, batch_size)
        else:
            rows = self._val_rows(index, batch_size)
        return {**self.encoded[split].batch(rows), "labels": torch.from_numpy(self._labels[split][rows])}

    def _train_rows(self, index: int, batch_size: int) -> np.ndarray:
        group, within = divmod(index, GROUP_BATCHES)
        if self._group is None or self._group[:2] != (batch_size, group):
            self._group = (batch_size, group, self._group_batches(group, batch_size))
        return self._group[2][within]

    def _group_batches(self, group: int, batch_size: int) -> list[np.ndarray]:
        """The GROUP_BATCHES batches of `group`: its rows of the stream, sorted by length, cut, shuffled."""
        rows_per_group = GROUP_BATCHES * batch_size
        positions = np.arange(group * rows_per_group, (group + 1) * rows_per_group)
        n = len(self.data.train)
        epochs = positions // n
        rows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            rows[epochs == epoch] = self._epoch_order(int(epoch))[positions[epochs == epoch] % n]
        rows = rows[np.argsort(self.encoded["train"].lengths[rows], kind="stable")]
        batches = [rows[start:start + batch_size] for start in range(0, rows_per_group, batch_size)]
        shuffled = torch.randperm(GROUP_BATCHES, generator=_generator(self.seed, "train-group", group)).tolist()
        return [batches[i] for i in shuffled]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            generator = _generator(self.seed, "train", epoch)
            self._orders[epoch] = torch.randperm(len(self.data.train), generator=generator).numpy()
        return self._orders[epoch]


# ----------------------------------------------------------------------------- which play is a line from?

# Speaker names, headings and cast lists open with a word in capitals ("MACBETH.", "ACT I.").
_SPEAKER = re.compile(r"^[A-Z]{2,}(?![a-z'])")


def spoken_lines(text: str, min_words: int = 4) -> list[str]:
    """Lines of dialogue: at least min_words words, not a speaker name, heading or stage direction."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if len(line.split()) >= min_words and "[" not in line
            and "]" not in line and not _SPEAKER.match(line)]


def _in_val(line: str, val_fraction: float) -> bool:
    """A line's split is a function of its text alone, so a repeated line never straddles splits."""
    digest = hashlib.sha256(line.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2 ** 64 < val_fraction


def _examples(pairs: list[tuple[str, int]]) -> Examples:
    return Examples(tuple(text for text, _ in pairs), tuple(label for _, label in pairs))


def play_lines_task(plays: Sequence[str] = DEFAULT_PLAYS, *, val_fraction: float = 0.2,
                    min_words: int = 4) -> ClassificationData:
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
    val = [e for e in examples if _in_val(e[0], val_fraction)]
    train = [e for e in examples if not _in_val(e[0], val_fraction)]
    if not train or not val:
        raise ValueError(f"val_fraction={val_fraction} leaves an empty split "
                         f"({len(train)} training, {len(val)} validation lines)")
    return ClassificationData(tuple(plays), _examples(train), _examples(val))
