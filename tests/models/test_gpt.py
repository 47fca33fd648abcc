"""GPT against Hugging Face GPT-2 with copied weights, config checks, presets, init, KV-cached decoding; the block
variants of issue 49 against a float64 forward written from their equations, their decoding and checkpoints."""

from __future__ import annotations

import ast
import functools
import inspect
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F
import transformers

import plainformer as pf
from plainformer.families import memory_estimates
from plainformer.generation.decoding import iter_generate
from plainformer.hf.gpt import state_from_hf
from plainformer.inference.linear_kernels import measure_kernels
from plainformer.models.gpt import VariantBlock, VariantGPT
from plainformer.nn.attention import VariantAttention
from tests.reference import llama_family
from tests.reference.tiny_models import GPT_VARIANTS_49, moved_off_start
from tests.reference.torch_reference import assert_close

TINY = dict(vocab_size=53, block_size=24, n_layers=2, n_heads=4, d_model=32, d_ff=64)


def _gpt(**overrides) -> pf.GPT:
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(**{**TINY, **overrides})).eval()


def _tokens(batch: int, n: int, vocab_size: int = TINY["vocab_size"], seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- Hugging Face GPT-2

def _hf_config(config: pf.GPTConfig) -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.d_model,
        n_layer=config.n_layers, n_head=config.n_heads, n_inner=config.d_ff,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True)


def _gpt_and_hf(backend: str) -> tuple[pf.GPT, transformers.GPT2LMHeadModel]:
    config = pf.GPTConfig(**TINY, bias=True, activation="gelu_tanh", pos_encoding="learned",
                          tie_weights=True, backend=backend)
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(_hf_config(config)).eval()
    with torch.no_grad():  # larger than GPT-2's init so attention is far from uniform; random biases and norms
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.5 if parameter.ndim == 1 else 0.15)
    ours = pf.GPT(config).eval()
    ours.load_state_dict(state_from_hf(theirs.state_dict(), config))  # the library's GPT-2 weight map
    return ours, theirs


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_matches_hugging_face_gpt2_logits_loss_and_gradients_with_copied_weights(backend):
    ours, theirs = _gpt_and_hf(backend)
    idx = _tokens(3, TINY["block_size"])
    targets = torch.cat((idx[:, 1:], torch.full((3, 1), -100)), dim=1)  # HF shifts labels itself
    logits, loss = ours(idx, targets)
    expected = theirs(idx, labels=idx)
    assert_close(logits, expected.logits, "logits")
    assert_close(loss, expected.loss, "loss")
    loss.backward()
    expected.loss.backward()
    expected_grads = state_from_hf({name: p.grad for name, p in theirs.named_parameters()}, ours.config)
    for name, parameter in ours.named_parameters():
        assert_close(parameter.grad, expected_grads[name], f"gradient of {name}")


