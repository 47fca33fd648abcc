"""The tiny GPT-2, Llama, Mistral, Qwen3 and Mixtral models the Hugging Face tests share: our configs,
transformers' configs of the same shapes written with transformers' own names (independent of plainformer's
translation), directories transformers saves, and the comparisons the tests make."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import plainformer as pf

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
    "gpt2-relu2": {**GPT2, "activation": "relu2"},  # Primer's max(0, x)², in transformers' ACT2FN
    "llama-gqa-untied": {**LLAMA, "n_kv_heads": 2, "tie_weights": False},
    "llama-tied": {**LLAMA, "tie_weights": True},
    "llama-bias": {**LLAMA, "bias": True, "n_kv_heads": 1, "tie_weights": False},
    "qwen3-gqa-untied": {**LLAMA, "qk_norm": True, "n_kv_heads": 2, "tie_weights": False},
    "qwen3-tied": {**LLAMA, "qk_norm": True, "tie_weights": True},
    "mixtral-gqa-untied": {**MIXTRAL, "n_kv_heads": 2, "tie_weights": False},
    "mixtral-tied-top1": {**MIXTRAL, "top_k": 1, "tie_weights": True},
    # A window of 5 keys: the 16-token sequences and the 40 tokens of greedy decoding exceed 2w.
    "mistral-gqa-untied": {**LLAMA, "sliding_window": 5, "n_kv_heads": 2, "tie_weights": False},
    "mistral-tied": {**LLAMA, "sliding_window": 5, "tie_weights": True},
    "mixtral-window": {**MIXTRAL, "sliding_window": 5, "n_kv_heads": 2, "tie_weights": False},
    "qwen3-window": {**LLAMA, "qk_norm": True, "sliding_window": 5, "tie_weights": True},
}

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
            n_head=c["n_heads"], n_inner=c["d_ff"],
            activation_function={"gelu_tanh": "gelu_new", "relu2": "relu2"}[c["activation"]], resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=c["tie_weights"],
            bos_token_id=None, eos_token_id=None)
    if c.get("n_experts"):
        return transformers.MixtralConfig(
            vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["d_ff"],
            num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
            num_key_value_heads=c.get("n_kv_heads") or c["n_heads"], max_position_embeddings=c["block_size"],
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            num_local_experts=c["n_experts"], num_experts_per_tok=c["top_k"], router_aux_loss_coef=0.02,
            tie_word_embeddings=c["tie_weights"], sliding_window=c.get("sliding_window"), bos_token_id=None,
            eos_token_id=None)
    if c.get("qk_norm"):
        # Qwen3's window covers the layers from max_window_layers on: 0 puts it on every layer
        window = c.get("sliding_window")
        return transformers.Qwen3Config(
            vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["d_ff"],
            num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
            num_key_value_heads=c.get("n_kv_heads") or c["n_heads"], head_dim=c["d_model"] // c["n_heads"],
            max_position_embeddings=c["block_size"], rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attention_bias=False,
            use_sliding_window=window is not None, sliding_window=window, max_window_layers=0,
            tie_word_embeddings=c["tie_weights"], bos_token_id=None, eos_token_id=None)
    if c.get("sliding_window"):
        return transformers.MistralConfig(
            vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["d_ff"],
            num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
            num_key_value_heads=c.get("n_kv_heads") or c["n_heads"], max_position_embeddings=c["block_size"],
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            sliding_window=c["sliding_window"], tie_word_embeddings=c["tie_weights"], bos_token_id=None,
            eos_token_id=None)
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


def _gpt2_tokenizer_files(tok, directory, config: dict | None = None) -> None:
    """GPT-2's original two tokenizer files, and a tokenizer_config.json when `config` is given."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(directory))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", **config}))
