"""The peer of the GPT benchmarks: a Hugging Face GPT2LMHeadModel and a plainformer GPT with its weights.

Both are GPT-2: learned positions, biases, GELU with the tanh approximation ("gelu_new"), LayerNorm
(eps 1e-5), an output projection tied to the token embedding, dropout off. HF's Conv1D stores a weight
as (in, out), the transpose of nn.Linear's (out, in), and its c_attn holds [q | k | v] side by side.
"""

from __future__ import annotations

import torch
import transformers

import plainformer as pf


def gpt2_pair(n_layers: int, n_heads: int, d_model: int, d_ff: int, vocab_size: int, block_size: int,
              *, attn_implementation: str = "sdpa") -> tuple[pf.GPT, transformers.GPT2LMHeadModel]:
    """(ours, theirs) computing the same function, from HF's GPT-2 initialisation (seed 0)."""
    config = pf.GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layers=n_layers,
                          n_heads=n_heads, d_model=d_model, d_ff=d_ff, dropout=0.0, bias=True,
                          activation="gelu_tanh", pos_encoding="learned", norm="layernorm",
                          tie_weights=True)
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel._from_config(
        transformers.GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=d_model,
                                n_layer=n_layers, n_head=n_heads, n_inner=d_ff,
                                activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, layer_norm_epsilon=1e-5),
        attn_implementation=attn_implementation)
    ours = pf.GPT(config)
    ours.load_state_dict(_our_state_dict(theirs.state_dict(), n_layers))
    return ours, theirs


def _our_state_dict(hf: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    state = {"token_embedding.weight": hf["transformer.wte.weight"],
             "lm_head.weight": hf["transformer.wte.weight"],
             "position.embedding.weight": hf["transformer.wpe.weight"],
             "norm.weight": hf["transformer.ln_f.weight"], "norm.bias": hf["transformer.ln_f.bias"]}
    for i in range(n_layers):
        h, ours = f"transformer.h.{i}.", f"blocks.{i}."
        weights = hf[h + "attn.c_attn.weight"].T.chunk(3)  # (in, 3·out) -> three (out, in)
        biases = hf[h + "attn.c_attn.bias"].chunk(3)
        for name, weight, bias in zip(("W_q", "W_k", "W_v"), weights, biases):
            state[f"{ours}self_attn.{name}.weight"] = weight
            state[f"{ours}self_attn.{name}.bias"] = bias
        for theirs_name, ours_name in (("attn.c_proj", "self_attn.W_o"), ("mlp.c_fc", "ff.W_1"),
                                       ("mlp.c_proj", "ff.W_2")):
            state[f"{ours}{ours_name}.weight"] = hf[f"{h}{theirs_name}.weight"].T
            state[f"{ours}{ours_name}.bias"] = hf[f"{h}{theirs_name}.bias"]
        for theirs_name, ours_name in (("ln_1", "norm1"), ("ln_2", "norm2")):
            state[f"{ours}{ours_name}.weight"] = hf[f"{h}{theirs_name}.weight"]
            state[f"{ours}{ours_name}.bias"] = hf[f"{h}{theirs_name}.bias"]
    return state
