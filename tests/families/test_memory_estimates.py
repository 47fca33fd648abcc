"""The memory estimates of families/memory_estimates.py: exact parameter, tensor and buffer counts against the models
built, training activations against what autograd keeps, optimizer state against the optimizers', the
largest beam that fits. The memory available and the refusal are tested in tests/test_memory.py, a model
refused by its constructor in tests/models/test_family_model.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import plainformer as pf
from plainformer.families import memory_estimates as memory
from plainformer.training.config import TrainConfig
from plainformer.training.optim import make_optimizer, muon_parameters
from tests.reference.tiny_models import BERT_TINY, GPT_TINY, GPT_VARIANTS_49, SEQ2SEQ_TINY

MODELS = {
    "gpt": (pf.GPT, lambda: pf.GPTConfig(**GPT_TINY)),
    "gpt untied, biases": (pf.GPT, lambda: pf.GPTConfig(**GPT_TINY, tie_weights=False, bias=True)),
    "gpt rope, rmsnorm, swiglu, GQA": (pf.GPT, lambda: pf.GPTConfig(**GPT_TINY, pos_encoding="rope", norm="rmsnorm",
                                                                    activation="swiglu", n_kv_heads=2)),
    "gpt sinusoidal": (pf.GPT, lambda: pf.GPTConfig(**GPT_TINY, pos_encoding="sinusoidal")),
    "gpt MoE, shared expert, dense first": (pf.GPT, lambda: pf.GPTConfig(
        **GPT_TINY, n_experts=4, top_k=2, n_shared_experts=1, first_dense_layers=1, moe_every=2)),
    "gpt preset default": (pf.GPT, lambda: pf.GPTConfig.from_preset("default")),
    "gpt issue 49 variants": (pf.GPT, lambda: pf.GPTConfig(**GPT_TINY, **GPT_VARIANTS_49)),
    "gpt issue 49 variants, MoE after a dense first": (pf.GPT, lambda: pf.GPTConfig(
        **GPT_TINY, **GPT_VARIANTS_49, n_experts=4, top_k=2, first_dense_layers=1, moe_every=2)),
    "gpt preset moe": (pf.GPT, lambda: pf.GPTConfig.from_preset("moe")),
    "bert": (pf.BertModel, lambda: pf.BertConfig(**BERT_TINY)),
    "bert-mlm": (pf.BertForMaskedLM, lambda: pf.BertConfig(**BERT_TINY)),
    "bert-cls, swiglu": (pf.BertForSequenceClassification, lambda: pf.BertConfig(**BERT_TINY, activation="swiglu")),
    "transformer shared": (pf.Transformer, lambda: pf.TransformerConfig(**SEQ2SEQ_TINY)),
    "transformer untied": (pf.Transformer, lambda: pf.TransformerConfig(**SEQ2SEQ_TINY, tie_weights=False)),
    "transformer two vocabularies, pre-LN, GQA": (pf.Transformer, lambda: pf.TransformerConfig(
        **{**SEQ2SEQ_TINY, "tgt_vocab_size": 50}, share_embeddings=False, tie_weights=False, norm_first=True,
        n_kv_heads=2, n_encoder_layers=3, n_decoder_layers=1)),
}


def _built(case: str) -> tuple[torch.nn.Module, object]:
    model_cls, config = MODELS[case]
    torch.manual_seed(0)
    built = config()
    return model_cls(built), built


@pytest.mark.parametrize("case", list(MODELS))
def test_the_footprint_counts_what_the_built_model_holds(case):
    model, config = _built(case)
    parameters, buffers = list(model.parameters()), list(model.buffers())
    assert memory.footprint(config, model.family) == memory.Footprint(
        parameters=sum(p.numel() for p in parameters),
        block_matrices=sum(p.numel() for p in muon_parameters(model)),
        tensors=len(parameters) + len(buffers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers))
    assert memory.parameter_count(config, model.family) == sum(p.numel() for p in parameters)
    assert memory.model_bytes(config, family=model.family) == (
        memory.held_bytes(model) + (len(parameters) + len(buffers)) * memory.TENSOR_OVERHEAD)


def test_model_bytes_in_bfloat16_halve_the_parameters_only():
    config = pf.GPTConfig(**GPT_TINY, pos_encoding="rope")
    f = memory.footprint(config)
    assert memory.model_bytes(config) - memory.model_bytes(config, torch.bfloat16) == 2 * f.parameters


def _kept_by_autograd(model: torch.nn.Module, *inputs: torch.Tensor, **keywords: torch.Tensor) -> int:
    """Bytes of the storages autograd saves for backward in one forward, plus the logits and their
    gradient (what the backward holds besides)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(*inputs, **keywords)
    return sum(storages.values()) + 2 * logits.numel() * 4


