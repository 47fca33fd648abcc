"""Hugging Face models of the Llama family (Llama, Qwen3, Mistral) built locally from a plainformer GPT's shape,
with the GPT's weights copied in by a name table written here, independent of plainformer's hf/ code.

A GPT with norm="rmsnorm", activation="swiglu", pos_encoding="rope" and bias=False is Llama-shaped:

    plainformer GPT                     Llama family (Qwen3 adds q_norm and k_norm)
    token_embedding                     model.embed_tokens
    blocks.{i}.norm1                    model.layers.{i}.input_layernorm
    blocks.{i}.self_attn.W_q|W_k|W_v|W_o  model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj
    blocks.{i}.self_attn.q_norm|k_norm  model.layers.{i}.self_attn.q_norm|k_norm
    blocks.{i}.norm2                    model.layers.{i}.post_attention_layernorm
    blocks.{i}.ff.W_1|W_3|W_2           model.layers.{i}.mlp.gate_proj|up_proj|down_proj
    norm                                model.norm
    lm_head                             lm_head
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import plainformer as pf

LLAMA_SHAPED = dict(norm="rmsnorm", activation="swiglu", pos_encoding="rope", bias=False)

_LAYER_NAMES = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm",
                "self_attn.W_q": "self_attn.q_proj", "self_attn.W_k": "self_attn.k_proj",
                "self_attn.W_v": "self_attn.v_proj", "self_attn.W_o": "self_attn.o_proj",
                "self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm",
                "ff.W_1": "mlp.gate_proj", "ff.W_3": "mlp.up_proj", "ff.W_2": "mlp.down_proj"}
_OUTSIDE_NAMES = {"token_embedding": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}


def hf_name(ours: str) -> str:
    """Our parameter name -> the Llama family's (`blocks.0.ff.W_1.weight` -> `model.layers.0.mlp.gate_proj.weight`)."""
    module, _, leaf = ours.rpartition(".")
    if module.startswith("blocks."):
        _, index, inner = module.split(".", 2)
        return f"model.layers.{index}.{_LAYER_NAMES[inner]}.{leaf}"
    return f"{_OUTSIDE_NAMES[module]}.{leaf}"


def _common(c: pf.GPTConfig) -> dict:
    """The config keys Qwen3 and Mistral share, in transformers' own names."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                num_key_value_heads=c.n_kv_heads or c.n_heads, head_dim=c.d_model // c.n_heads,
                max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": c.rope_base}, attention_dropout=0.0,
                tie_word_embeddings=c.tie_weights, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama(config: pf.GPTConfig) -> transformers.PreTrainedModel:
    """LlamaForCausalLM of the GPT's shape, eager attention (which a test may replace by another model's)."""
    hf = transformers.LlamaConfig(**_common(config), attention_bias=False, mlp_bias=False)
    hf._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf).eval()


def qwen3(config: pf.GPTConfig) -> transformers.PreTrainedModel:
    """Qwen3ForCausalLM of the GPT's shape (QK-norm; no sliding window)."""
    hf = transformers.Qwen3Config(**_common(config), attention_bias=False, use_sliding_window=False)
    return transformers.Qwen3ForCausalLM(hf).eval()


def mistral(config: pf.GPTConfig) -> transformers.PreTrainedModel:
    """MistralForCausalLM of the GPT's shape with its sliding_window, eager attention (the window as a mask:
    key j is visible to query i iff i - sliding_window < j <= i, transformers' `sliding_window_overlay`)."""
    hf = transformers.MistralConfig(**_common(config), sliding_window=config.sliding_window)
    hf._attn_implementation = "eager"
    return transformers.MistralForCausalLM(hf).eval()


def copy_into(ours: pf.GPT, theirs: transformers.PreTrainedModel) -> None:
    """Every parameter of ours into its namesake of theirs; each of theirs must be written exactly once
    (a tied head is the embedding in both)."""
    target = dict(theirs.named_parameters())
    written = set()
    with torch.no_grad():
        for name, parameter in ours.named_parameters():  # a tied head appears once, as the embedding
            hf = hf_name(name)
            target[hf].copy_(parameter)
            written.add(hf)
    assert written == set(target), f"not written: {sorted(set(target) - written)}"


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from the default init (norm weights near 1, matrices of std 0.15): attention far from
    uniform, norms far from the identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.5 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(0.15 * torch.randn(parameter.shape, generator=generator))
