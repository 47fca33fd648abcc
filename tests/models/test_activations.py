"""The per-token terms the families' memory estimates add up (models/activations.py), against the module
docstring's formulas worked by hand on small numbers: d_kv, the attention weights where they are
materialised (w), the FFN's hidden states (a · d_ff), dropout's masks (r), a layer's total, a decoder's
cross-attention, and a forward pass without autograd. How close the totals come to what autograd keeps
is tested per family in tests/models/test_memory.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import plainformer as pf
from plainformer.models import activations

SHAPE = dict(vocab_size=53, block_size=24, n_layers=2, n_heads=4, d_model=32, d_ff=64)


def test_the_key_width_is_n_kv_heads_head_widths():
    assert activations.kv_width(pf.GPTConfig(**SHAPE, n_kv_heads=2)) == 2 * 8
    assert activations.kv_width(pf.GPTConfig(**SHAPE)) == 32  # n_kv_heads None: every head
    assert activations.kv_width(SimpleNamespace(n_heads=4, d_model=32)) == 32  # a config without the field


@pytest.mark.parametrize("dropout, backend, keys, expected", [
    (0.1, "flash", 100, 3 * 4 * 100),  # the weights, the dropped weights, the mask: whatever the backend
    (0.0, "math", 1000, 4 * 1000),
    (0.0, "auto", 512, 4 * 512 // 2),  # the math path in bfloat16: half the bytes
    (0.0, "auto", 513, 0),  # the fused kernel beyond 512 keys
    (0.0, "sdpa", 100, 0),
    (0.0, "flash", 100, 0),
])
def test_the_attention_weights_count_where_they_are_materialised(dropout, backend, keys, expected):
    assert activations.scores(SimpleNamespace(n_heads=4, backend=backend, dropout=dropout), keys) == expected


def test_the_attention_dropout_of_a_config_that_has_one_decides_over_its_dropout():
    c = SimpleNamespace(n_heads=4, backend="sdpa", dropout=0.1, attention_dropout=0.0)
    assert activations.scores(c, 100) == 0
    assert activations.scores(SimpleNamespace(**{**vars(c), "attention_dropout": 0.1}), 100) == 3 * 4 * 100


@pytest.mark.parametrize("activation, expected", [("swiglu", 4 * 10), ("relu", 2 * 10), ("gelu", 2 * 10),
                                                  ("gelu_tanh", 2 * 10)])
def test_the_ffn_keeps_two_hidden_states_or_four_for_swiglu(activation, expected):
    assert activations.hidden(activation, 10) == expected


def test_dropout_keeps_its_masks_and_the_dropped_hidden_state_only_when_on():
    assert activations.dropout(SimpleNamespace(dropout=0.0, d_model=7), 10) == 0
    assert activations.dropout(SimpleNamespace(dropout=0.1, d_model=7), 10) == 12 + 3  # 5/4 · 10, 7/2, floored


def test_a_layer_keeps_the_sum_of_its_terms_per_token():
    c = pf.GPTConfig(**SHAPE, n_kv_heads=2, activation="swiglu", dropout=0.1)
    # 7 d + 2 d_kv + 4 d_ff + 3 h n + (5/4 d_ff + d/2), with n = 16 keys
    assert activations.layer_activations(c, 16) == 7 * 32 + 2 * 16 + 4 * 64 + 3 * 4 * 16 + (80 + 16) == 800


def test_cross_attention_keeps_five_widths_and_its_weights_per_target_token():
    c = pf.TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, n_layers=1, d_model=16, n_heads=4, d_ff=32,
                             max_len=12, backend="math", dropout=0.0)
    assert activations.cross_activations(c, 10) == 5 * 16 + 4 * 10


def test_a_forward_pass_keeps_one_layers_transients_and_the_float32_logits():
    c = pf.GPTConfig(**SHAPE, n_kv_heads=2)
    # rows · n · (itemsize · (4 d + 2 d_kv + 2 d_ff + h n) + 4 · 2 V), with 2 rows of 16 tokens in bfloat16
    expected = 2 * 16 * (2 * (4 * 32 + 2 * 16 + 2 * 64 + 4 * 16) + 4 * 2 * 53)
    assert activations.forward_pass(c, 2, 16, 2, 53) == expected == 36_096
    assert activations.forward_pass(c, 2, 16, 2, 0) == 2 * 16 * 2 * 352  # no logits: a pooled head, or none