def _left_padded(batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (batch, n) and their mask, True = real token: row b starts after 3 b padding positions."""
    real = torch.arange(n)[None, :] >= 3 * torch.arange(batch)[:, None]
    return _tokens(batch, n), real


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_left_padded_rows_match_hugging_face_given_its_attention_mask_and_position_ids(backend):
    ours, theirs = _gpt_and_hf(backend)
    idx, real = _left_padded(3, 12)
    with torch.no_grad():
        logits = ours(idx, attention_mask=real)[0]
        expected = theirs(idx, attention_mask=real.long(), position_ids=(real.cumsum(1) - 1).clamp_min(0)).logits
    assert_close(logits[real], expected[real], "logits of the real tokens")
    assert not logits.isnan().any()  # padding queries see themselves, so nothing is NaN


@pytest.mark.parametrize("variant", [dict(pos_encoding="learned"), dict(pos_encoding="sinusoidal"),
                                     dict(pos_encoding="rope"), dict(pos_encoding="alibi"),
                                     dict(pos_encoding="alibi", sliding_window=3)], ids=str)
def test_a_padded_row_prefilled_and_decoded_with_a_cache_gives_its_logits_alone(variant):
    model = _gpt(**variant).eval()
    idx, real = _left_padded(3, 10)
    step = _tokens(3, 1, seed=2)
    with torch.no_grad():
        caches = model.new_kv_caches(3)
        model(idx, kv_caches=caches, attention_mask=real)
        decoded = model(step, kv_caches=caches, attention_mask=torch.cat((real, real[:, :1] | True), dim=1))[0]
        for row in range(3):
            alone = model(torch.cat((idx[row:row + 1, 3 * row:], step[row:row + 1]), dim=1))[0][:, -1]
            assert_close(decoded[row, -1], alone[0], f"row {row}")


def test_the_attention_mask_must_cover_the_cached_and_new_positions():
    model = _gpt()
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, m\) = \(2, 5\)"):
        model(_tokens(2, 5), attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask must be boolean"):
        model(_tokens(2, 5), attention_mask=torch.ones(2, 5))


def test_tied_output_projection_is_the_token_embedding():
    model = _gpt(tie_weights=True)
    assert model.lm_head.weight is model.token_embedding.weight
    untied = _gpt(tie_weights=False)
    assert untied.num_parameters() == model.num_parameters() + TINY["vocab_size"] * TINY["d_model"]


def test_loss_is_cross_entropy_of_the_logits_ignoring_minus_100():
    model = _gpt()
    idx, targets = _tokens(2, 10), _tokens(2, 10, seed=2)
    targets[0, :4] = -100
    logits, loss = model(idx, targets)
    kept = targets.flatten() != -100
    expected = F.cross_entropy(logits.flatten(0, 1)[kept].double(), targets.flatten()[kept])
    assert abs(loss.item() - expected.item()) <= 1e-5
    assert model(idx)[1] is None


# ----------------------------------------------------------------------------- attention variants
# Each against the released model that has it, built locally with our weights copied in (fp32, 1e-5).

def _llama_shaped(**variant) -> pf.GPT:
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY, **llama_family.LLAMA_SHAPED, norm_eps=1e-6, rope_base=500.0,
                                **variant)).eval()
    llama_family.randomize(model)
    return model


@pytest.mark.parametrize("heads", [dict(n_kv_heads=2, tie_weights=False), dict(tie_weights=True),
                                   dict(n_kv_heads=1, tie_weights=True)], ids=["gqa-untied", "tied", "mqa-tied"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
def test_qk_norm_gpt_equals_qwen3_with_copied_weights(heads, backend):
    ours = _llama_shaped(qk_norm=True, backend=backend, **heads)
    theirs = llama_family.qwen3(ours.config)
    llama_family.copy_into(ours, theirs)
    assert {"blocks.0.self_attn.q_norm.weight", "blocks.0.self_attn.k_norm.weight"} <= set(ours.state_dict())
    idx = _tokens(2, TINY["block_size"])
    with torch.no_grad():
        assert_close(ours(idx)[0], theirs(idx).logits, "logits")


@pytest.mark.parametrize("heads", [dict(n_kv_heads=2, tie_weights=False), dict(tie_weights=True)],
                         ids=["gqa-untied", "tied"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "flash", "auto"])
def test_sliding_window_gpt_equals_mistral_with_copied_weights(heads, backend):
    ours = _llama_shaped(sliding_window=5, backend=backend, **heads)
    theirs = llama_family.mistral(ours.config)
    llama_family.copy_into(ours, theirs)
    idx = _tokens(2, TINY["block_size"])  # n = 24 > 2w
    with torch.no_grad():
        logits = ours(idx)[0]
        assert_close(logits, theirs(idx).logits, "logits")
        theirs.config.sliding_window = None  # Mistral seeing every key: the window changed something
        assert (logits - theirs(idx).logits).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["math", "flash", "auto"])
def test_attn_softcap_gpt_equals_llama_with_gemma2_soft_capped_attention(backend, monkeypatch):
    """Gemma 2's eager attention (attn_logit_softcapping: c·tanh(s/c) of the scaled scores, then the mask)
    in place of Llama's: a Llama-shaped model whose scores are soft-capped."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.llama import modeling_llama

    ours = _llama_shaped(attn_softcap=2.0, n_kv_heads=2, tie_weights=False, backend=backend)
    theirs = llama_family.llama(ours.config)
    llama_family.copy_into(ours, theirs)
    monkeypatch.setattr(modeling_llama, "eager_attention_forward",
                        functools.partial(modeling_gemma2.eager_attention_forward, softcap=2.0))
    idx = _tokens(2, TINY["block_size"])
    with torch.no_grad():
        logits = ours(idx)[0]
        assert_close(logits, theirs(idx).logits, "logits")
        monkeypatch.undo()  # Llama's own attention: the cap changed something
        assert (logits - theirs(idx).logits).abs().max() > 1e-2


@pytest.mark.parametrize("variants", [
    dict(pos_encoding="alibi", n_kv_heads=2, qk_norm=True, sliding_window=5),
    dict(pos_encoding="rope", norm="rmsnorm", qk_norm=True, attn_softcap=0.05, sliding_window=3),
    dict(pos_encoding="alibi", attn_softcap=0.05, bias=True, dropout=0.0),
], ids=["alibi-gqa-qk-norm-window", "rope-qk-norm-softcap-window", "alibi-softcap"])
def test_every_backend_trains_the_same_gpt_with_the_attention_variants(variants):
    """Logits, loss and every gradient of math, sdpa (where it computes the variants: no soft-cap) and flash,
    in float64: our own paths, equal to 1e-10; the references above pin each variant to a released model."""
    idx, targets = _tokens(2, TINY["block_size"]), _tokens(2, TINY["block_size"], seed=2)
    results = {}
    for backend in ("math", "sdpa", "flash"):
        if backend == "sdpa" and "attn_softcap" in variants:
            continue
        model = _gpt(backend=backend, **variants).double().train()
        llama_family.randomize(model)
        logits, loss = model(idx, targets)
        loss.backward()
        results[backend] = [logits, loss] + [p.grad for p in model.parameters()]
    for backend, result in results.items():
        for i, (a, b) in enumerate(zip(result, results["math"], strict=True)):
            assert_close(a, b, f"{backend}: output {i}")


# ----------------------------------------------------------------------------- config and inputs

@pytest.mark.parametrize("field, value", [
    ("vocab_size", 0), ("block_size", -1), ("n_layers", 0), ("d_ff", 2.5),
    ("n_heads", 5), ("n_kv_heads", 3), ("dropout", 1.0), ("pos_encoding", "xpos"), ("norm", "batchnorm"),
    ("activation", "tanh"), ("backend", "cuda"), ("norm_eps", 0.0), ("norm_eps", "1e-5"), ("rope_base", 1.0),
    ("logit_softcap", 0.0), ("logit_softcap", -30.0), ("zero_init", 1), ("value_residual", "yes"),
    ("x0_mix", None), ("embed_norm", 1.0), ("token_shift", 0), ("bigram_embedding", "true"),
    ("qk_norm", "yes"), ("attn_softcap", 0.0), ("attn_softcap", float("inf")), ("sliding_window", 0),
    ("sliding_window", 2.5),
])
def test_config_rejects_bad_fields_naming_them(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        pf.GPTConfig(**{**TINY, field: value})


def test_config_rejects_odd_dimensions_for_rope_and_sinusoidal_positions():
    with pytest.raises(ValueError, match="rope.*even head dimension"):
        pf.GPTConfig(**{**TINY, "d_model": 36, "n_heads": 4}, pos_encoding="rope")  # head_dim 9
    with pytest.raises(ValueError, match="sinusoidal.*even d_model"):
        pf.GPTConfig(**{**TINY, "d_model": 33, "n_heads": 3}, pos_encoding="sinusoidal")


@pytest.mark.parametrize("window", [TINY["block_size"] + 1, 10**22])
def test_a_sliding_window_past_the_context_is_refused_and_the_context_itself_taken(window):
    with pytest.raises(ValueError, match=rf"sliding_window must be at most block_size={TINY['block_size']}, the "
                                         rf"context, got {window}"):
        pf.GPTConfig(**TINY, sliding_window=window)
    assert pf.GPTConfig(**TINY, sliding_window=TINY["block_size"]).sliding_window == TINY["block_size"]


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_eps_reaches_every_norm(norm):
    model = _gpt(norm=norm, norm_eps=1e-3)
    norms = [model.norm] + [n for block in model.blocks for n in (block.norm1, block.norm2)]
    assert [n.eps for n in norms] == [1e-3] * len(norms)


def test_model_rejects_a_non_config():
    with pytest.raises(TypeError, match="config must be a GPTConfig, got dict"):
        pf.GPT(dict(TINY))


def test_forward_rejects_bad_inputs_naming_them():
    model = _gpt()
    with pytest.raises(ValueError, match="block_size=24"):
        model(_tokens(1, 25))
    with pytest.raises(ValueError, match=r"idx holds ids in \[0, 53\]"):
        model(torch.tensor([[0, 53]]))
    with pytest.raises(TypeError, match="idx must hold integer token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(_tokens(2, 5), _tokens(2, 4))
    with pytest.raises(ValueError, match="one cache per layer"):
        model(_tokens(1, 3), kv_caches=model.new_kv_caches(1)[:1])


def test_presets_have_the_documented_shapes():
    cpu = pf.GPTConfig.from_preset("nanogpt-cpu")
    assert (cpu.n_layers, cpu.n_heads, cpu.d_model, cpu.block_size, cpu.dropout) == (4, 4, 128, 64, 0.0)
    char = pf.GPTConfig.from_preset("shakespeare-char")
    assert (char.n_layers, char.n_heads, char.d_model, char.block_size, char.dropout) == (6, 6, 384, 256, 0.2)
    with pytest.raises(ValueError, match="unknown GPTConfig preset 'gpt3'"):
        pf.GPTConfig.from_preset("gpt3")
    for name in pf.GPTConfig.preset_names():
        pf.GPTConfig.from_preset(name, vocab_size=65)


def test_gpt2_preset_has_the_parameter_count_of_hugging_face_gpt2():
    config = pf.GPTConfig.from_preset("gpt2")
    with torch.device("meta"):  # shapes only: no 500 MB of weights to initialise
        ours = pf.GPT(config)
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.d_model,
            n_layer=config.n_layers, n_head=config.n_heads, n_inner=config.d_ff))
    assert ours.num_parameters() == theirs.num_parameters() == 124_439_808
    assert ours.num_parameters(exclude_embeddings=True) == theirs.num_parameters(exclude_embeddings=True)


def test_gpt2_init_scales_residual_projections_by_one_over_sqrt_two_n_layers():
    n_layers = 8
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(vocab_size=256, block_size=32, n_layers=n_layers, n_heads=4, d_model=128,
                                d_ff=512, bias=True))

    def stats(tensors):
        values = torch.cat([t.detach().flatten() for t in tensors])
        return values.mean().item(), values.std().item(), values.numel()

    residual = 0.02 / math.sqrt(2 * n_layers)
    groups = {
        residual: [p for b in model.blocks for p in (b.self_attn.W_o.weight, b.ff.W_2.weight)],
        0.02: [p for b in model.blocks for p in (b.self_attn.W_q.weight, b.self_attn.W_k.weight,
                                                  b.self_attn.W_v.weight, b.ff.W_1.weight)]
        + [model.token_embedding.weight, model.position.embedding.weight],
    }
    for std, tensors in groups.items():
        mean, measured, count = stats(tensors)
        # sample std of N normals has relative standard error 1/sqrt(2N) (< 0.4% here): allow 5 of them
        assert abs(measured / std - 1) < 5 / math.sqrt(2 * count), (std, measured)
        assert abs(mean) < 5 * std / math.sqrt(count)
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert biases and all(bool((b == 0).all()) for b in biases)