ACTIVATION_CASES = {
    "gpt": dict(),
    "gpt swiglu, rope": dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu"),
    "gpt math backend": dict(backend="math"),
    "gpt dropout": dict(dropout=0.2),
    "gpt 1024 keys": dict(block_size=1024),
    "gpt MoE": dict(n_experts=4, top_k=2, d_ff=128),
    "gpt large vocabulary": dict(vocab_size=5000),
    "gpt issue 49 variants": GPT_VARIANTS_49,
    "gpt issue 49 variants, rope, GQA": dict(GPT_VARIANTS_49, pos_encoding="rope", norm="rmsnorm", n_kv_heads=2),
    "gpt qk-norm": dict(pos_encoding="rope", norm="rmsnorm", qk_norm=True),
    "gpt attn-softcap": dict(attn_softcap=30.0),
    "gpt alibi": dict(pos_encoding="alibi"),
    "gpt sliding window": dict(sliding_window=32),
}


@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
def test_gpt_activations_are_close_to_what_autograd_keeps(case):
    torch.manual_seed(0)
    config = pf.GPTConfig(**{**dict(vocab_size=65, block_size=128, n_layers=2, n_heads=4, d_model=64, d_ff=256),
                             **ACTIVATION_CASES[case]})
    idx = torch.randint(config.vocab_size, (4, config.block_size))
    kept = _kept_by_autograd(pf.GPT(config).train(), idx, idx)
    assert 0.9 <= memory.activation_bytes(config, 4) / kept <= 1.3


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bert_and_encoder_decoder_activations_are_close_to_what_autograd_keeps(dropout):
    torch.manual_seed(0)
    bert = pf.BertConfig(vocab_size=500, max_len=64, n_layers=2, n_heads=2, d_model=64, d_ff=256, dropout=dropout,
                         attention_dropout=dropout)
    ids = torch.randint(500, (8, 64))
    labels = torch.where(torch.rand(8, 64) < memory.MLM_SELECTED, ids, -100)
    kept = _kept_by_autograd(pf.BertForMaskedLM(bert).train(), ids, labels=labels)
    assert 0.9 <= memory.activation_bytes(bert, 8, family="bert-mlm") / kept <= 1.3
    seq2seq = pf.TransformerConfig(src_vocab_size=300, tgt_vocab_size=300, n_layers=2, d_model=64, n_heads=4,
                                   d_ff=256, max_len=32, dropout=dropout)
    tokens = torch.randint(3, 300, (8, 32))
    kept = _kept_by_autograd(pf.Transformer(seq2seq).train(), tokens, tokens, tokens)
    assert 0.9 <= memory.activation_bytes(seq2seq, 8) / kept <= 1.3


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_optimizer_state_estimated_is_the_optimizers(optimizer):
    model, config = _built("gpt MoE, shared expert, dense first")
    train = TrainConfig(optimizer=optimizer, batch_size=1)
    opt = make_optimizer(model, train)
    _, loss = model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    loss.backward()
    opt.step()
    state = sum(t.numel() for s in opt.state.values() for name, t in s.items() if name != "step")
    f = memory.footprint(config)
    moments = memory.training_bytes(config, 1, optimizer=optimizer) - memory.model_bytes(config) - 4 * f.parameters
    moments -= memory.training_bytes(config, 1, optimizer=optimizer, trainable=0) - memory.model_bytes(config)
    assert moments == 4 * state


def test_the_largest_beam_is_the_one_that_fits():
    config = pf.TransformerConfig(**{**SEQ2SEQ_TINY, "tgt_vocab_size": 5000, "src_vocab_size": 5000})
    with memory.memory_limit(2 * 10**6):
        beam = memory.largest_beam(config, 4, 10, held=10**5)
        assert 0 < beam < 5000
        assert 10**5 + memory.beam_search_bytes(config, 4, beam, 10) <= 2 * 10**6
        assert 10**5 + memory.beam_search_bytes(config, 4, beam + 1, 10) > 2 * 10**6
    with memory.memory_limit(10**12):
        assert memory.largest_beam(config, 4, 10) == 5000  # no more hypotheses than tokens
    with memory.memory_limit(10):
        assert memory.largest_beam(config, 4, 10) == 0


