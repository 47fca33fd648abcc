"""The Hugging Face layouts of a GPT (hf/gpt_layouts.py): which layout a config takes, the config.json
translation each way against transformers' own config classes and activations, and the refusals of
what a layout cannot express; tiny models built locally (no network)."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.activations import ACT2FN

import plainformer as pf
from plainformer.hf import gpt_layouts
from plainformer.nn.feedforward import FeedForward
from tests.reference.hf_gpt import (
    GPT2,
    LLAMA,
    MIXTRAL,
    TINY,
    TOLERANCE,
    _hf_directory,
    _hf_logits,
    _max_error,
    _tokens,
)

# ----------------------------------------------------------------------------- choosing a layout

@pytest.mark.parametrize("overrides, layout", [
    (GPT2, gpt_layouts.GPT2), (LLAMA, gpt_layouts.LLAMA), (MIXTRAL, gpt_layouts.MIXTRAL),
    (dict(GPT2, n_experts=4, top_k=2), gpt_layouts.MIXTRAL),  # experts decide before the positions
    (dict(LLAMA, qk_norm=True), gpt_layouts.QWEN3),
    (dict(LLAMA, sliding_window=8), gpt_layouts.MISTRAL),
    (dict(LLAMA, qk_norm=True, sliding_window=8), gpt_layouts.QWEN3),
    (dict(MIXTRAL, sliding_window=8), gpt_layouts.MIXTRAL),
])
def test_a_config_takes_the_layout_of_its_positions_or_of_its_experts(overrides, layout):
    assert gpt_layouts.layout_for(pf.GPTConfig(**TINY, **overrides)) is layout


@pytest.mark.parametrize("layout", list(gpt_layouts.LAYOUTS.values()), ids=list(gpt_layouts.LAYOUTS))
def test_each_layout_names_a_transformers_architecture_of_its_model_type(layout):
    assert gpt_layouts.LAYOUTS[layout.model_type] is layout
    assert getattr(transformers, layout.architecture).config_class.model_type == layout.model_type


# ----------------------------------------------------------------------------- config.json -> ours

def _minimal(**sizes):
    """The sizes a config.json must give; every other key is left to the config class's default."""
    return dict(vocab_size=61, hidden_size=64, intermediate_size=32, num_hidden_layers=1, **sizes)


@pytest.mark.parametrize("layout, config_class, given", [
    (gpt_layouts.LLAMA, transformers.LlamaConfig, _minimal(num_attention_heads=4)),
    (gpt_layouts.MIXTRAL, transformers.MixtralConfig, _minimal(num_attention_heads=16)),
    (gpt_layouts.MISTRAL, transformers.MistralConfig, _minimal(num_attention_heads=16)),
], ids=["llama", "mixtral", "mistral"])
def test_a_key_a_rotary_config_json_leaves_out_takes_the_transformers_default(layout, config_class, given):
    ours = pf.GPTConfig.from_dict(layout.config_from_hf(given))
    theirs = config_class(**given)
    assert ours.block_size == theirs.max_position_embeddings
    assert ours.norm_eps == theirs.rms_norm_eps
    assert ours.rope_base == theirs.rope_parameters["rope_theta"]
    assert (ours.n_kv_heads or ours.n_heads) == theirs.num_key_value_heads
    assert ours.tie_weights == theirs.tie_word_embeddings
    assert ours.bias == getattr(theirs, "attention_bias", False)
    assert ours.sliding_window == getattr(theirs, "sliding_window", None)
    if layout is gpt_layouts.MIXTRAL:
        assert (ours.n_experts, ours.top_k) == (theirs.num_local_experts, theirs.num_experts_per_tok)
        assert ours.aux_loss_coef == theirs.router_aux_loss_coef


def test_a_key_a_gpt2_config_json_leaves_out_takes_the_transformers_default():
    ours = pf.GPTConfig.from_dict(gpt_layouts.GPT2.config_from_hf({}))
    theirs = transformers.GPT2Config()
    assert (ours.vocab_size, ours.block_size, ours.d_model, ours.n_layers, ours.n_heads) == (
        theirs.vocab_size, theirs.n_positions, theirs.n_embd, theirs.n_layer, theirs.n_head)
    assert theirs.n_inner is None and ours.d_ff == 4 * theirs.n_embd  # GPT2MLP's width when n_inner is null
    assert (ours.norm_eps, ours.dropout, ours.tie_weights) == (
        theirs.layer_norm_epsilon, theirs.resid_pdrop, theirs.tie_word_embeddings)
    assert ours.activation == "gelu_tanh" and theirs.activation_function == "gelu_new"


