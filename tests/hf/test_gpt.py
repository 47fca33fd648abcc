"""A GPT's Hugging Face directory in and out (hf/gpt.py): tiny GPT-2, Llama, Mistral, Qwen3 and Mixtral models
built locally with random weights (no network), plainformer GPTs written for `AutoModelForCausalLM`, and tokenizers for
`AutoTokenizer`. The layouts' own refusals are in test_gpt_layouts.py, the dispatch over families in
test_auto.py."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import plainformer as pf
from plainformer.cli import main
from plainformer.hf.gpt import weight_map
from plainformer.hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer
from tests.reference.hf_gpt import (
    CONFIGS,
    LLAMA,
    TINY,
    TOLERANCE,
    _gpt2_tokenizer_files,
    _hf_config,
    _hf_directory,
    _hf_logits,
    _max_error,
    _ours,
    _randomize,
    _tokens,
)

ARCHITECTURES = {"learned": "GPT2LMHeadModel", "rope": "LlamaForCausalLM", "experts": "MixtralForCausalLM",
                 "qk_norm": "Qwen3ForCausalLM", "sliding_window": "MistralForCausalLM"}


def _architecture(name: str) -> str:
    c = CONFIGS[name]
    variant = next((v for v in ("n_experts", "qk_norm", "sliding_window") if c.get(v)), None)
    return ARCHITECTURES[{"n_experts": "experts"}.get(variant, variant) if variant else c["pos_encoding"]]


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


# ----------------------------------------------------------------------------- tokenizers


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