# ----------------------------------------------------------------------------- the shared blocks' terms
# The per-token terms the families' memory estimates add up, against the module
# docstring's formulas worked by hand on small numbers: d_kv, the attention weights where they are
# materialised (w), the FFN's hidden states (a · d_ff), dropout's masks (r), a layer's total, a decoder's
# cross-attention, and a forward pass without autograd. How close the totals come to what autograd keeps
# is tested per family above.

SHAPE = dict(vocab_size=53, block_size=24, n_layers=2, n_heads=4, d_model=32, d_ff=64)


def test_the_key_width_is_n_kv_heads_head_widths():
    assert memory.kv_width(pf.GPTConfig(**SHAPE, n_kv_heads=2)) == 2 * 8
    assert memory.kv_width(pf.GPTConfig(**SHAPE)) == 32  # n_kv_heads None: every head
    assert memory.kv_width(SimpleNamespace(n_heads=4, d_model=32)) == 32  # a config without the field


@pytest.mark.parametrize("dropout, backend, keys, expected", [
    (0.1, "flash", 100, 3 * 4 * 100),  # the weights, the dropped weights, the mask: whatever the backend
    (0.0, "math", 1000, 4 * 1000),
    (0.0, "auto", 512, 4 * 512 // 2),  # the math path in bfloat16: half the bytes
    (0.0, "auto", 513, 0),  # the fused kernel beyond 512 keys
    (0.0, "sdpa", 100, 0),
    (0.0, "flash", 100, 0),
])
def test_the_attention_weights_count_where_they_are_materialised(dropout, backend, keys, expected):
    assert memory.scores(SimpleNamespace(n_heads=4, backend=backend, dropout=dropout), keys) == expected


def test_the_attention_dropout_of_a_config_that_has_one_decides_over_its_dropout():
    c = SimpleNamespace(n_heads=4, backend="sdpa", dropout=0.1, attention_dropout=0.0)
    assert memory.scores(c, 100) == 0
    assert memory.scores(SimpleNamespace(**{**vars(c), "attention_dropout": 0.1}), 100) == 3 * 4 * 100


@pytest.mark.parametrize("activation, expected", [("swiglu", 4 * 10), ("relu", 2 * 10), ("gelu", 2 * 10),
                                                  ("gelu_tanh", 2 * 10)])
def test_the_ffn_keeps_two_hidden_states_or_four_for_swiglu(activation, expected):
    assert memory.hidden(activation, 10) == expected


def test_dropout_keeps_its_masks_and_the_dropped_hidden_state_only_when_on():
    assert memory.dropout(SimpleNamespace(dropout=0.0, d_model=7), 10) == 0
    assert memory.dropout(SimpleNamespace(dropout=0.1, d_model=7), 10) == 12 + 3  # 5/4 · 10, 7/2, floored


def test_a_layer_keeps_the_sum_of_its_terms_per_token():
    c = pf.GPTConfig(**SHAPE, n_kv_heads=2, activation="swiglu", dropout=0.1)
    # 7 d + 2 d_kv + 4 d_ff + 3 h n + (5/4 d_ff + d/2), with n = 16 keys
    assert memory.layer_activations(c, 16) == 7 * 32 + 2 * 16 + 4 * 64 + 3 * 4 * 16 + (80 + 16) == 800


def test_cross_attention_keeps_five_widths_and_its_weights_per_target_token():
    c = pf.TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, n_layers=1, d_model=16, n_heads=4, d_ff=32,
                             max_len=12, backend="math", dropout=0.0)
    assert memory.cross_activations(c, 10) == 5 * 16 + 4 * 10


def test_a_forward_pass_keeps_one_layers_transients_and_the_float32_logits():
    c = pf.GPTConfig(**SHAPE, n_kv_heads=2)
    # rows · n · (itemsize · (4 d + 2 d_kv + 2 d_ff + h n) + 4 · 2 V), with 2 rows of 16 tokens in bfloat16
    expected = 2 * 16 * (2 * (4 * 32 + 2 * 16 + 2 * 64 + 4 * 16) + 4 * 2 * 53)
    assert memory.forward_pass(c, 2, 16, 2, 53) == expected == 36_096
    assert memory.forward_pass(c, 2, 16, 2, 0) == 2 * 16 * 2 * 352  # no logits: a pooled head, or none
