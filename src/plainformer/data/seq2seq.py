"""Built-in sequence-to-sequence tasks, generated offline and reproducibly from a seed.

- `copy`: a random string of 1-10 symbols from a-j; the target repeats it (the Annotated Transformer's
  first check that a model trains).
- `reverse`: the same strings; the target is the string reversed.
- `numbers-en-fr`: a number from 0 to 999,999 written out in English words, to be translated into
  French words (`num2words`): "seventy-one thousand and eighty" -> "soixante et onze mille
  quatre-vingts". The number of digits is drawn uniformly, then the number, so small and large
  numbers both occur; French's vigesimal tens (soixante-dix, quatre-vingts) and its agreement rules
  (quatre-vingts but quatre-vingt mille) make it more than word-by-word substitution.

A source sentence belongs to one split for good: the split is a function of the sentence (a seeded
hash), so train, val and test never share a source whatever their sizes. Source and target share one
byte-level BPE tokenizer trained on the training pairs (`train_tokenizer`), and `Seq2SeqBatches`
turns the pairs into length-grouped padded batches for the trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .. import _checks
from .corpus import check_batch_index
from .tokenizers import BPETokenizer

SPLITS = ("train", "val", "test")
SPECIAL_TOKENS = ("pad", "bos", "eos")
_SPLIT_CODES = {split: code for code, split in enumerate(SPLITS)}


@dataclasses.dataclass(frozen=True)
class Seq2SeqTask:
    """(source, target) sentence pairs of each split."""

    name: str
    seed: int
    pairs: Mapping[str, Sequence[tuple[str, str]]]
    tokenizer_vocab_size: int
    bleu_tokenize: str = "13a"  # sacrebleu's tokenisation for BLEU: "char" where a sentence is one word

    def sources(self, split: str) -> list[str]:
        return [source for source, _ in self.pairs[_check_split(split)]]

    def targets(self, split: str) -> list[str]:
        return [target for _, target in self.pairs[_check_split(split)]]


@dataclasses.dataclass(frozen=True)
class _TaskSpec:
    """A task draws keys (a string of symbols, a number) and writes each as a source and a target."""

    draw: Callable[[np.random.Generator], object]
    source: Callable[[object], str]
    target: Callable[[object], str]
    sizes: Mapping[str, int]  # pairs per split
    tokenizer_vocab_size: int  # 256 bytes + 3 special tokens + merges
    bleu_tokenize: str = "13a"


# ----------------------------------------------------------------------------- the tasks

SYMBOLS = "abcdefghij"


def _symbols(rng: np.random.Generator, max_length: int = 10) -> str:
    return "".join(rng.choice(list(SYMBOLS), size=int(rng.integers(1, max_length + 1))))


def _number(rng: np.random.Generator, max_digits: int = 6) -> int:
    """Digits uniform in 1..max_digits, then the number uniform among those with that many."""
    digits = int(rng.integers(1, max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10 ** digits))


def _words(language: str) -> Callable[[object], str]:
    def write(number: object) -> str:
        from num2words import num2words

        return num2words(number, lang=language)

    return write


def _same(key: object) -> str:
    return str(key)


def _reversed(key: object) -> str:
    return str(key)[::-1]


_SYMBOL_SIZES = {"train": 20000, "val": 500, "test": 500}
TASKS: dict[str, _TaskSpec] = {
    # No merges (vocabulary = bytes + specials): one token per symbol.
    # A symbol string is one word, so word BLEU has no 2- to 4-grams to match: BLEU over characters.
    "copy": _TaskSpec(_symbols, _same, _same, _SYMBOL_SIZES, 259, bleu_tokenize="char"),
    "reverse": _TaskSpec(_symbols, _same, _reversed, _SYMBOL_SIZES, 259, bleu_tokenize="char"),
    "numbers-en-fr": _TaskSpec(_number, _words("en"), _words("fr"),
                               {"train": 40000, "val": 500, "test": 1000}, 512),
}


def _check_split(split: str) -> str:
    return _checks.check_choice("split", split, SPLITS)


def split_of(key: object, seed: int) -> str:
    """The split of the sentence written from `key`: 2% test, 2% val, the rest train (a seeded
    hash; keys and sources correspond one to one, so no source is in two splits)."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    bucket = int.from_bytes(digest, "little") % 100
    return "test" if bucket < 2 else "val" if bucket < 4 else "train"


