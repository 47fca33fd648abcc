"""Attention maps against Hugging Face's output_attentions (eager attention) on the same weights, and
against direct need_weights=True calls of each MultiHeadAttention; recording leaves outputs unchanged.
The last two compare two of our own paths with a float64 model, so that the CPU's summation order cannot
show."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from PIL import Image

import plainformer as pf
from plainformer.models.attention_maps import (
    attention_maps,
    figure_size,
    plot_attention_maps,
    recorded_attention,
)
from tests.reference.torch_reference import assert_close

TOLERANCE = 1e-5  # against Hugging Face: fp32 weights in [0, 1]
GPT_SHAPE = dict(vocab_size=50, block_size=24, n_layers=2, n_heads=4, d_model=32, d_ff=64)
LAYOUTS = {
    "llama": dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", n_kv_heads=2),
    "gpt2": dict(pos_encoding="learned", norm="layernorm", activation="gelu_tanh", bias=True),
}


def _sharpen(model: torch.nn.Module) -> None:
    """Larger weights than the init, so that the maps are far from uniform."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def _ids(n: int, vocab_size: int = 50) -> torch.Tensor:
    return torch.randint(1, vocab_size, (n,), generator=torch.Generator().manual_seed(1))


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_maps_equal_hugging_face_attentions_on_the_exported_weights(layout, tmp_path):
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**GPT_SHAPE, **LAYOUTS[layout])).eval()
    _sharpen(model)
    pf.save_hf(model, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _ids(12)
    weights = attention_maps(model, ids)
    with torch.no_grad():
        expected = torch.stack(theirs(ids[None], output_attentions=True).attentions)[:, 0]
    assert weights.shape == (2, 4, 12, 12)
    assert _max_error(weights, expected) <= TOLERANCE
    assert weights.max() > 0.5  # not uniform: the comparison can fail


def test_bert_maps_equal_hugging_face_attentions(tmp_path):
    torch.manual_seed(0)
    bert = pf.BertModel(pf.BertConfig(vocab_size=50, max_len=16, n_layers=2, n_heads=2, d_model=16,
                                      d_ff=32)).eval()
    _sharpen(bert)
    pf.save_hf(bert, tmp_path)
    theirs = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _ids(9)
    with torch.no_grad():
        expected = torch.stack(theirs(ids[None], output_attentions=True).attentions)[:, 0]
    assert _max_error(attention_maps(bert, ids), expected) <= TOLERANCE
    masked_lm = pf.BertForMaskedLM(bert.config).eval()
    masked_lm.bert.load_state_dict(bert.state_dict())
    assert _max_error(attention_maps(masked_lm, ids), expected) <= TOLERANCE


def _transformer() -> pf.Transformer:
    torch.manual_seed(0)
    config = pf.TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, max_len=20, n_layers=2, n_heads=2,
                                  d_model=16, d_ff=32, dropout=0.0)
    model = pf.Transformer(config).eval()
    _sharpen(model)
    return model


def test_cross_attention_maps_equal_direct_need_weights_calls():
    model = _transformer().double()
    src, tgt = _ids(7, 30), _ids(5, 30)
    inputs = []  # each cross-attention's (query, key, value) and mask, captured by a plain hook
    hooks = [layer.cross_attn.register_forward_hook(
        lambda module, args, kwargs, output: inputs.append((module, args, kwargs)), with_kwargs=True)
        for layer in model.decoder.layers]
    with torch.no_grad():
        model(src[None], tgt[None])
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        expected = torch.stack([module(*args, **{**kwargs, "need_weights": True})[1][0]
                                for module, args, kwargs in inputs])
    weights = attention_maps(model, src, tgt)
    assert weights.shape == (2, 2, 5, 7)
    assert_close(weights, expected, "cross-attention maps")


def test_recording_leaves_the_output_unchanged_and_removes_its_hooks():
    """Unchanged up to rounding: recorded calls take the math path, others the model's backend."""
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**GPT_SHAPE, **LAYOUTS["llama"])).double().eval()
    idx = _ids(10)[None]
    with torch.no_grad():
        expected = model(idx)[0]
        with recorded_attention([b.self_attn for b in model.blocks]) as weights:
            assert_close(model(idx)[0], expected, "output while recording")
    assert len(weights) == 2
    for block in model.blocks:
        assert not block.self_attn._forward_hooks and not block.self_attn._forward_pre_hooks


def test_plot_writes_a_png_of_the_stated_size_atomically(tmp_path):
    weights = torch.softmax(torch.randn(2, 3, 4, 5), dim=-1)
    path = plot_attention_maps(weights, tmp_path / "maps" / "attn.png", queries=list("abcd"),
                               keys=["x", " ", "\n", "é", "z"])
    assert Image.open(path).size == figure_size(2, 3, 4, 5)
    assert [p.name for p in path.parent.iterdir()] == ["attn.png"]  # no temporary file left behind


@pytest.mark.parametrize("call, message", [
    (lambda m: attention_maps(m, torch.zeros(2, 3, dtype=torch.long)), "one sequence"),
    (lambda m: attention_maps(m, torch.zeros(0, dtype=torch.long)), "at least one token"),
    (lambda m: attention_maps(m, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)), "tgt"),
    (lambda m: attention_maps(torch.nn.Linear(2, 2), torch.zeros(3, dtype=torch.long)), "GPT, a BERT"),
    (lambda m: plot_attention_maps(torch.rand(1, 1, 2, 2), "x.png", queries=["a"]), "queries and keys"),
])
def test_bad_inputs_are_refused_clearly(call, message):
    model = pf.GPT(pf.GPTConfig(**GPT_SHAPE))
    with pytest.raises((ValueError, TypeError), match=message):
        call(model)