# ----------------------------------------------------------------------------- the block

def test_a_block_is_built_from_its_config_with_the_checkpoint_names():
    config = pf.GPTConfig(**TINY, n_experts=4, first_dense_layers=1, norm="rmsnorm")
    dense, moe = pf.Block(config, 0), pf.Block(config, 1)
    assert (type(dense.ff).__name__, type(moe.ff).__name__) == ("FeedForward", "MoEFeedForward")
    assert {name.split(".")[0] for name in dense.state_dict()} == {"self_attn", "ff", "norm1", "norm2"}
    assert all(isinstance(block, pf.Block) for block in pf.GPT(config).blocks)


def test_a_block_called_alone_is_causal_and_equals_the_models_call():
    model = _gpt()
    block = model.blocks[0]
    x = torch.randn(2, 6, TINY["d_model"])
    mask = pf.nn.AttentionMask.build(6, 6, is_causal=True)
    with torch.no_grad():
        alone, given = block(x), block(x, mask)
        changed_last = block(torch.cat([x[:, :-1], torch.randn(2, 1, TINY["d_model"])], dim=1))
    assert torch.equal(alone, given)
    assert torch.equal(changed_last[:, :-1], alone[:, :-1])  # position i sees positions <= i only


def test_the_encoder_layer_names_still_import():
    from plainformer.nn.blocks import DecoderLayer, EncoderLayer

    assert pf.EncoderLayer is EncoderLayer is pf.nn.EncoderLayer
    assert pf.DecoderLayer is DecoderLayer is pf.nn.DecoderLayer
    assert pf.Block is pf.models.gpt.Block


# ----------------------------------------------------------------------------- the default path holds no variant

# Each variant of GPTConfig.variants on alone (zero_init needs an untied head).
ONE_VARIANT = {"qk_norm": dict(qk_norm=True), "attn_softcap": dict(attn_softcap=30.0),
               "sliding_window": dict(sliding_window=8), "logit_softcap": dict(logit_softcap=30.0),
               "zero_init": dict(zero_init=True, tie_weights=False), "embed_norm": dict(embed_norm=True),
               "x0_mix": dict(x0_mix=True), "value_residual": dict(value_residual=True),
               "token_shift": dict(token_shift=True), "bigram_embedding": dict(bigram_embedding=True),
               "alibi": dict(pos_encoding="alibi")}
# What a variant is read by: its config fields, the attributes of the modules that carry one, the arguments only
# a variant takes.
VARIANT_NAMES = {*ONE_VARIANT, "alibi_slopes", "window", "softcap", "q_norm", "k_norm", "x0_mix", "value_residual",
                 "token_shift", "bigram", "embed_norm", "shares_values", "x0", "v1", "values", "first_values",
                 "value_mix"}


def _source_tree(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _path(cls: type, method: str) -> dict[str, object]:
    """cls.method and every method of cls that it calls on self, and they on theirs: the path a call takes."""
    found: dict[str, object] = {}
    todo = [method]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found[name] = getattr(cls, name)
        todo += [node.func.attr for node in ast.walk(_source_tree(found[name]))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                 and inspect.isfunction(getattr(cls, node.func.attr, None))]
    return found


def _variants_read(function) -> set[str]:
    """The variant names `function` reads: attributes of self or of a config, arguments it takes or passes, and
    strings (a getattr). An argument's own attributes (kv_cache.window, a cache's property) are no flag."""
    read = set()
    for node in ast.walk(_source_tree(function)):
        if isinstance(node, ast.Attribute) and _is_self_or_config(node.value):
            read.add(node.attr)
        elif isinstance(node, ast.arg):
            read.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            read.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            read.add(node.value)
    return read & VARIANT_NAMES


def _is_self_or_config(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):  # self.config, self.self_attn
        return _is_self_or_config(node.value)
    return isinstance(node, ast.Name) and node.id in ("self", "c", "config")


def test_variant_names_are_every_variant_of_the_config():
    assert set(ONE_VARIANT) == {*pf.models.gpt.VARIANTS, "alibi"}
    for name, fields in ONE_VARIANT.items():
        assert pf.GPTConfig(**TINY, **fields).variants == (name,)


@pytest.mark.parametrize("cls, method", [
    (pf.GPT, "forward"), (pf.Block, "forward"), (pf.MultiHeadAttention, "forward")])
def test_the_default_gpt_block_and_attention_read_no_variant_flag_on_their_forward_path(cls, method):
    path = _path(cls, method)
    assert {name: _variants_read(function) for name, function in path.items() if _variants_read(function)} == {}
    assert len(path) > 1  # the path was followed: forward and what it calls


def test_the_check_finds_the_variants_where_they_are_read():
    for cls in (VariantGPT, VariantBlock, VariantAttention):
        assert set().union(*map(_variants_read, _path(cls, "forward").values())), cls.__name__


def test_the_default_builds_the_papers_classes_and_any_variant_the_variant_classes():
    for config in (pf.GPTConfig(**TINY), pf.GPTConfig.from_preset("default"), pf.GPTConfig.from_preset("moe")):
        model = pf.GPT(config)
        assert type(model) is pf.GPT and config.variants == ()
        assert {(type(b), type(b.self_attn)) for b in model.blocks} == {(pf.Block, pf.MultiHeadAttention)}
    for fields in ONE_VARIANT.values():
        model = pf.GPT(pf.GPTConfig(**TINY, **fields))
        assert type(model) is VariantGPT
        assert {(type(b), type(b.self_attn)) for b in model.blocks} == {(VariantBlock, VariantAttention)}


def test_the_first_variant_block_hands_its_values_on_and_a_later_one_mixes_its_own_with_them():
    """v_1 = LN_1(x) W^V of the first block; a later block attends λ · LN_1(x) W^V + (1 − λ) · v_1, and hands
    v_1 on unchanged."""
    model = moved_off_start(_gpt(value_residual=True)).double()
    first, second = model.blocks
    x = torch.randn(2, 6, TINY["d_model"], dtype=torch.float64)
    with torch.no_grad():
        out, v1 = first(x)
        assert torch.equal(v1, first.self_attn.project_v(first.norm1(x)))
        assert torch.equal(out, pf.Block.forward(first, x))  # the first block reads its own values
        out, handed = second(x, v1=v1)
        assert handed is v1
        h = second.norm1(x)
        lam = second.value_residual.lam
        values = lam * second.self_attn.project_v(h) + (1 - lam) * v1
        x = x + second.self_attn(h, h, h, second.own_mask(x), values=values)
        assert_close(out, x + second.ff(second.norm2(x)), "a later block")


# ----------------------------------------------------------------------------- KV-cached decoding
# Cached, chunked and uncached decoding against the full pass are two of our paths that differ only in
# the order of their sums: the models are float64 and logits agree to 1e-10 (tokens exactly).

CACHE_VARIANTS = {
    "learned": dict(pos_encoding="learned"),
    "rope": dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu"),
    "sinusoidal": dict(pos_encoding="sinusoidal"),
    "gqa-rope": dict(pos_encoding="rope", n_kv_heads=2),
    "mqa-learned": dict(pos_encoding="learned", n_kv_heads=1, bias=True),
    "issue 49": dict(GPT_VARIANTS_49, pos_encoding="rope", norm="rmsnorm", n_kv_heads=2),
    "issue 49 moe": dict(GPT_VARIANTS_49, n_experts=4, top_k=2, first_dense_layers=1),
    "qk-norm-gqa-rope": dict(pos_encoding="rope", norm="rmsnorm", n_kv_heads=2, qk_norm=True),
    "softcap-learned": dict(pos_encoding="learned", attn_softcap=0.05),  # scores at init ~0.05: tanh bends
    "alibi": dict(pos_encoding="alibi"),
    "alibi-gqa-softcap-flash": dict(pos_encoding="alibi", n_kv_heads=2, attn_softcap=0.05, backend="flash"),
    "window-rope": dict(pos_encoding="rope", norm="rmsnorm", sliding_window=5),
    "window-gqa-sdpa": dict(pos_encoding="rope", n_kv_heads=2, sliding_window=4, backend="sdpa"),
    "every-variant-flash": dict(pos_encoding="alibi", n_kv_heads=2, qk_norm=True, attn_softcap=0.05,
                                sliding_window=5, backend="flash"),
    "every issue 49 variant": dict(GPT_VARIANTS_49, pos_encoding="rope", norm="rmsnorm", n_kv_heads=2, qk_norm=True,
                                   attn_softcap=0.05, sliding_window=5),
}


def _cache_model(variant: str) -> pf.GPT:
    """The variant in float64, moved off its start (see `moved_off_start`)."""
    return moved_off_start(_gpt(**CACHE_VARIANTS[variant])).double()


def _decode(model: pf.GPT, prompt: torch.Tensor, steps: int, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens (B, steps), their logits (B, steps, V)) from `iter_generate`."""
    with torch.no_grad():
        pairs = list(iter_generate(model, prompt, steps, **options))
    return torch.stack([t for t, _ in pairs], 1), torch.stack([z for _, z in pairs], 1)


@pytest.mark.parametrize("variant", CACHE_VARIANTS)
@pytest.mark.parametrize("decoder", ["model", "model.decoder()"])
def test_cached_logits_at_every_generated_position_equal_the_full_forward_pass(variant, decoder):
    model = _cache_model(variant)
    prompt = _tokens(2, 5)
    steps = TINY["block_size"] - prompt.shape[1]
    tokens, logits = _decode(model if decoder == "model" else model.decoder(), prompt, steps,
                             temperature=1.0, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(torch.cat((prompt, tokens), dim=1)[:, :-1])[0]
    assert_close(logits, full[:, prompt.shape[1] - 1:], "cached vs full logits")


@pytest.mark.parametrize("variant", CACHE_VARIANTS)
def test_chunked_prefill_into_the_cache_equals_the_full_pass(variant):
    model = _cache_model(variant)
    idx = _tokens(2, 20)
    caches = model.new_kv_caches(2)
    with torch.no_grad():
        chunks = [model(idx[:, a:b], kv_caches=caches)[0] for a, b in ((0, 3), (3, 4), (4, 11), (11, 20))]
        full = model(idx)[0]
    assert_close(torch.cat(chunks, dim=1), full, "chunked vs full logits")


@pytest.mark.parametrize("variant", CACHE_VARIANTS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_without_cache_produces_the_same_tokens(variant, temperature):
    model = _cache_model(variant)
    prompt = _tokens(3, 4)
    outputs = [model.generate(prompt, 18, temperature=temperature, use_cache=use_cache,
                              generator=torch.Generator().manual_seed(5))
               for use_cache in (True, False)]
    assert outputs[0].shape == (3, 22)
    assert torch.equal(outputs[0][:, :4], prompt)
    assert torch.equal(outputs[0], outputs[1])


def test_bf16_decoding_at_batch_one_follows_the_bf16_full_pass_and_leaves_onednn_alone():
    """A batch-1 bf16 step runs on the kernel measured fastest for one row (see inference.linear_kernels): the
    logits agree with the bf16 full pass up to bf16 rounding (8 significant bits: two units of 2^-8
    relative to the largest logit), and no process-wide switch (oneDNN's) is touched."""
    model = measure_kernels(_gpt().to(torch.bfloat16))
    prompt = _tokens(1, 5)
    enabled = torch.backends.mkldnn.enabled
    tokens, logits = _decode(model.decoder(), prompt, 15, temperature=0)
    assert torch.backends.mkldnn.enabled == enabled
    with torch.no_grad():
        full = model(torch.cat((prompt, tokens), dim=1)[:, :-1])[0][:, prompt.shape[1] - 1:].float()
    assert (logits.float() - full).abs().max() <= 2 * 2**-8 * full.abs().max()


def _sliding_reference(model: pf.GPT, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logits generation.py documents: the context is at most block_size tokens; when it would grow
    past that, it restarts from the last block_size // 2 tokens, then grows again. One full pass each."""
    block = model.block_size
    sequence = torch.cat((prompt, tokens), dim=1)
    start, logits = max(0, prompt.shape[1] - block), []
    for length in range(prompt.shape[1], sequence.shape[1]):
        if length - start > block:
            start = length - block // 2
        logits.append(model(sequence[:, start:length])[0][:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("variant", ["learned", "rope", "sinusoidal", "issue 49", "alibi", "window-rope"])
@pytest.mark.parametrize("prompt_length", [5, 30])  # 30 > block_size: the prompt is cut to its last block
def test_sliding_context_past_block_size_matches_the_documented_windows(variant, prompt_length):
    model = _cache_model(variant)
    prompt = _tokens(2, prompt_length)
    steps = 3 * TINY["block_size"]
    tokens, cached = _decode(model.decoder(), prompt, steps, temperature=1.0,
                             generator=torch.Generator().manual_seed(7))
    uncached_tokens, uncached = _decode(model, prompt, steps, temperature=1.0, use_cache=False,
                                        generator=torch.Generator().manual_seed(7))
    assert torch.equal(tokens, uncached_tokens)
    with torch.no_grad():
        expected = _sliding_reference(model, prompt, tokens)
    assert_close(cached, expected, "cached logits past block_size")
    assert_close(uncached, expected, "uncached logits past block_size")


def test_a_windowed_model_decodes_from_caches_of_its_window_and_counts_their_bytes():
    model = _gpt(pos_encoding="rope", sliding_window=5).double()
    caches = model.new_kv_caches(2)
    with torch.no_grad():
        model(_tokens(2, 9), kv_caches=caches)
        model(_tokens(2, 1), kv_caches=caches)
    assert all(c.capacity == 5 and c.length == 10 and c.keys().shape == (2, 4, 5, 8) for c in caches)
    full = memory_estimates.decoding_bytes(model.config.replace(sliding_window=None), 1, 4)
    windowed = memory_estimates.decoding_bytes(model.config, 1, 4)
    assert full - windowed == TINY["n_layers"] * 2 * TINY["d_model"] * (TINY["block_size"] - 5) * 4


def test_generate_runs_in_eval_mode_and_restores_training_mode():
    model = _gpt(dropout=0.5).train()
    prompt = _tokens(1, 3)
    first, second = (model.generate(prompt, 10, temperature=0) for _ in range(2))
    assert torch.equal(first, second)  # dropout off while generating
    assert model.training


# ----------------------------------------------------------------------------- the block variants of issue 49

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """rope(x, p) = x ⊙ cos(p θ) + [-x₂, x₁] ⊙ sin(p θ), θ_i = base^(-2i/d), for x (B, H, n, d) at p = 0 .. n-1."""
    n, d = x.shape[-2:]
    angles = torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin


def _reference_logits(model: pf.GPT, idx: torch.Tensor) -> torch.Tensor:
    """The whole model written out from the papers' equations in float64, with the model's weights:

        e_t = E[x_t] + σ(g) ⊙ E[x_{t−1}] + B[x_{t−1}·V + x_t] (+ P_t)    (no predecessor at t = 0)
        x = x0 = RMSNorm(e)
        per block l:  x = a_l x + b_l x0;  q, k, v = RMSNorm(x) W^{Q,K,V}ᵀ (rope on q, k)
                      v = λ_l v + (1 − λ_l) v_1 for l ≥ 2 (v_1: block 1's v)
                      x = x + softmax(q kᵀ / √d_k, causal) v W^Oᵀ;  x = x + max(0, RMSNorm(x) W_1ᵀ)² W_2ᵀ
        logits = c · tanh(RMSNorm(x) W_headᵀ / c)
    """
    c, w = model.config, {name: t.detach().double() for name, t in model.state_dict().items()}
    (batch, n), heads, kv_heads, d = idx.shape, c.n_heads, c.n_kv_heads or c.n_heads, c.head_dim
    embedding = w["token_embedding.weight"]
    previous = torch.cat((idx[:, :1], idx[:, :-1]), dim=1)
    has = (torch.arange(n) > 0).double()[None, :, None]
    e = (embedding[idx] + has * torch.sigmoid(w["token_shift.gate"]) * embedding[previous]
         + has * w["bigram.table.weight"][previous * c.vocab_size + idx])
    if c.pos_encoding == "learned":
        e = e + w["position.embedding.weight"][:n]
    x = x0 = _rms(e, w["embed_norm.weight"], c.norm_eps)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    v1 = None
    for layer in range(c.n_layers):
        p = f"blocks.{layer}."
        x = w[p + "x0_mix.a"] * x + w[p + "x0_mix.b"] * x0
        h = _rms(x, w[p + "norm1.weight"], c.norm_eps)

        def heads_of(name: str, count: int, h: torch.Tensor = h, p: str = p) -> torch.Tensor:
            return (h @ w[p + f"self_attn.{name}.weight"].T).view(batch, n, count, d).transpose(1, 2)

        q, k, v = heads_of("W_q", heads), heads_of("W_k", kv_heads), heads_of("W_v", kv_heads)
        if v1 is None:
            v1 = v
        else:
            lam = w[p + "value_residual.lam"]
            v = lam * v + (1 - lam) * v1
        if c.pos_encoding == "rope":
            q, k = _rotate(q, c.rope_base), _rotate(k, c.rope_base)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, -math.inf)
        out = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(batch, n, heads * d)
        x = x + out @ w[p + "self_attn.W_o.weight"].T
        h = _rms(x, w[p + "norm2.weight"], c.norm_eps)
        x = x + torch.relu(h @ w[p + "ff.W_1.weight"].T) ** 2 @ w[p + "ff.W_2.weight"].T
    z = _rms(x, w["norm.weight"], c.norm_eps) @ w["lm_head.weight"].T
    return c.logit_softcap * torch.tanh(z / c.logit_softcap)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_every_variant_at_once_equals_the_float64_forward_written_from_their_equations(pos_encoding, backend):
    model = moved_off_start(_gpt(**GPT_VARIANTS_49, n_layers=3, n_kv_heads=2, norm="rmsnorm",
                                 pos_encoding=pos_encoding, backend=backend))
    idx = _tokens(3, 12)
    with torch.no_grad():
        logits = model(idx)[0]
    assert_close(logits, _reference_logits(model, idx).float(), "logits")


@pytest.mark.parametrize("cap", [0.5, 30.0])
def test_logit_softcap_is_c_tanh_of_the_uncapped_logits_over_c_in_float64(cap):
    capped = _gpt(logit_softcap=cap)
    plain = _gpt()
    plain.load_state_dict(capped.state_dict())
    idx = _tokens(2, 10)
    with torch.no_grad():
        z = plain.double()(idx)[0]
        logits, loss = capped(idx, idx)
    expected = cap * torch.tanh(z / cap)
    assert_close(logits, expected.float(), "capped logits")
    assert logits.abs().max() < cap
    assert_close(loss, F.cross_entropy(expected.flatten(0, 1), idx.flatten()).float(), "loss of the capped logits")


@pytest.mark.parametrize("moe", [False, True])
def test_zero_init_starts_every_block_as_the_identity_and_every_logit_at_zero(moe):
    model = _gpt(zero_init=True, tie_weights=False, **(dict(n_experts=4, top_k=2) if moe else {}))
    for block in model.blocks:
        assert all(bool((w == 0).all()) for w in block.residual_projections())
    idx = _tokens(2, 10)
    with torch.no_grad():
        embedded = model.token_embedding(idx) + model.position.embedding.weight[:10]  # the embedding path
        assert torch.equal(model.hidden_states(idx), embedded)
        logits, loss = model(idx, idx)
    assert torch.equal(logits, torch.zeros_like(logits))
    assert abs(loss.item() - math.log(TINY["vocab_size"])) < 1e-5  # the uniform prediction


def test_with_zero_init_gradients_reach_every_parameter_once_the_head_and_projections_move():
    """At the start only the head has a gradient (the others' pass through W_headᵀ = 0); a step moves it, the
    next W_o and W_2, and then every parameter has a gradient."""
    model = _gpt(zero_init=True, tie_weights=False).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    idx = _tokens(4, 16)
    for step in range(3):
        optimizer.zero_grad()
        model(idx, torch.roll(idx, -1, 1))[1].backward()
        with_gradient = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        if step == 0:
            assert with_gradient == {"lm_head.weight"}
        optimizer.step()
    assert with_gradient == {name for name, _ in model.named_parameters()}


def test_zero_init_with_a_head_tied_to_the_embedding_is_refused():
    with pytest.raises(ValueError, match="zero_init needs tie_weights=False: a zero head tied to the token "
                                         "embedding would zero the embedding"):
        pf.GPTConfig(**TINY, zero_init=True)


def test_embed_norm_normalises_the_embedding_output_with_the_models_eps():
    model = _gpt(embed_norm=True, norm_eps=1e-3)
    assert isinstance(model.embed_norm, pf.RMSNorm) and model.embed_norm.eps == 1e-3
    with torch.no_grad():
        model.embed_norm.weight.normal_()
        for block in model.blocks:  # the blocks add nothing: hidden_states is the embedding output
            for weight in block.residual_projections():
                weight.zero_()
        idx = _tokens(2, 6)
        e = (model.token_embedding(idx) + model.position.embedding.weight[:6]).double()
        expected = _rms(e, model.embed_norm.weight.double(), 1e-3)
        assert_close(model.hidden_states(idx), expected.float(), "normalised embedding")


def test_the_variants_are_new_submodules_and_parameters_only_where_switched_on():
    plain = _gpt()
    model = _gpt(**GPT_VARIANTS_49)
    added = set(dict(model.named_parameters())) - set(dict(plain.named_parameters()))
    assert added == {"token_shift.gate", "bigram.table.weight", "embed_norm.weight", "lm_head.weight",
                     "blocks.0.x0_mix.a", "blocks.0.x0_mix.b", "blocks.1.x0_mix.a", "blocks.1.x0_mix.b",
                     "blocks.1.value_residual.lam"}  # the first block keeps its own values: no λ
    assert model.bigram.table.weight.shape == (TINY["vocab_size"] ** 2, TINY["d_model"])
    assert model.bigram.table.weight.abs().sum() == 0  # a no-op at the start, as the gate-free terms


def test_float64_gradcheck_of_the_loss_in_lambda_a_b_and_the_token_shift_gate():
    model = moved_off_start(_gpt(**GPT_VARIANTS_49, n_layers=3, d_model=16, n_heads=2, d_ff=16)).double()
    names = ["blocks.1.value_residual.lam", "blocks.2.value_residual.lam", "blocks.0.x0_mix.b", "blocks.1.x0_mix.a",
             "blocks.2.x0_mix.b", "token_shift.gate"]
    values = tuple(dict(model.named_parameters())[name].detach().clone().requires_grad_() for name in names)
    idx = _tokens(2, 7)

    def loss(*values: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(names, values, strict=True)), (idx, idx))[1]

    assert torch.autograd.gradcheck(loss, values)


def test_padded_rows_of_every_variant_prefilled_and_decoded_give_their_logits_alone():
    """A row's first real token has no predecessor: the padding before it is none (token shift, bigram)."""
    model = _cache_model("issue 49")
    idx, real = _left_padded(3, 10)
    step = _tokens(3, 1, seed=2)
    with torch.no_grad():
        caches = model.new_kv_caches(3)
        prefilled = model(idx, kv_caches=caches, attention_mask=real)[0]
        decoded = model(step, kv_caches=caches, attention_mask=torch.cat((real, real[:, :1] | True), dim=1))[0]
        for row in range(3):
            alone = model(torch.cat((idx[row:row + 1, 3 * row:], step[row:row + 1]), dim=1))[0]
            assert_close(prefilled[row, 3 * row:], alone[0, :-1], f"row {row} prefilled")
            assert_close(decoded[row, -1], alone[0, -1], f"row {row} decoded")


# ----------------------------------------------------------------------------- checkpoints

def test_a_model_with_every_variant_saves_and_loads_bit_for_bit(tmp_path):
    model = moved_off_start(_gpt(**GPT_VARIANTS_49, pos_encoding="rope"))
    pf.save_checkpoint(tmp_path / "ckpt", model=model, family="gpt", model_config=model.config.to_dict())
    loaded = pf.GPT.from_checkpoint(tmp_path / "ckpt")
    assert loaded.config == model.config
    assert all(torch.equal(t, model.state_dict()[name]) for name, t in loaded.state_dict().items())
    idx = _tokens(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model.eval()(idx)[0])


def test_a_checkpoint_written_before_the_variants_loads_with_each_one_off(tmp_path):
    model = _gpt()
    before = {k: v for k, v in model.config.to_dict().items() if k not in GPT_VARIANTS_49 or k == "activation"
              or k == "tie_weights"}  # the config.json of a checkpoint from before: no such keys
    assert "value_residual" not in before and "logit_softcap" not in before
    pf.save_checkpoint(tmp_path / "ckpt", model=model, family="gpt", model_config=before)
    loaded = pf.GPT.from_checkpoint(tmp_path / "ckpt")
    assert loaded.config == model.config
    assert (loaded.config.logit_softcap, loaded.config.zero_init, loaded.config.value_residual) == (None, False, False)
    idx = _tokens(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model(idx)[0])