def make_task(name: str, *, seed: int = 0, sizes: Mapping[str, int] | None = None) -> Seq2SeqTask:
    """The pairs of task `name`, the same for the same seed: distinct keys are drawn until each split
    has its size. sizes overrides the number of pairs of some splits, e.g. {"train": 1000}.
    """
    _checks.check_choice("task", name, TASKS)
    spec = TASKS[name]
    sizes = {**spec.sizes, **(sizes or {})}
    for split, size in sizes.items():
        _check_split(split)
        _checks.check_positive_int(f"sizes[{split!r}]", size)
    keys = _draw_keys(spec.draw, sizes, seed)
    pairs = {split: [(spec.source(key), spec.target(key)) for key in keys[split]] for split in SPLITS}
    return Seq2SeqTask(name, seed, pairs, spec.tokenizer_vocab_size, spec.bleu_tokenize)


def _draw_keys(draw: Callable[[np.random.Generator], object], sizes: Mapping[str, int],
               seed: int) -> dict[str, list[object]]:
    """Distinct keys per split in the order drawn. A split smaller than asked means its keys ran
    out: drawing stops after 100 draws per wanted key."""
    rng = np.random.default_rng(seed)
    drawn: dict[str, dict[object, None]] = {split: {} for split in SPLITS}  # ordered sets
    budget = 100 * sum(sizes.values())
    while budget and any(len(drawn[s]) < sizes[s] for s in SPLITS):
        budget -= 1
        key = draw(rng)
        split = split_of(key, seed)
        if len(drawn[split]) < sizes[split]:
            drawn[split][key] = None
    return {split: list(found) for split, found in drawn.items()}


def train_tokenizer(task: Seq2SeqTask) -> BPETokenizer:
    """One byte-level BPE for source and target, learnt on the training pairs; <pad> <bos> <eos>
    take ids 0, 1, 2."""
    texts = (text for pair in task.pairs["train"] for text in pair)
    return BPETokenizer.train(texts, task.tokenizer_vocab_size, special_tokens=SPECIAL_TOKENS)


# ----------------------------------------------------------------------------- batches

