"""GPT with Mixture-of-Experts blocks: against Hugging Face Mixtral with copied weights, which blocks are
MoE, the balancing terms of the training loss, the `moe` preset, config checks, cached decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import plainformer as pf
from plainformer.nn.moe import moe_layers
from tests.reference.torch_reference import assert_close

TINY_MOE = dict(vocab_size=53, block_size=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
                pos_encoding="rope", norm="rmsnorm", activation="swiglu", tie_weights=False,
                n_experts=4, top_k=2)


def _gpt(**overrides) -> pf.GPT:
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(**{**TINY_MOE, **overrides})).eval()


def _tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(TINY_MOE["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def _mixtral(model: pf.GPT) -> transformers.MixtralForCausalLM:
    """Mixtral with our weights. What matches: pre-RMSNorm blocks (eps 1e-5), rotate-half RoPE, GQA,
    top-K softmax routing with renormalised gates, SwiGLU experts, untied head. What Mixtral has and
    GPTConfig does not: sliding-window attention (off here), router jitter (0 by default); what ours
    has and Mixtral does not: dense blocks between MoE ones, shared experts, biases, learned positions."""
    c = model.config
    theirs = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.block_size,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
        num_local_experts=c.n_experts, num_experts_per_tok=c.top_k, tie_word_embeddings=False,
        sliding_window=None, attn_implementation="eager")).eval()
    with torch.no_grad():
        theirs.model.embed_tokens.weight.copy_(model.token_embedding.weight)
        for block, layer in zip(model.blocks, theirs.model.layers, strict=True):
            for ours_name, hf_name in (("W_q", "q_proj"), ("W_k", "k_proj"), ("W_v", "v_proj"), ("W_o", "o_proj")):
                getattr(layer.self_attn, hf_name).weight.copy_(getattr(block.self_attn, ours_name).weight)
            layer.input_layernorm.weight.copy_(block.norm1.weight)
            layer.post_attention_layernorm.weight.copy_(block.norm2.weight)
            layer.mlp.gate.weight.copy_(block.ff.router.weight)
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([block.ff.W_1, block.ff.W_3], dim=1))
            layer.mlp.experts.down_proj.copy_(block.ff.W_2)
        theirs.model.norm.weight.copy_(model.norm.weight)
        theirs.lm_head.weight.copy_(model.lm_head.weight)
    return theirs


def test_matches_hugging_face_mixtral_logits_with_copied_weights():
    ours = _gpt()
    with torch.no_grad():  # non-trivial norm gains, so a swapped norm would show
        for block in ours.blocks:
            block.norm1.weight.uniform_(0.5, 1.5)
            block.norm2.weight.uniform_(0.5, 1.5)
    theirs = _mixtral(ours)
    idx = _tokens(2, 17)
    logits, _ = ours(idx)
    expected = theirs(idx).logits
    assert (logits - expected).abs().max() <= 1e-4


def test_moe_blocks_follow_first_dense_layers_and_moe_every():
    model = _gpt(n_layers=6, first_dense_layers=1, moe_every=2)
    kinds = [type(block.ff).__name__ for block in model.blocks]
    assert kinds == ["FeedForward", "MoEFeedForward", "FeedForward", "MoEFeedForward", "FeedForward",
                     "MoEFeedForward"]
    assert [model.config.is_moe_layer(layer) for layer in range(6)] == [False, True, False, True, False, True]
    assert all(type(block.ff).__name__ == "FeedForward" for block in _gpt(n_experts=0).blocks)


def test_training_loss_adds_the_weighted_mean_balancing_terms_and_eval_loss_is_cross_entropy():
    model = _gpt(n_layers=3, aux_loss_coef=0.1, z_loss_coef=0.01).train()
    idx, targets = _tokens(2, 12), _tokens(2, 12, seed=2)
    logits, loss = model(idx, targets)
    layers = moe_layers(model)
    assert len(layers) == 3
    aux = torch.stack([pf.load_balancing_loss(layer.router_logits, 2) for layer in layers]).mean()
    z = torch.stack([pf.router_z_loss(layer.router_logits) for layer in layers]).mean()
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert_close(loss, cross_entropy + 0.1 * aux + 0.01 * z)
    loss.backward()
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in layers)
    model.eval()
    logits, loss = model(idx, targets)
    assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_moe_preset_has_the_active_feed_forward_size_of_default():
    moe, default = pf.GPTConfig.from_preset("moe"), pf.GPTConfig.from_preset("default")
    assert (moe.n_experts, moe.top_k) == (8, 2)
    assert moe.top_k * moe.d_ff == default.d_ff
    same = ("block_size", "n_layers", "n_heads", "d_model", "pos_encoding", "norm", "activation")
    assert all(getattr(moe, name) == getattr(default, name) for name in same)
    model = pf.GPT(moe.replace(n_layers=1, block_size=8))
    assert len(moe_layers(model)) == 1


def test_moe_init_scales_the_expert_output_projection():
    model = _gpt(n_layers=8, d_model=64, d_ff=256, n_heads=4, n_kv_heads=None)
    layer = model.blocks[0].ff
    assert abs(layer.W_1.std().item() - 0.02) < 2e-3
    assert abs(layer.W_2.std().item() - 0.02 / 4) < 5e-4  # 0.02 / √(2 · 8)


def test_cached_decoding_equals_the_full_pass():
    model = _gpt(n_shared_experts=1).double()  # two of our paths, differing in summation order: float64
    idx = _tokens(1, 10)
    full, _ = model(idx)
    caches = model.new_kv_caches(1)
    steps = [model(idx[:, i:i + 1], kv_caches=caches)[0] for i in range(10)]
    assert_close(torch.cat(steps, dim=1), full, "cached vs full logits")


@pytest.mark.parametrize("field, value", [
    ("n_experts", -1), ("top_k", 0), ("top_k", 5), ("moe_every", 0), ("first_dense_layers", -2),
    ("n_shared_experts", 1.5), ("aux_loss_coef", -0.1), ("z_loss_coef", "x"), ("capacity_factor", 0.0),
    ("bias_update_rate", -1.0),
])
def test_config_rejects_bad_moe_fields_naming_them(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        pf.GPTConfig(**{**TINY_MOE, field: value})
