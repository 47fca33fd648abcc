"""Hugging Face directories in and out: tiny GPT-2, Llama and Mixtral models built locally with random
weights (no network), plainformer GPTs written for `AutoModelForCausalLM`, and tokenizers for
`AutoTokenizer`."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import tokenizers as tokenizers_lib
import torch
import transformers
from safetensors.torch import load_file, save_file

import plainformer as pf
from plainformer.cli import main
from plainformer.hf.gpt import weight_map
from plainformer.hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer

TOLERANCE = 1e-4  # fp32 logits, as the issue states
TINY = dict(vocab_size=61, block_size=48, n_layers=2, n_heads=4, d_model=32, d_ff=64, dropout=0.0)
GPT2 = dict(pos_encoding="learned", norm="layernorm", activation="gelu_tanh", bias=True, tie_weights=True)
LLAMA = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", bias=False, norm_eps=1e-6,
             rope_base=500.0)
# Mixtral's loss has no z-loss, so a Mixtral loads with z_loss_coef=0; its aux-loss weight is carried.
MIXTRAL = dict(LLAMA, n_experts=4, top_k=2, aux_loss_coef=0.02, z_loss_coef=0.0)
CONFIGS = {
    "gpt2": GPT2,
    "gpt2-untied": {**GPT2, "tie_weights": False},
    "llama-gqa-untied": {**LLAMA, "n_kv_heads": 2, "tie_weights": False},
    "llama-tied": {**LLAMA, "tie_weights": True},
    "llama-bias": {**LLAMA, "bias": True, "n_kv_heads": 1, "tie_weights": False},
    "mixtral-gqa-untied": {**MIXTRAL, "n_kv_heads": 2, "tie_weights": False},
    "mixtral-tied-top1": {**MIXTRAL, "top_k": 1, "tie_weights": True},
}
ARCHITECTURES = {"learned": "GPT2LMHeadModel", "rope": "LlamaForCausalLM", "experts": "MixtralForCausalLM"}


def _architecture(name: str) -> str:
    c = CONFIGS[name]
    return ARCHITECTURES["experts" if c.get("n_experts") else c["pos_encoding"]]


def _tokens(batch: int = 2, n: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(TINY["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from the default init, so attention is far from uniform and norms are not identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            std = 0.5 if parameter.ndim == 1 else 0.15
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std
                            + (1.0 if parameter.ndim == 1 else 0.0))


def _ours(name: str) -> pf.GPT:
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY, **CONFIGS[name])).eval()
    _randomize(model)
    return model


def _hf_config(name: str) -> transformers.PretrainedConfig:
    """The Hugging Face config of the same shape, written with transformers' own names (independent
    of plainformer's translation)."""
    c = {**TINY, **CONFIGS[name]}
    if c["pos_encoding"] == "learned":
        return transformers.GPT2Config(
            vocab_size=c["vocab_size"], n_positions=c["block_size"], n_embd=c["d_model"], n_layer=c["n_layers"],
            n_head=c["n_heads"], n_inner=c["d_ff"], activation_function="gelu_new", resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=c["tie_weights"],
            bos_token_id=None, eos_token_id=None)
    if c.get("n_experts"):
        return transformers.MixtralConfig(
            vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["d_ff"],
            num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
            num_key_value_heads=c.get("n_kv_heads") or c["n_heads"], max_position_embeddings=c["block_size"],
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            num_local_experts=c["n_experts"], num_experts_per_tok=c["top_k"], router_aux_loss_coef=0.02,
            tie_word_embeddings=c["tie_weights"], sliding_window=None, bos_token_id=None, eos_token_id=None)
    return transformers.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["d_ff"],
        num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
        num_key_value_heads=c.get("n_kv_heads") or c["n_heads"], max_position_embeddings=c["block_size"],
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        attention_bias=c["bias"], mlp_bias=c["bias"], tie_word_embeddings=c["tie_weights"],
        bos_token_id=None, eos_token_id=None)


def _hf_directory(name: str, tmp_path) -> tuple[transformers.PreTrainedModel, object]:
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(name)).eval()
    _randomize(theirs)
    theirs.save_pretrained(tmp_path / "hf")
    return theirs, tmp_path / "hf"