@pytest.mark.parametrize("name", ["gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "relu2"])
def test_each_gpt2_activation_function_is_read_as_ours_that_computes_it(name):
    """float64, so that equal functions agree to rounding (1e-12) whatever the CPU."""
    activation = gpt_layouts.GPT2.config_from_hf({"activation_function": name})["activation"]
    ff = FeedForward(8, 8, activation, bias=False).double()
    with torch.no_grad():
        ff.W_1.weight.copy_(torch.eye(8))
        ff.W_2.weight.copy_(torch.eye(8))
    x = torch.linspace(-6, 6, 96, dtype=torch.float64).view(12, 8)
    torch.testing.assert_close(ff(x), ACT2FN[name](x), atol=1e-12, rtol=0)


def test_a_gpt2_activation_function_without_ours_is_refused_listing_those_read():
    with pytest.raises(ValueError, match=r"activation_function='silu' is not supported; expected one of 'gelu', "
                                         r"'relu', 'relu2', 'gelu_new', 'gelu_pytorch_tanh'$"):
        gpt_layouts.GPT2.config_from_hf({"activation_function": "silu"})


def test_a_llama_with_a_bias_on_attention_alone_is_refused():
    with pytest.raises(ValueError, match="attention_bias and mlp_bias must agree"):
        gpt_layouts.LLAMA.config_from_hf(_minimal(num_attention_heads=4, attention_bias=True))


# ----------------------------------------------------------------------------- weights

def test_transformers_fused_mixtral_experts_are_renamed_per_expert():
    """gate_up_proj (E, 2·d_ff, d) is [w1 | w3] on axis 1 and down_proj (E, d, d_ff) is w2: hand-built
    tensors, so that each expert's slice is known."""
    E, d_ff, d = 2, 3, 4
    gate_up = torch.arange(E * 2 * d_ff * d, dtype=torch.float32).view(E, 2 * d_ff, d)
    down = -torch.arange(E * d * d_ff, dtype=torch.float32).view(E, d, d_ff)
    gate, embedding = torch.ones(E, d), torch.zeros(5, d)
    renamed = gpt_layouts.MIXTRAL.renamed({
        "model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down,
        "model.layers.0.mlp.gate.weight": gate, "model.embed_tokens.weight": embedding})
    moe = "model.layers.0.block_sparse_moe."
    expected = {"model.embed_tokens.weight": embedding, f"{moe}gate.weight": gate}
    for e in range(E):
        expected[f"{moe}experts.{e}.w1.weight"] = gate_up[e, :d_ff]
        expected[f"{moe}experts.{e}.w3.weight"] = gate_up[e, d_ff:]
        expected[f"{moe}experts.{e}.w2.weight"] = down[e]
    assert renamed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(renamed[name], tensor), name


def test_mixtral_fills_every_router_bias_with_zero():
    config = pf.GPTConfig(**TINY, **MIXTRAL)
    buffers = gpt_layouts.MIXTRAL.buffers(config)
    assert sorted(buffers) == [f"blocks.{i}.ff.expert_bias" for i in range(config.n_layers)]
    assert all(torch.equal(b, torch.zeros(config.n_experts)) for b in buffers.values())
    assert gpt_layouts.LLAMA.buffers(pf.GPTConfig(**TINY, **LLAMA)) == {}


def test_mixtral_in_transformers_own_fused_expert_names_loads(tmp_path):
    """transformers 5 holds a block's experts as mlp.experts.gate_up_proj (E, 2·d_ff, d) and down_proj
    in memory (save_pretrained writes them back per expert); a file in those names loads too."""
    theirs, directory = _hf_directory("mixtral-gqa-untied", tmp_path)
    assert any(".block_sparse_moe.experts.0.w1." in k for k in load_file(directory / "model.safetensors"))
    if not any(k.endswith(".mlp.experts.gate_up_proj") for k in theirs.state_dict()):
        pytest.skip("this transformers holds Mixtral's experts per expert in memory too")
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(pf.load_hf(directory)(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE


# ----------------------------------------------------------------------------- what no layout expresses

@pytest.mark.parametrize("variant, change, field", [
    ("llama-tied", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama-tied", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, "rope"),
    ("llama-tied", {"head_dim": 16}, "head_dim"),
    ("llama-tied", {"model_type": "gemma"}, "gemma"),
    ("qwen3-window", {"layer_types": ["full_attention", "sliding_attention"]}, "use_sliding_window=True on 1 of 2"),
    ("qwen3-window", {"layer_types": None, "max_window_layers": 1}, "use_sliding_window=True on 1 of 2"),
    ("mixtral-tied-top1", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral-tied-top1", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_a_rotary_config_plainformer_cannot_express_is_refused_naming_the_field(variant, change, field,
                                                                                         tmp_path):
    _, directory = _hf_directory(variant, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=field):
        pf.load_hf(directory)


@pytest.mark.parametrize("overrides, field", [
    (dict(pos_encoding="sinusoidal"), "pos_encoding='sinusoidal'"),
    (dict(GPT2, norm="rmsnorm"), "norm='rmsnorm'"),
    (dict(GPT2, activation="swiglu"), "activation='swiglu'"),
    (dict(GPT2, n_kv_heads=2), "n_kv_heads=2"),
    (dict(LLAMA, norm="layernorm"), "norm='layernorm'"),
    (dict(LLAMA, activation="gelu"), "activation='gelu'"),
    (dict(MIXTRAL, pos_encoding="learned"), "pos_encoding='learned'"),
    (dict(MIXTRAL, bias=True), "bias=True"),
    (dict(MIXTRAL, n_shared_experts=1), "n_shared_experts=1"),
    (dict(MIXTRAL, first_dense_layers=1), "first_dense_layers=1"),
    (dict(MIXTRAL, moe_every=2), "moe_every=2"),
    (dict(MIXTRAL, capacity_factor=1.0), "capacity_factor=1.0"),
    (dict(MIXTRAL, bias_update_rate=0.1), "bias_update_rate=0.1"),
    (dict(LLAMA, logit_softcap=30.0), "logit_softcap=30.0 has no Hugging Face or GGUF layout here"),
    (dict(GPT2, embed_norm=True), "embed_norm=True has no Hugging Face or GGUF layout here"),
    (dict(LLAMA, x0_mix=True), "x0_mix=True has no Hugging Face or GGUF layout here"),
    (dict(MIXTRAL, value_residual=True), "value_residual=True has no Hugging Face or GGUF layout here"),
    (dict(GPT2, token_shift=True), "token_shift=True has no Hugging Face or GGUF layout here"),
    (dict(LLAMA, bigram_embedding=True), "bigram_embedding=True has no Hugging Face or GGUF layout here"),
    (dict(MIXTRAL, qk_norm=True), "qk_norm=True has no Hugging Face layout here: Mixtral"),
    (dict(GPT2, qk_norm=True), "qk_norm=True has no Hugging Face layout here with pos_encoding='learned'"),
    (dict(LLAMA, qk_norm=True, bias=True), "bias=True has no Hugging Face layout here: Qwen3 needs bias=False"),
    (dict(LLAMA, attn_softcap=30.0), "attn_softcap=30.0 has no Hugging Face or GGUF layout here"),
    (dict(LLAMA, pos_encoding="alibi"), "pos_encoding='alibi' has no Hugging Face layout"),
    (dict(MIXTRAL, pos_encoding="alibi"), "pos_encoding='alibi' has no Hugging Face layout"),
    (dict(GPT2, sliding_window=8), "sliding_window=8 has no Hugging Face layout here with pos_encoding='learned'"),
    (dict(LLAMA, sliding_window=8, bias=True), "bias=True has no Hugging Face layout here: Mistral (sliding_window=8)"),
    (dict(LLAMA, sliding_window=8, activation="gelu"), "activation='gelu' has no Hugging Face layout here: Mistral"),
])
def test_a_config_no_layout_expresses_is_refused_naming_the_field(overrides, field, tmp_path):
    model = pf.GPT(pf.GPTConfig(**TINY, **overrides))
    with pytest.raises(ValueError, match=re.escape(field)):
        pf.save_hf(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("window", [None, TINY["block_size"]])
def test_a_mistral_window_null_or_of_every_position_loads_as_none(window, tmp_path):
    theirs, directory = _hf_directory("mistral-tied", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ours = pf.load_hf(directory)
    assert ours.config.sliding_window is None
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(ours(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE


def test_a_model_trained_from_zero_init_exports_as_any_and_transformers_gives_its_logits(tmp_path):
    """zero_init decides the start alone: what training leaves is an ordinary Llama."""
    torch.manual_seed(0)
    ours = pf.GPT(pf.GPTConfig(**TINY, **{**LLAMA, "tie_weights": False}, zero_init=True)).eval()
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    pf.save_hf(ours, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(ours(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE
