"""The peer of the GPT benchmarks: a Hugging Face GPT2LMHeadModel and a plainformer GPT with its weights.

Both are GPT-2: learned positions, biases, GELU with the tanh approximation ("gelu_new"), LayerNorm
(eps 1e-5), an output projection tied to the token embedding, dropout off. The weights are copied
through the library's GPT-2 weight map (`plainformer.hf.gpt`).
"""

from __future__ import annotations

import torch
import transformers

import plainformer as pf
from plainformer.hf.gpt import state_from_hf


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
    ours.load_state_dict(state_from_hf(theirs.state_dict(), config))
    return ours, theirs