def _hf_logits(model: transformers.PreTrainedModel, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def _assert_same_greedy_tokens(ours: pf.GPT, theirs: transformers.PreTrainedModel, prompt: torch.Tensor) -> None:
    expected = theirs.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert torch.equal(ours.generate(prompt, 32, temperature=0.0), expected)


# ----------------------------------------------------------------------------- Hugging Face -> plainformer

@pytest.mark.parametrize("name", CONFIGS)
def test_hugging_face_model_loads_with_equal_logits_and_greedy_tokens(name, tmp_path):
    theirs, directory = _hf_directory(name, tmp_path)
    ours = pf.load_hf(directory)
    assert isinstance(ours, pf.GPT) and not ours.training
    assert ours.config == pf.GPTConfig(**TINY, **CONFIGS[name])
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(ours(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE
    _assert_same_greedy_tokens(ours, theirs, idx[:1, :8])


def test_a_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(_hf_config("llama-gqa-untied")).eval()
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(pf.load_hf(tmp_path)(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE


def test_gpt2_mask_buffers_are_ignored_by_suffix_and_other_keys_refused(tmp_path):
    theirs, directory = _hf_directory("gpt2", tmp_path)
    state = load_file(directory / "model.safetensors")
    n = TINY["block_size"]
    for i in range(TINY["n_layers"]):  # what older GPT-2 checkpoints carry
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, n, n))
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # a tied head saved twice
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(pf.load_hf(directory)(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE
    state["transformer.h.0.attn.extra.weight"] = torch.zeros(3)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weights .*transformer.h.0.attn.extra.weight"):
        pf.load_hf(directory)


def test_a_missing_weight_is_named(tmp_path):
    _, directory = _hf_directory("llama-tied", tmp_path)
    state = load_file(directory / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights .*model.layers.1.mlp.up_proj.weight"):
        pf.load_hf(directory)


def test_a_config_of_far_more_layers_than_the_weights_is_refused_before_building(tmp_path):
    _, directory = _hf_directory("llama-tied", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    with pytest.raises(ValueError, match=r"describes a model of [\d,]+ parameters but its weights hold [\d,]+ values"):
        pf.load_hf(directory)  # at once: 100,000 blocks are never built


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, "rope"),
    ({"head_dim": 16}, "head_dim"),
    ({"model_type": "mistral"}, "mistral"),
])
def test_a_llama_config_plainformer_cannot_express_is_refused_naming_the_field(change, field, tmp_path):
    _, directory = _hf_directory("llama-tied", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=field):
        pf.load_hf(directory)


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


@pytest.mark.parametrize("change, field", [
    ({"sliding_window": 8}, "sliding_window=8"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_a_mixtral_config_plainformer_cannot_express_is_refused_naming_the_field(change, field, tmp_path):
    _, directory = _hf_directory("mixtral-tied-top1", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=field):
        pf.load_hf(directory)


# ----------------------------------------------------------------------------- plainformer -> Hugging Face

@pytest.mark.parametrize("name", CONFIGS)
def test_saved_model_loads_in_transformers_with_equal_logits_and_greedy_tokens(name, tmp_path):
    ours = _ours(name)
    pf.save_hf(ours, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == _architecture(name)
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(ours(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE
    _assert_same_greedy_tokens(ours, theirs, idx[:1, :8])


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_through_hugging_face_keeps_every_weight_bit_for_bit(name, tmp_path):
    ours = _ours(name)
    pf.save_hf(ours, tmp_path)
    back = pf.load_hf(tmp_path)
    assert back.config == ours.config
    expected = ours.state_dict()
    assert back.state_dict().keys() == expected.keys()
    for key, value in back.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert (back.lm_head.weight is back.token_embedding.weight) == ours.config.tie_weights


def test_a_bfloat16_model_is_written_in_bfloat16(tmp_path):
    pf.save_hf(_ours("llama-tied").to(torch.bfloat16), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}


def test_a_tied_head_is_written_once(tmp_path):
    pf.save_hf(_ours("gpt2"), tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    pf.save_hf(_ours("gpt2-untied"), tmp_path / "untied")
    assert "lm_head.weight" in load_file(tmp_path / "untied" / "model.safetensors")


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
])
def test_a_config_no_layout_expresses_is_refused_naming_the_field(overrides, field, tmp_path):
    model = pf.GPT(pf.GPTConfig(**TINY, **overrides))
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        pf.save_hf(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_a_router_balancing_bias_is_refused_as_mixtral_routes_by_scores_alone(tmp_path):
    model = _ours("mixtral-tied-top1")
    model.blocks[1].ff.expert_bias[2] = -1.0
    with pytest.raises(ValueError, match="blocks.1.ff.expert_bias must be zero"):
        pf.save_hf(model, tmp_path)


def test_plainformer_export_writes_an_moe_checkpoint_as_mixtral(tmp_path):
    tokenizer = pf.CharTokenizer(pf.load_text())
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**{**TINY, "vocab_size": tokenizer.vocab_size}, **CONFIGS["mixtral-gqa-untied"]))
    _randomize(model.eval())
    pf.save_checkpoint(tmp_path / "run", model=model, family="gpt", model_config=model.config.to_dict(),
                       tokenizer=tokenizer)
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "MixtralForCausalLM"
    idx = torch.tensor([tokenizer.encode("To be, or not to be")])
    with torch.no_grad():
        assert _max_error(model(idx)[0], _hf_logits(theirs, idx)) <= TOLERANCE


def test_nanogpts_bias_free_gpt_is_written_as_gpt2_with_zero_biases(tmp_path):
    """nanoGPT's recipe (`nanogpt-cpu`: learned positions, LayerNorm, bias=False) has GPT-2's layout once
    every bias is a zero, which computes the same function."""
    torch.manual_seed(0)
    ours = pf.GPT(pf.GPTConfig.from_preset("nanogpt-cpu", vocab_size=TINY["vocab_size"])).eval()
    _randomize(ours)
    pf.save_hf(ours, tmp_path)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert all(p.abs().sum() == 0 for name, p in theirs.named_parameters() if name.endswith(".bias"))
    idx = _tokens()
    with torch.no_grad():
        assert _max_error(ours(idx)[0], _hf_logits(theirs, idx)) <= 1e-4


def test_a_vocabulary_padded_past_the_tokenizer_is_cropped(tmp_path):
    tokenizer = pf.CharTokenizer("abcdefghij klmnop\n")
    model = pf.GPT(pf.GPTConfig(**{**TINY, "vocab_size": 64}, **LLAMA)).eval()
    model.tokenizer = tokenizer
    pf.save_hf(model, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.config.vocab_size == tokenizer.vocab_size
    idx = torch.tensor([tokenizer.encode("abc kl\nop")])
    with torch.no_grad():
        assert _max_error(model(idx)[0][..., :tokenizer.vocab_size], _hf_logits(theirs, idx)) <= TOLERANCE


def test_the_library_map_names_every_parameter_once():
    for name in CONFIGS:
        model = _ours(name)
        ours = [(o, w.expert) for w in weight_map(model.config) for o in w.ours]
        # A tied head appears once, as the embedding; stacked experts (E, out, in) once per expert.
        parameters = [(n, e) for n, p in model.named_parameters() for e in (range(len(p)) if p.ndim == 3 else [None])]
        assert sorted(ours, key=str) == sorted(parameters, key=str), name


# ----------------------------------------------------------------------------- BERT, under the same roof

def test_bert_saves_and_loads_through_the_same_entry_points(tmp_path):
    torch.manual_seed(0)
    bert = pf.BertModel(pf.BertConfig(vocab_size=40, max_len=16, n_layers=2, n_heads=2, d_model=16,
                                      d_ff=32)).eval()
    pf.save_hf(bert, tmp_path)
    back = pf.load_hf(tmp_path)
    assert isinstance(back, pf.BertModel)
    for key, value in back.state_dict().items():
        assert torch.equal(value, bert.state_dict()[key]), key
    theirs = transformers.AutoModel.from_pretrained(tmp_path).eval()
    idx = torch.randint(1, 40, (2, 10), generator=torch.Generator().manual_seed(0))  # no [PAD] (id 0)
    with torch.no_grad():
        assert _max_error(bert(idx).last_hidden_state, theirs(idx).last_hidden_state) <= TOLERANCE


def test_a_plainformer_checkpoint_is_not_taken_for_a_hugging_face_directory(tmp_path):
    model = _ours("gpt2")
    pf.save_checkpoint(tmp_path, model=model, family="gpt", model_config=model.config.to_dict())
    with pytest.raises(ValueError, match="no model_type: not a Hugging Face model directory"):
        pf.load_hf(tmp_path)


def test_save_refuses_other_models(tmp_path):
    with pytest.raises(TypeError, match="model must be a GPT or a BertModel, got Linear"):
        pf.save_hf(torch.nn.Linear(2, 2), tmp_path)


# ----------------------------------------------------------------------------- tokenizers

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


@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece"])
def test_auto_tokenizer_gives_our_ids_and_texts_on_corpus_lines(kind, tokenizers, corpus_lines, tmp_path):
    ours = tokenizers[kind]
    save_hf_tokenizer(ours, tmp_path, model_max_length=128)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = [ours.encode(line) for line in corpus_lines]
    assert theirs(corpus_lines)["input_ids"] == ids
    assert [theirs.decode(i, skip_special_tokens=True) for i in ids] == [ours.decode(i) for i in ids]
    if kind != "wordpiece":  # WordPiece normalises (lowercases), so only the others give the line back
        assert [ours.decode(i) for i in ids] == corpus_lines
    assert theirs.model_max_length == 128
    for role, token in ours.special_tokens.items():
        assert getattr(theirs, f"{role}_token") == token


@pytest.mark.parametrize("kind", ["char", "bpe", "wordpiece"])
def test_a_hugging_face_tokenizer_json_loads_as_ours(kind, tokenizers, corpus_lines, tmp_path):
    """Without plainformer's side file: transformers' own save of the tokenizer."""
    ours = tokenizers[kind]
    save_hf_tokenizer(ours, tmp_path / "ours")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    assert not (tmp_path / "theirs" / "plainformer_tokenizer.json").exists()
    loaded = load_hf_tokenizer(tmp_path / "theirs")
    assert loaded.kind == kind and loaded.special_tokens == ours.special_tokens
    assert loaded.encode_many(corpus_lines) == ours.encode_many(corpus_lines)


def test_save_hf_writes_the_models_tokenizer(tokenizers, tmp_path):
    model = pf.GPT(pf.GPTConfig(**{**TINY, "vocab_size": tokenizers["bpe"].vocab_size}, **LLAMA))
    model.tokenizer = tokenizers["bpe"]
    pf.save_hf(model, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.eos_token_id == model.tokenizer.eos_id
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == model.tokenizer.eos_id
    assert pf.load_hf(tmp_path).tokenizer.fingerprint == model.tokenizer.fingerprint


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


def _gpt2_tokenizer_files(tok, directory, config: dict | None = None) -> None:
    """GPT-2's original two tokenizer files, and a tokenizer_config.json when `config` is given."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(directory))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", **config}))


@pytest.mark.parametrize("config", [{}, {"add_prefix_space": True}, {"add_bos_token": True, "add_eos_token": True}])
def test_gpt2_vocab_and_merges_alone_load_with_auto_tokenizers_ids(config, gpt2_bpe, corpus_lines, tmp_path):
    _gpt2_tokenizer_files(gpt2_bpe, tmp_path, config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_hf_tokenizer(tmp_path)
    lines = [*corpus_lines, "a<|endoftext|>b", "  two spaces, é and 日本"]
    ids = ours.encode_many(lines)
    assert theirs(lines)["input_ids"] == ids
    assert ours.vocab_size == len(theirs) and ours.eos_id == theirs.eos_token_id == 500
    assert [ours.decode(i) for i in ids] == [theirs.decode(i, skip_special_tokens=True) for i in ids]
    if not config.get("add_prefix_space"):  # which decodes to the line after a space
        assert [ours.decode(i) for i in ids[:-2]] == corpus_lines


def test_load_hf_of_a_gpt2_directory_with_only_vocab_and_merges_has_its_tokenizer(gpt2_bpe, corpus_lines,
                                                                                 tmp_path):
    _, directory = _hf_directory("gpt2", tmp_path)
    _gpt2_tokenizer_files(gpt2_bpe, directory)  # config.json's model_type tells AutoTokenizer the class
    assert not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists()
    expected = transformers.AutoTokenizer.from_pretrained(directory)(corpus_lines)["input_ids"]
    model = pf.load_hf(directory)
    assert model.tokenizer.kind == "bpe" and model.tokenizer.encode_many(corpus_lines) == expected
