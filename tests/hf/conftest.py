"""Fixtures of the Hugging Face tests: corpus lines, and tokenizers trained on the bundled corpus."""

from __future__ import annotations

import pytest
import tokenizers as tokenizers_lib

import plainformer as pf


@pytest.fixture(scope="module")
def corpus_lines() -> list[str]:
    lines = [line for line in pf.load_text().splitlines() if line.strip()]
    return lines[:1000]


@pytest.fixture(scope="module")
def tokenizers(corpus_lines):
    text = pf.load_text()[:200_000]
    return {"char": pf.CharTokenizer(pf.load_text()),
            "bpe": pf.BPETokenizer.train(text, 400, special_tokens=("pad", "eos")),
            "wordpiece": pf.WordPieceTokenizer.train(text, 400)}


@pytest.fixture(scope="module")
def gpt2_bpe():
    """A GPT-2 style byte-level BPE trained with `tokenizers` itself, without a special token in its
    vocabulary (GPT2Tokenizer adds <|endoftext|>, as ours must)."""
    tok = tokenizers_lib.Tokenizer(tokenizers_lib.models.BPE())
    tok.pre_tokenizer = tokenizers_lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers_lib.trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=tokenizers_lib.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([pf.load_text()[:200_000]], trainer=trainer)
    return tok
