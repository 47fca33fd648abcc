"""LoRA (plainformer.nn.lora): the equation in float64, training starts from the base model, only A and B
train, merge/unmerge, and the refusals. Parity with Hugging Face PEFT is in tests/hf/test_lora.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import Linear

import plainformer as pf
from plainformer.nn.lora import LoRALinear, adapter_state_names, lora_layers
from tests.reference.tiny_models import GPT_VARIANTS_49, moved_off_start


def _gpt(**changes) -> pf.GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=31, block_size=16, n_layers=2, n_heads=2, d_model=16, d_ff=32, tie_weights=False)
    return pf.GPT(pf.GPTConfig(**{**config, **changes}))


def _tokens(vocab: int = 31) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))


def _randomize_b(model: torch.nn.Module) -> None:
    """B ≠ 0, so that a test of the update cannot pass with a zero one."""
    with torch.no_grad():
        for layer in lora_layers(model):
            layer.lora_B.normal_(generator=torch.Generator().manual_seed(layer.lora_B.numel()))


def test_the_layer_computes_w_x_plus_the_scaled_low_rank_update_in_float64():
    torch.manual_seed(0)
    base = torch.nn.Linear(5, 3).double()
    layer = LoRALinear(base, r=2, alpha=6.0)
    _randomize_b(layer)
    x = torch.randn(4, 5, dtype=torch.float64)
    W, b, A, B = base.weight, base.bias, layer.lora_A, layer.lora_B
    expected = x @ W.T + b + (6.0 / 2) * (x @ A.T @ B.T)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)


def test_a_starts_kaiming_uniform_and_b_at_zero_so_training_starts_from_the_base_model():
    model = _gpt()
    idx = _tokens()
    with torch.no_grad():
        before = model(idx)[0]
        pf.add_lora(model, r=4, targets=("W_q", "W_v", "W_1", "lm_head"))
        after = model(idx)[0]
    assert torch.equal(before, after)
    layer = model.blocks[0].self_attn.W_q
    bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform(a=√5) on (r, d_in)
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > bound / 2
    assert torch.count_nonzero(layer.lora_B) == 0


def test_the_state_dict_keeps_every_base_name_and_adds_a_and_b():
    model = _gpt()
    names = set(model.state_dict())
    pf.add_lora(model, r=2)
    added = set(model.state_dict()) - names
    assert names <= set(model.state_dict())
    assert added == {f"blocks.{i}.self_attn.{w}.lora_{ab}" for i in range(2) for w in ("W_q", "W_v") for ab in "AB"}


def test_after_three_steps_only_lora_parameters_changed_and_base_weights_are_bit_identical():
    model = pf.add_lora(_gpt(), r=2, targets=("W_q", "W_k", "W_v", "W_o", "W_1", "W_2"))
    base = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    trained = pf.lora_parameters(model)
    assert [p.requires_grad for p in model.parameters()].count(True) == len(trained) == 2 * 6 * 2
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    idx = _tokens()
    for _ in range(3):
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name]), name
            assert p.grad is None, name
    assert all(torch.count_nonzero(layer.lora_B) > 0 for layer in lora_layers(model))


def test_trainable_patterns_stay_trainable():
    model = pf.add_lora(_gpt(), r=2, trainable=("norm",))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("norm" in name for name in trainable)
    assert all("lora_" in name or "norm" in name for name in trainable)


def test_dropout_zero_in_train_mode_equals_eval_mode():
    model = pf.add_lora(_gpt(), r=2, dropout=0.0)
    _randomize_b(model)
    idx = _tokens()
    with torch.no_grad():
        training = model.train()(idx)[0]
        evaluating = model.eval()(idx)[0]
    assert torch.equal(training, evaluating)


@pytest.mark.parametrize("variants", [{}, dict(pos_encoding="alibi", qk_norm=True, attn_softcap=0.05,
                                               sliding_window=5)], ids=["plain", "attention-variants"])
def test_merge_keeps_the_function_merging_twice_changes_nothing_and_unmerge_restores_w(variants):
    model = pf.add_lora(_gpt(**variants).double(), r=3, alpha=5.0, targets=("W_q", "W_k", "W_v", "W_o", "W_1", "W_2",
                                                                             "lm_head"))
    _randomize_b(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    idx = _tokens()
    with torch.no_grad():
        unmerged = model(idx)[0]
        pf.merge_lora(model)
        merged = model(idx)[0]
        once = {name: p.detach().clone() for name, p in model.named_parameters()}
        pf.merge_lora(model)
        assert all(torch.equal(p, once[name]) for name, p in model.named_parameters())
        pf.unmerge_lora(model)
        again = model(idx)[0]
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-10)
    torch.testing.assert_close(again, unmerged, rtol=0, atol=1e-10)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(p, weights[name], rtol=0, atol=1e-12)


def test_a_gpt_with_every_issue_49_variant_adapts_its_linears_and_freezes_its_scalars():
    """The variants' parameters are vectors and scalars, no linear layers: LoRA passes them by and freezes
    them; training starts from the base model and merging keeps the function (float64)."""
    base = moved_off_start(_gpt(**GPT_VARIANTS_49, pos_encoding="rope", norm="rmsnorm")).double()
    idx = _tokens()
    with torch.no_grad():
        expected = base(idx)[0]
    model = pf.add_lora(base, r=2, targets=("W_q", "W_v", "W_o", "W_1", "W_2", "lm_head"))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert {"blocks.1.value_residual.lam", "blocks.0.x0_mix.b", "token_shift.gate", "bigram.table.weight",
            "embed_norm.weight"} <= frozen
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], expected, rtol=0, atol=1e-10)
        _randomize_b(model)
        unmerged = model(idx)[0]
        pf.merge_lora(model)
        torch.testing.assert_close(model(idx)[0], unmerged, rtol=0, atol=1e-10)
    assert not torch.allclose(unmerged, expected)


def test_the_encoder_decoder_and_bert_adapt_their_projections():
    torch.manual_seed(0)
    transformer = pf.Transformer(pf.TransformerConfig(src_vocab_size=11, tgt_vocab_size=11, n_layers=1,
                                                      n_heads=2, d_model=8, d_ff=16, max_len=16))
    bert = pf.BertModel(pf.BertConfig(vocab_size=20, n_layers=1, n_heads=2, d_model=8, d_ff=16, max_len=16))
    for model in (transformer, bert):
        pf.add_lora(model, r=2, targets=("W_q", "W_v", "W_2"))
        assert lora_layers(model) and all(isinstance(m, LoRALinear) for m in lora_layers(model))
        assert all(p.requires_grad == ("lora_" in name) for name, p in model.named_parameters())


@pytest.mark.parametrize("call, error, message", [
    (lambda m: pf.add_lora(m, r=0), ValueError, "r must be"),
    (lambda m: pf.add_lora(m, alpha=-1.0), ValueError, "alpha must be"),
    (lambda m: pf.add_lora(m, dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
    (lambda m: pf.add_lora(m, targets=("q_proj",)), ValueError, "'q_proj' are not LoRA targets; choose from W_q"),
    (lambda m: pf.add_lora(m, targets="W_q"), TypeError, "targets and trainable must be sequences of names"),
    (lambda m: pf.add_lora(m, targets=()), ValueError, "targets must name at least one of W_q"),
    (lambda m: pf.add_lora(m, targets=("W_3",)), ValueError, "no linear layer of GPT is named W_3"),
    (lambda m: pf.add_lora(pf.add_lora(m)), ValueError, "already has LoRA layers"),
])
def test_bad_arguments_are_refused_naming_them(call, error, message):
    with pytest.raises(error, match=message):
        call(_gpt())


def test_a_head_tied_to_the_embedding_is_refused():
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to token_embedding.weight"):
        pf.add_lora(_gpt(tie_weights=True), targets=("W_q", "lm_head"))


def test_the_stacked_weights_of_moe_experts_are_refused():
    model = _gpt(n_experts=4, top_k=2, activation="swiglu")
    with pytest.raises(ValueError, match=r"blocks.0.ff.W_1 stacks the weights of every expert"):
        pf.add_lora(model, targets=("W_q", "W_1"))
    pf.add_lora(model, targets=("W_q", "W_v"))  # attention only: fine


def test_unload_merges_and_gives_back_plain_linears_with_the_base_names():
    model = pf.add_lora(_gpt().double(), r=2, targets=("W_q", "W_v", "W_2"))
    _randomize_b(model)
    idx = _tokens()
    with torch.no_grad():
        adapted = model(idx)[0]
        pf.unload_lora(model)
        unloaded = model(idx)[0]
    assert not lora_layers(model) and set(model.state_dict()) == set(_gpt().state_dict())
    assert type(model.blocks[0].self_attn.W_q) is Linear
    torch.testing.assert_close(unloaded, adapted, rtol=0, atol=1e-10)


def test_the_config_round_trips_through_json_and_checks_its_fields():
    config = pf.LoRAConfig(r=4, alpha=8.0, targets=["W_q", "W_o"], trainable=("classifier",))
    assert config.targets == ("W_q", "W_o") and pf.LoRAConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="targets: 'W_x' are not LoRA targets"):
        pf.LoRAConfig(targets=("W_x",))
    with pytest.raises(TypeError, match="trainable must be a tuple of names"):
        pf.LoRAConfig(trainable=("", 3))


def test_what_a_lora_run_saves_is_its_trainable_parameters_and_persistent_buffers():
    model = pf.add_lora(_gpt(n_experts=4, top_k=2, activation="swiglu"), r=2, trainable=("norm",))
    names = adapter_state_names(model)
    assert {n for n in names if "lora_" not in n and "norm" not in n} == {"blocks.0.ff.expert_bias",
                                                                           "blocks.1.ff.expert_bias"}
    assert all(model.get_parameter(n).requires_grad for n in names if "expert_bias" not in n)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n not in names)
