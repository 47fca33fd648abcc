"""Masked-language-model batches for BERT (Devlin et al. 2019, section 3.1).

Masking: each token that is neither special ([CLS], [SEP], [PAD], ...) nor padding is selected with
probability p = 0.15; a selected token is replaced by [MASK] with probability 0.8, by a token drawn
uniformly from the non-special vocabulary with probability 0.1, and left as it is with probability
0.1. labels hold the original token at selected positions and -100 (ignored by the loss) elsewhere.

Every batch source here is deterministic in (seed, split, index), as the trainer requires: batch
`index` is drawn with a generator seeded from those three values alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .. import _checks
from ..constants import IGNORE_INDEX
from .corpus import SPLITS, TextSplit, check_batch_index, stable_seed
from .tokenizers import WordPieceTokenizer

SELECT_PROB = 0.15


MASK_PROB = 0.8


RANDOM_PROB = 0.1


def mask_tokens(input_ids: Tensor, *, mask_id: int, special_ids: Sequence[int], vocab_size: int,
                generator: torch.Generator | None = None, attention_mask: Tensor | None = None,
                select_prob: float = SELECT_PROB, mask_prob: float = MASK_PROB,
                random_prob: float = RANDOM_PROB) -> tuple[Tensor, Tensor]:
    """BERT's masking of input_ids (B, n) -> (masked input_ids (B, n), labels (B, n)).

    Positions holding one of `special_ids`, or False in attention_mask (padding), are never selected.
    Random replacements are drawn from the ids in [0, vocab_size) that are not special.
    """
    _checks.check_token_ids("input_ids", input_ids, vocab_size)
    for name, p in (("select_prob", select_prob), ("mask_prob", mask_prob), ("random_prob", random_prob)):
        _checks.check_probability(name, p)
    if mask_prob + random_prob > 1.0:
        raise ValueError(f"mask_prob + random_prob must be at most 1, got {mask_prob} + {random_prob}")
    special = torch.as_tensor(list(special_ids), dtype=input_ids.dtype, device=input_ids.device)
    if mask_id not in special:
        raise ValueError(f"mask_id ({mask_id}) must be one of special_ids {list(special_ids)}")
    eligible = ~torch.isin(input_ids, special)
    if attention_mask is not None:
        eligible &= attention_mask.bool()

    def uniform() -> Tensor:
        return torch.rand(input_ids.shape, generator=generator, device=input_ids.device)

    selected = eligible & (uniform() < select_prob)
    action = uniform()  # < mask_prob: [MASK]; next random_prob: random token; rest: unchanged
    to_mask = selected & (action < mask_prob)
    to_random = selected & (action >= mask_prob) & (action < mask_prob + random_prob)
    candidates = _non_special_ids(vocab_size, special)
    random_tokens = candidates[torch.randint(len(candidates), input_ids.shape, generator=generator,
                                             device=input_ids.device)]
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(to_random, random_tokens, masked)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return masked, labels


def _non_special_ids(vocab_size: int, special: Tensor) -> Tensor:
    """The ids in [0, vocab_size) that are not in `special`, ascending, in special's dtype."""
    ordinary = torch.ones(vocab_size, dtype=torch.bool, device=special.device)
    ordinary[special.long()] = False
    return ordinary.nonzero().squeeze(1).to(special.dtype)


def _generator(seed: int, split: str, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(seed, split, index))


def _check_wordpiece(tokenizer: object) -> WordPieceTokenizer:
    if not isinstance(tokenizer, WordPieceTokenizer):
        raise TypeError(f"tokenizer must be a WordPieceTokenizer, got {type(tokenizer).__name__}")
    return tokenizer


def encode_stream(split: TextSplit, which: str, tokenizer: WordPieceTokenizer) -> np.ndarray:
    """The wordpieces of one split as one stream (N,) int32, without [CLS]/[SEP] framing."""
    _check_wordpiece(tokenizer)
    pieces = [np.asarray(tokenizer.encode(chunk)[1:-1], dtype=np.int32) for chunk in split.chunks(which)]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class MLMBatchSource:
    """Masked-LM batches: windows of seq_len - 2 consecutive wordpieces framed as [CLS] ... [SEP].

    get_batch(split, index, batch_size) draws B window starts uniformly with a generator seeded by
    (seed, split, index), masks them with `mask_tokens` using the same generator, and returns
    {"input_ids": (B, seq_len) long, "labels": (B, seq_len) long}. Windows are never padded.
    """

    def __init__(self, train_tokens: np.ndarray, val_tokens: np.ndarray, tokenizer: WordPieceTokenizer,
                 seq_len: int, *, seed: int = 0, select_prob: float = SELECT_PROB):
        self.tokenizer = _check_wordpiece(tokenizer)
        self.seq_len = _checks.check_positive_int("seq_len", seq_len)
        if seq_len < 3:
            raise ValueError(f"seq_len must be at least 3 ([CLS], one token, [SEP]), got {seq_len}")
        self.seed = _checks.check_int("seed", seed)
        self.select_prob = _checks.check_probability("select_prob", select_prob)
        self.tokens = {"train": np.asarray(train_tokens), "val": np.asarray(val_tokens)}
        for split, tokens in self.tokens.items():
            if tokens.ndim != 1 or len(tokens) < seq_len - 2:
                raise ValueError(f"the {split} split has {len(tokens)} tokens but seq_len={seq_len} needs "
                                 f"at least {seq_len - 2}; use a smaller seq_len or more text")

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        tokens = self.tokens[_checks.check_choice("split", split, SPLITS)]
        check_batch_index(index, batch_size)
        generator = _generator(self.seed, split, index)
        width = self.seq_len - 2
        starts = torch.randint(0, len(tokens) - width + 1, (batch_size,), generator=generator).numpy()
        body = torch.from_numpy(tokens[starts[:, None] + np.arange(width)].astype(np.int64))  # (B, n - 2)
        tok = self.tokenizer
        ids = torch.cat([torch.full((batch_size, 1), tok.cls_id), body,
                         torch.full((batch_size, 1), tok.sep_id)], dim=1)  # (B, n)
        input_ids, labels = mask_tokens(ids, mask_id=tok.mask_id, special_ids=tok.all_special_ids,
                                        vocab_size=tok.vocab_size, generator=generator,
                                        select_prob=self.select_prob)
        return {"input_ids": input_ids, "labels": labels}
