"""Tiny shapes of each family's config, shared by the tests of what a model holds and needs."""

from __future__ import annotations

GPT_TINY = dict(vocab_size=53, block_size=24, n_layers=3, n_heads=4, d_model=32, d_ff=64)
BERT_TINY = dict(vocab_size=99, max_len=16, n_layers=2, n_heads=2, d_model=8, d_ff=16, n_labels=3)
SEQ2SEQ_TINY = dict(src_vocab_size=40, tgt_vocab_size=40, n_layers=2, d_model=16, n_heads=4, d_ff=32, max_len=12)