class PairBatches:
    """Padded batches of token-id pairs: {"src" (B, m), "tgt_in" (B, n), "tgt_out" (B, n)}, for the trainer.

    src = x_1 .. x_k (then EOS where `source_eos`: Marian's and fairseq's convention), tgt_in = BOS y_1 .. y_l
    and tgt_out = y_1 .. y_l EOS; pad_id fills the rest. `splits` maps a split name to its pairs (lists of ids
    or `parallel.EncodedPairs`, through `pair(split, i)` and `lengths(split)`).

    Sentences of similar length go together (as the paper's batches, section 5.1): each epoch, a seeded
    permutation of the split is cut into pools of `pool_batches` x batch_size pairs, each pool is sorted by
    length and cut into batches of at most batch_size pairs and, with `batch_tokens`, at most that many tokens
    per side, padding counted (rows x the longest side); then the batches are shuffled. Batch `index` of a
    split is its index-th across epochs, so it depends only on (seed, split, index, batch_size). With `max_len`
    (a model's positions) the pairs a side of which is longer are left out; `left_out(split)` counts them.
    """

    def __init__(self, splits: Mapping[str, Any], *, pad_id: int, bos_id: int, eos_id: int, seed: int = 0,
                 pool_batches: int = 32, batch_tokens: int | None = None, source_eos: bool = False,
                 max_len: int | None = None):
        _checks.check_positive_int("pool_batches", pool_batches)
        if batch_tokens is not None:
            _checks.check_positive_int("batch_tokens", batch_tokens)
        self.splits, self.seed, self.pool_batches, self.batch_tokens = dict(splits), seed, pool_batches, batch_tokens
        self.pad_id, self.bos_id, self.eos_id, self.source_eos = pad_id, bos_id, eos_id, source_eos
        self._lengths = {name: self._pair_lengths(pairs) for name, pairs in self.splits.items()}
        self._rows = {name: np.flatnonzero(np.maximum(*lengths) <= (max_len or np.inf))
                      for name, lengths in self._lengths.items()}  # the pairs that fit
        self._epoch_cache: tuple[tuple[str, int, int], list[np.ndarray]] | None = None
        self._counts: dict[tuple[str, int], list[int]] = {}  # (split, batch_size) -> batches of each epoch so far

    def _pair_lengths(self, pairs: Any) -> tuple[np.ndarray, np.ndarray]:
        """The padded width each pair needs on each side: source (+ EOS), target + 1 (BOS, or EOS)."""
        if hasattr(pairs, "lengths"):
            source, target = pairs.lengths()
        else:
            source = np.array([len(s) for s, _ in pairs], dtype=np.int64)
            target = np.array([len(t) for _, t in pairs], dtype=np.int64)
        return source + self.source_eos, target + 1

    def _epoch(self, split: str, epoch: int, batch_size: int) -> list[np.ndarray]:
        """The batches of one epoch; the latest asked for is kept (the trainer reads epochs in order)."""
        key = (split, epoch, batch_size)
        if self._epoch_cache is None or self._epoch_cache[0] != key:
            self._epoch_cache = (key, self._batches(split, epoch, batch_size))
        return self._epoch_cache[1]

    def _locate(self, split: str, index: int, batch_size: int) -> tuple[int, int]:
        """(epoch, batch within it) of batch `index`: epochs differ in length when batches count tokens."""
        counts = self._counts.setdefault((split, batch_size), [])
        epoch = 0
        while True:
            if epoch == len(counts):
                counts.append(len(self._epoch(split, epoch, batch_size)))
            if index < counts[epoch]:
                return epoch, index
            index -= counts[epoch]
            epoch += 1

    def left_out(self, split: str) -> int:
        """The pairs of `split` longer than max_len, in no batch."""
        return len(self._lengths[split][0]) - len(self._rows[split])

    def _batches(self, split: str, epoch: int, batch_size: int) -> list[np.ndarray]:
        source, target = self._lengths[split]
        rng = np.random.default_rng((self.seed, _split_code(split), epoch))
        order = self._rows[split][rng.permutation(len(self._rows[split]))]
        lengths = source + target - 1  # the tokens of the pair, as a task's batches have always sorted them
        pool = batch_size * self.pool_batches
        batches: list[np.ndarray] = []
        for start in range(0, len(order), pool):
            chunk = order[start:start + pool]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            batches += self._cut(chunk, batch_size, source, target)
        rng.shuffle(batches)  # a list of arrays shuffles in place
        return batches

    def _cut(self, rows: np.ndarray, batch_size: int, source: np.ndarray, target: np.ndarray) -> list[np.ndarray]:
        """Consecutive runs of `rows` of at most batch_size pairs and batch_tokens padded tokens a side."""
        if self.batch_tokens is None:
            return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
        batches, start, widest = [], 0, 0
        for end, row in enumerate(rows):
            width = max(widest, int(source[row]), int(target[row]))
            if end > start and (end - start >= batch_size or (end - start + 1) * width > self.batch_tokens):
                batches.append(rows[start:end])
                start, width = end, max(int(source[row]), int(target[row]))
            widest = width
        return batches + [rows[start:]] if len(rows) else batches

    def batches_per_epoch(self, split: str, batch_size: int) -> int:
        return len(self._epoch(split, 0, batch_size))

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        """Batch `index` of `split` (see the class docstring)."""
        if split not in self.splits:
            raise ValueError(f"split must be one of {', '.join(self.splits)}, got {split!r}")
        check_batch_index(index, batch_size)
        if not len(self._rows[split]):
            raise ValueError(f"split {split!r} holds no pair" + (f" within max_len ({self.left_out(split):,} longer)"
                                                                   if self.left_out(split) else ""))
        epoch, within = self._locate(split, index, batch_size)
        rows = self._epoch(split, epoch, batch_size)[within]
        pairs = self.splits[split]
        if hasattr(pairs, "source"):
            return self.collate([(pairs.source(i), pairs.target(i)) for i in rows])
        return self.collate([pairs[i] for i in rows])

    def collate(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, Tensor]:
        """(source ids, target ids) pairs -> the padded batch."""
        def pad(rows: list[Sequence[int]]) -> Tensor:
            return pad_sequence([torch.as_tensor(np.asarray(r, dtype=np.int64)) for r in rows], batch_first=True,
                                padding_value=self.pad_id)

        eos = [self.eos_id] if self.source_eos else []
        return {"src": pad([[*s, *eos] for s, _ in examples]),
                "tgt_in": pad([[self.bos_id, *t] for _, t in examples]),
                "tgt_out": pad([[*t, self.eos_id] for _, t in examples])}


def _split_code(split: str) -> int:
    return _SPLIT_CODES.get(split, len(_SPLIT_CODES))


class Seq2SeqBatches(PairBatches):
    """`PairBatches` of a built-in task's three splits, encoded with `tokenizer` (which has <pad>, <bos>,
    <eos>), batch_size pairs a batch."""

    def __init__(self, task: Seq2SeqTask, tokenizer, *, seed: int = 0, pool_batches: int = 32):
        for role in SPECIAL_TOKENS:
            if getattr(tokenizer, f"{role}_id") is None:
                raise ValueError(f"the tokenizer must have a <{role}> token for sequence-to-sequence "
                                 f"batches; it has {sorted(tokenizer.special_tokens)}")
        self.task, self.tokenizer = task, tokenizer
        splits = {split: [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in task.pairs[split]]
                  for split in SPLITS}
        super().__init__(splits, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                         seed=seed, pool_batches=pool_batches)
