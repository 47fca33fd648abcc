"""Hugging Face model directories in and out: `save_hf(model, directory)`, `load_hf(directory)`.

A directory is config.json + model.safetensors (+ the tokenizer's tokenizer.json and
tokenizer_config.json), the files `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read; `load_hf` also takes an older GPT-2 directory's tokenizer as
vocab.json + merges.txt alone. Each layout is a small declarative table of
(Hugging Face module, our module(s), kind); the kind says which tensors the module holds and how
they are laid out:

    kind        tensors                         layout
    embedding   weight                          same
    norm        weight (+ bias for LayerNorm)   same
    linear      weight (+ bias)                 same: nn.Linear's (out, in)
    conv1d      weight + bias                   GPT-2's Conv1D stores Wᵀ, (in, out)
    experts     weight, one module per expert   expert e's is ours[e]: ours stacks the E experts (E, out, in)

A module mapped to several of ours is fused: HF's tensor is ours concatenated along the output
axis, e.g. GPT-2's c_attn = [W_q | W_k | W_v] (equal parts, as GPT-2 has no grouped-query attention).

    GPT-2 (GPT2LMHeadModel)                   Llama (LlamaForCausalLM)             plainformer GPT
    transformer.wte                           model.embed_tokens                   token_embedding
    transformer.wpe                           -                                    position.embedding
    transformer.h.{i}.ln_1                    model.layers.{i}.input_layernorm     blocks.{i}.norm1
    transformer.h.{i}.attn.c_attn             ...self_attn.q_proj | k_proj | v_proj  blocks.{i}.self_attn.W_q|W_k|W_v
    transformer.h.{i}.attn.c_proj             ...self_attn.o_proj                  blocks.{i}.self_attn.W_o
    transformer.h.{i}.ln_2                    ...post_attention_layernorm          blocks.{i}.norm2
    transformer.h.{i}.mlp.c_fc                ...mlp.gate_proj                     blocks.{i}.ff.W_1
    -                                         ...mlp.up_proj                       blocks.{i}.ff.W_3
    transformer.h.{i}.mlp.c_proj              ...mlp.down_proj                     blocks.{i}.ff.W_2
    transformer.ln_f                          model.norm                           norm
    lm_head (untied only)                     lm_head (untied only)                lm_head

Mixtral (MixtralForCausalLM) is Llama with every feed-forward a Mixture of Experts (a GPT with
n_experts > 0): softmax router, top-K, gates renormalised over the K, SwiGLU experts, as `nn.moe`:

    Mixtral                                           plainformer GPT
    model.layers.{i}.block_sparse_moe.gate            blocks.{i}.ff.router
    ...block_sparse_moe.experts.{e}.w1 | w3 | w2      blocks.{i}.ff.W_1[e] | W_3[e] | W_2[e]

These are the names Mixtral was published with, and what transformers' `save_pretrained` writes (from
version 5 it holds the experts fused in memory, `mlp.experts.gate_up_proj` (E, 2·d_ff, d) =
[W_1 | W_3] on axis 1 and `mlp.experts.down_proj` = W_2, and converts on loading and saving);
`load_hf` reads either. Mixtral has no dense blocks between MoE ones, shared experts, capacity limit or
balancing bias, so a GPT with one of them is refused.

Llama's rotary embedding rotates the halves (x_i, x_{i+d/2}) of each head, as ours does, so q_proj
and k_proj need no permutation. A tied output projection is written once (as the embedding).
BERT goes through `hf_bert` (`load_hf_bert`, `save_hf_bert`); `load_hf` and `save_hf` dispatch to it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..data.tokenizers import TOKENIZER_FILE, Tokenizer
from ..files.atomic import atomic_path
from ..files.json_file import read_json_object
from ..models.bert import BertModel
from ..models.gpt import GPT, GPTConfig
from ..models.memory import check_model_memory, parameter_count
from .bert import (
    HF_CONFIG,
    SAFETENSORS,
    check_hf_sizes,
    load_hf_bert,
    load_hf_bert_tokenizer,
    read_hf_weights,
    save_hf_bert,
)
from .tokenizer_files import has_gpt2_files, load_hf_tokenizer, save_hf_tokenizer

EMBEDDING, NORM, LINEAR, CONV1D, EXPERTS = "embedding", "norm", "linear", "conv1d", "experts"
SHARD_INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One Hugging Face architecture: its weight table and its config.json translation."""

    model_type: str
    architecture: str
    base_prefix: str  # what HF's *ForCausalLM puts before the base model's names
    modules: tuple[tuple[str, str | tuple[str, ...], str], ...]  # outside the blocks
    layer_prefix: str  # "{i}" is the block index; "{e}" in an experts entry is the expert's
    layer: tuple[tuple[str, str | tuple[str, ...], str], ...]
    ignored_suffixes: tuple[str, ...]  # buffers some checkpoints carry (masks, rotary tables)
    config_to_hf: Callable[[GPTConfig], dict[str, Any]]
    config_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]]
    # Our buffers the layout has no tensor for, at the one value it expresses (filled in on loading,
    # checked on saving).
    buffers: Callable[[GPTConfig], dict[str, Tensor]] = lambda config: {}
    # Other names a Hugging Face version gives the same tensors -> the table's names.
    renamed: Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]] = lambda hf_state: hf_state


# ----------------------------------------------------------------------------- GPT-2

# Our activation -> GPT-2's activation_function (its "gelu_new" is the tanh approximation).
_GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_GPT2_TANH_ALIASES = ("gelu_new", "gelu_pytorch_tanh")


def _gpt2_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    _require(config, pos_encoding="learned", layout="GPT-2")
    _require(config, norm="layernorm", layout="GPT-2 (learned positions)")
    _require(config, bias=True, layout="GPT-2 (learned positions)")
    if config.activation not in _GPT2_ACTIVATIONS:
        raise ValueError(f"activation={config.activation!r} has no GPT-2 layout (learned positions); "
                         f"expected one of {', '.join(map(repr, _GPT2_ACTIVATIONS))}")
    if config.n_kv_heads not in (None, config.n_heads):
        raise ValueError(f"n_kv_heads={config.n_kv_heads} has no GPT-2 layout: GPT-2 has no grouped-query "
                         "attention (n_kv_heads must be None or n_heads)")
    return {"vocab_size": config.vocab_size, "n_positions": config.block_size, "n_embd": config.d_model,
            "n_layer": config.n_layers, "n_head": config.n_heads, "n_inner": config.d_ff,
            "activation_function": _GPT2_ACTIVATIONS[config.activation], "layer_norm_epsilon": config.norm_eps,
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": config.tie_weights}


def _gpt2_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    ours = {"gelu": "gelu", "relu": "relu", **dict.fromkeys(_GPT2_TANH_ALIASES, "gelu_tanh")}
    if activation not in ours:
        raise ValueError(f"activation_function={activation!r} is not supported; expected one of "
                         f"{', '.join(map(repr, ours))}")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("scale_attn_weights=False and scale_attn_by_inverse_layer_idx=True are not "
                         "supported: plainformer scales attention scores by 1/sqrt(d_k) only")
    if hf.get("add_cross_attention", False):
        raise ValueError("add_cross_attention=True is not supported: a GPT has no cross-attention")
    d_model = hf.get("n_embd", 768)
    return {"vocab_size": hf.get("vocab_size", 50257), "block_size": hf.get("n_positions", 1024),
            "d_model": d_model, "n_layers": hf.get("n_layer", 12), "n_heads": hf.get("n_head", 12),
            "d_ff": hf.get("n_inner") or 4 * d_model, "activation": ours[activation],
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5), "dropout": hf.get("resid_pdrop", 0.1),
            "tie_weights": hf.get("tie_word_embeddings", True), "pos_encoding": "learned",
            "norm": "layernorm", "bias": True, "n_kv_heads": None}


GPT2 = Layout(
    model_type="gpt2", architecture="GPT2LMHeadModel", base_prefix="transformer.",
    modules=(("transformer.wte", "token_embedding", EMBEDDING),
             ("transformer.wpe", "position.embedding", EMBEDDING),
             ("transformer.ln_f", "norm", NORM)),
    layer_prefix="transformer.h.{i}.",
    layer=(("ln_1", "norm1", NORM),
           ("attn.c_attn", ("self_attn.W_q", "self_attn.W_k", "self_attn.W_v"), CONV1D),
           ("attn.c_proj", "self_attn.W_o", CONV1D),
           ("ln_2", "norm2", NORM),
           ("mlp.c_fc", "ff.W_1", CONV1D),
           ("mlp.c_proj", "ff.W_2", CONV1D)),
    ignored_suffixes=(".attn.bias", ".attn.masked_bias"),
    config_to_hf=_gpt2_config_to_hf, config_from_hf=_gpt2_config_from_hf)


# ----------------------------------------------------------------------------- Llama, Mixtral

def _rotary_config_to_hf(config: GPTConfig, layout: str) -> dict[str, Any]:
    """What Llama's and Mixtral's config.json share: RMSNorm, rotary positions, (grouped-query) attention."""
    _require(config, pos_encoding="rope", layout=layout)
    _require(config, norm="rmsnorm", layout=f"{layout} (rotary positions)")
    return {"vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads or config.n_heads,
            "head_dim": config.head_dim, "max_position_embeddings": config.block_size, "hidden_act": "silu",
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
            "attention_dropout": config.dropout, "tie_word_embeddings": config.tie_weights}


def _rotary_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; a Llama feed-forward here is "
                         "SwiGLU (hidden_act='silu')")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default" or (hf.get("rope_scaling") and "rope_parameters" not in hf):
        raise ValueError(f"rope_scaling / rope_parameters of type {rope_type!r} are not supported; "
                         "plainformer's rotary embedding is the unscaled one (rope_type 'default')")
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise ValueError(f"head_dim={head_dim} is not supported: plainformer's heads split d_model, "
                         f"so head_dim must be hidden_size / num_attention_heads = {d_model}/{n_heads}")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    return {"vocab_size": hf["vocab_size"], "block_size": hf.get("max_position_embeddings", 2048),
            "d_model": d_model, "n_layers": hf["num_hidden_layers"], "n_heads": n_heads,
            "n_kv_heads": None if n_kv_heads == n_heads else n_kv_heads, "d_ff": hf["intermediate_size"],
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "dropout": hf.get("attention_dropout", 0.0), "tie_weights": hf.get("tie_word_embeddings", False),
            "pos_encoding": "rope", "norm": "rmsnorm", "activation": "swiglu"}


def _llama_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    _require(config, activation="swiglu", layout="Llama (rotary positions)")
    return {**_rotary_config_to_hf(config, "Llama"), "attention_bias": config.bias, "mlp_bias": config.bias}


def _llama_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ValueError("attention_bias and mlp_bias must agree: plainformer has one bias switch")
    return {**_rotary_config_from_hf(hf), "bias": hf.get("attention_bias", False)}


# Attention and norms, named alike in Llama and Mixtral.
_ROTARY_ATTENTION = (("input_layernorm", "norm1", NORM),
                     ("self_attn.q_proj", "self_attn.W_q", LINEAR),
                     ("self_attn.k_proj", "self_attn.W_k", LINEAR),
                     ("self_attn.v_proj", "self_attn.W_v", LINEAR),
                     ("self_attn.o_proj", "self_attn.W_o", LINEAR),
                     ("post_attention_layernorm", "norm2", NORM))
_ROTARY_OUTSIDE = (("model.embed_tokens", "token_embedding", EMBEDDING), ("model.norm", "norm", NORM))

LLAMA = Layout(
    model_type="llama", architecture="LlamaForCausalLM", base_prefix="model.",
    modules=_ROTARY_OUTSIDE, layer_prefix="model.layers.{i}.",
    layer=(*_ROTARY_ATTENTION,
           ("mlp.gate_proj", "ff.W_1", LINEAR),
           ("mlp.up_proj", "ff.W_3", LINEAR),
           ("mlp.down_proj", "ff.W_2", LINEAR)),
    ignored_suffixes=(".rotary_emb.inv_freq",),
    config_to_hf=_llama_config_to_hf, config_from_hf=_llama_config_from_hf)

# What MixtralConfig assumes for a key its config.json leaves out, where Llama's differs.
_MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                     "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "router_aux_loss_coef": 0.001}


def _mixtral_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """Every block MoE, routed by softmax scores alone and dropless, no bias anywhere, no shared experts.
    router_aux_loss_coef carries aux_loss_coef (for one layer the same L_aux; over several transformers
    pools the layers' routing statistics before the product where ours averages the layers' L_aux);
    the z-loss weight has no Mixtral field (its loss has no z-loss) and is not written."""
    hf = _rotary_config_to_hf(config, "Mixtral")
    for field, value in (("bias", False), ("n_shared_experts", 0), ("first_dense_layers", 0),
                         ("capacity_factor", None), ("bias_update_rate", 0.0)):
        _require(config, layout="Mixtral", **{field: value})
    if not all(config.is_moe_layer(i) for i in range(config.n_layers)):
        raise ValueError(f"moe_every={config.moe_every} has no Hugging Face layout here: Mixtral's every "
                         "block is a Mixture of Experts (moe_every=1)")
    return {**hf, "num_local_experts": config.n_experts, "num_experts_per_tok": config.top_k,
            "router_aux_loss_coef": config.aux_loss_coef, "router_jitter_noise": 0.0, "sliding_window": None,
            "output_router_logits": False}


def _mixtral_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    hf = {**_MIXTRAL_DEFAULTS, **hf}
    block_size = hf["max_position_embeddings"]
    window = hf.get("sliding_window")
    if window is not None and window < block_size:
        raise ValueError(f"sliding_window={window} is not supported: plainformer's attention sees every "
                         f"earlier position (sliding_window must be null or at least max_position_embeddings="
                         f"{block_size})")
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported: plainformer's "
                         "router takes its input unperturbed (router_jitter_noise must be 0)")
    return {**_rotary_config_from_hf(hf), "bias": False, "n_experts": hf["num_local_experts"],
            "top_k": hf["num_experts_per_tok"], "aux_loss_coef": hf["router_aux_loss_coef"], "z_loss_coef": 0.0}


def _zero_router_biases(config: GPTConfig) -> dict[str, Tensor]:
    """The balancing bias b of every MoE block, zero: Mixtral chooses experts by the scores alone."""
    return {f"blocks.{i}.ff.expert_bias": torch.zeros(config.n_experts) for i in range(config.n_layers)
            if config.is_moe_layer(i)}


def _per_expert(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's in-memory Mixtral names -> the per-expert ones of the table:
    mlp.experts.gate_up_proj (E, 2·d_ff, d) = [w1 | w3] on axis 1, mlp.experts.down_proj (E, d, d_ff) = w2,
    mlp.gate = block_sparse_moe.gate."""
    state: dict[str, Tensor] = {}
    for name, tensor in hf_state.items():
        stem, mlp, leaf = name.partition(".mlp.")
        if not mlp:
            state[name] = tensor
            continue
        moe = f"{stem}.block_sparse_moe."
        if leaf == "experts.gate_up_proj":
            w1, w3 = tensor.chunk(2, dim=1)  # (E, d_ff, d) each
            for e in range(tensor.shape[0]):
                state[f"{moe}experts.{e}.w1.weight"], state[f"{moe}experts.{e}.w3.weight"] = w1[e], w3[e]
        elif leaf == "experts.down_proj":
            state.update({f"{moe}experts.{e}.w2.weight": w2 for e, w2 in enumerate(tensor)})
        else:
            state[moe + leaf] = tensor
    return state


MIXTRAL = Layout(
    model_type="mixtral", architecture="MixtralForCausalLM", base_prefix="model.",
    modules=_ROTARY_OUTSIDE, layer_prefix="model.layers.{i}.",
    layer=(*_ROTARY_ATTENTION,
           ("block_sparse_moe.gate", "ff.router", LINEAR),
           ("block_sparse_moe.experts.{e}.w1", "ff.W_1", EXPERTS),
           ("block_sparse_moe.experts.{e}.w3", "ff.W_3", EXPERTS),
           ("block_sparse_moe.experts.{e}.w2", "ff.W_2", EXPERTS)),
    ignored_suffixes=(".rotary_emb.inv_freq",),
    config_to_hf=_mixtral_config_to_hf, config_from_hf=_mixtral_config_from_hf,
    buffers=_zero_router_biases, renamed=_per_expert)

LAYOUTS = {layout.model_type: layout for layout in (GPT2, LLAMA, MIXTRAL)}
_LAYOUT_OF_POSITIONS = {"learned": GPT2, "rope": LLAMA}
HEAD = "lm_head"


def _require(config: GPTConfig, *, layout: str, **expected: Any) -> None:
    ((field, value),) = expected.items()
    if getattr(config, field) != value:
        raise ValueError(f"{field}={getattr(config, field)!r} has no Hugging Face layout here: "
                         f"{layout} needs {field}={value!r}")


def layout_for(config: GPTConfig) -> Layout:
    """The layout a GPT with this config exports to: Mixtral with experts, else GPT-2 for learned
    positions, Llama for rotary."""
    if config.n_experts:
        return MIXTRAL
    if config.pos_encoding not in _LAYOUT_OF_POSITIONS:
        raise ValueError(f"pos_encoding={config.pos_encoding!r} has no Hugging Face layout: GPT-2 learns "
                         "positions (pos_encoding='learned'), Llama rotates them (pos_encoding='rope')")
    return _LAYOUT_OF_POSITIONS[config.pos_encoding]


# ----------------------------------------------------------------------------- the weight map

@dataclasses.dataclass(frozen=True)
class Weight:
    """One Hugging Face tensor = our tensors concatenated on axis 0, transposed when `transpose`; or,
    with an `expert` index, that expert's (out, in) of our one stacked (E, out, in) tensor."""

    hf: str
    ours: tuple[str, ...]
    transpose: bool = False
    expert: int | None = None


def weight_map(config: GPTConfig, layout: Layout | None = None) -> list[Weight]:
    """Every tensor of a GPT with this config, as its Hugging Face layout names it.

    A tied output projection is absent (it is the embedding); an untied one is `lm_head.weight`.
    """
    layout = layout or layout_for(config)
    entries = list(layout.modules)
    for i in range(config.n_layers):
        prefix = layout.layer_prefix.format(i=i)
        entries += [(prefix + hf, _prefixed(f"blocks.{i}.", ours), kind) for hf, ours, kind in layout.layer]
    if not config.tie_weights:
        entries.append((HEAD, HEAD, LINEAR))
    weights = []
    for hf, ours, kind in entries:
        ours = (ours,) if isinstance(ours, str) else ours
        tensors: tuple[str, ...]
        if kind == EXPERTS:  # our stacked experts are parameters themselves, without a ".weight"
            weights += [Weight(f"{hf.format(e=e)}.weight", ours, expert=e) for e in range(config.n_experts)]
            continue
        if kind == LINEAR and hf == HEAD:
            tensors = ("weight",)  # the output projection never has a bias
        elif kind == EMBEDDING or (kind == NORM and config.norm == "rmsnorm"):
            tensors = ("weight",)
        else:
            tensors = ("weight", "bias") if config.bias else ("weight",)
        weights += [Weight(f"{hf}.{t}", tuple(f"{o}.{t}" for o in ours), kind == CONV1D and t == "weight")
                    for t in tensors]
    return weights


def _prefixed(prefix: str, ours: str | tuple[str, ...]) -> str | tuple[str, ...]:
    return prefix + ours if isinstance(ours, str) else tuple(prefix + o for o in ours)


def state_from_hf(hf_state: Mapping[str, Tensor], config: GPTConfig,
                  layout: Layout | None = None) -> dict[str, Tensor]:
    """A Hugging Face state dict (or any dict keyed by its names, e.g. of gradients) in our names,
    with the buffers the layout has no tensor for (`Layout.buffers`).

    Every key must be mapped, be a buffer the layout ignores (by suffix), or be the tied head.
    """
    layout = layout or layout_for(config)
    if not any(k.startswith(layout.base_prefix) for k in hf_state):  # a base model without its LM head
        hf_state = {layout.base_prefix + k: v for k, v in hf_state.items()}
    hf_state = layout.renamed(hf_state)
    weights = weight_map(config, layout)
    known = {w.hf for w in weights}
    unknown = sorted(k for k in hf_state if k not in known and not k.endswith(layout.ignored_suffixes)
                     and not (config.tie_weights and k == f"{HEAD}.weight"))
    missing = sorted(known - set(hf_state))
    for problem, names in (("unexpected", unknown), ("missing", missing)):
        if names:
            raise ValueError(f"{problem} weights for a {config.n_layers}-layer {layout.architecture}: "
                             f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    state: dict[str, Tensor] = {}
    experts: dict[str, list[Tensor]] = {}  # ours -> its experts' tensors, in order (as weight_map lists them)
    for w in weights:
        tensor = hf_state[w.hf].T if w.transpose else hf_state[w.hf]
        if w.expert is None:
            state.update(zip(w.ours, tensor.chunk(len(w.ours)), strict=True))
        else:
            experts.setdefault(w.ours[0], []).append(tensor)
    state.update({name: torch.stack(tensors) for name, tensors in experts.items()})  # (E, out, in)
    if config.tie_weights:
        state[f"{HEAD}.weight"] = state["token_embedding.weight"]
    return {**state, **layout.buffers(config)}


def state_to_hf(state: Mapping[str, Tensor], config: GPTConfig,
                layout: Layout | None = None) -> dict[str, Tensor]:
    """Our state dict in the Hugging Face layout's names (contiguous CPU tensors, each stored once).
    A buffer the layout has no tensor for must hold the value the layout implies (`Layout.buffers`)."""
    layout = layout or layout_for(config)
    for name, implied in layout.buffers(config).items():
        if not torch.equal(state[name].detach().cpu().to(implied.dtype), implied):
            value = "zero" if not implied.any() else f"{implied.tolist()!r:.80}"
            raise ValueError(f"{name} must be {value} for the {layout.architecture} layout, which has no "
                             "tensor for it: the model would not compute the same function there")
    tensors = {}
    for w in weight_map(config, layout):
        if w.expert is None:
            tensor = torch.cat([state[o].detach() for o in w.ours])  # (Σ out, in) or (Σ out,)
        else:
            tensor = state[w.ours[0]].detach()[w.expert]  # (out, in) of (E, out, in)
        tensors[w.hf] = (tensor.T if w.transpose else tensor).cpu().contiguous()
    return tensors


# ----------------------------------------------------------------------------- directories

def gpt_config_to_hf(config: GPTConfig, tokenizer: Tokenizer | None = None, *,
                     dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of a GPT with this config (refused, naming the field, when no layout fits)."""
    layout = layout_for(config)
    special = {f"{role}_token_id": getattr(tokenizer, f"{role}_id", None) for role in ("bos", "eos", "pad")}
    return {"architectures": [layout.architecture], "model_type": layout.model_type,
            "dtype": str(dtype).removeprefix("torch."), **special, **layout.config_to_hf(config)}


def gpt_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """A GPTConfig from a GPT-2, Llama or Mixtral config.json."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError("config.json has no model_type: not a Hugging Face model directory (a plainformer "
                         "checkpoint loads with GPT.from_checkpoint or load_checkpoint)")
    if model_type not in LAYOUTS:
        raise ValueError(f"config.json describes a {model_type!r} model; a GPT loads from "
                         f"{' or '.join(map(repr, LAYOUTS))}")
    check_hf_sizes(hf)
    return GPTConfig.from_dict({**LAYOUTS[model_type].config_from_hf(hf), **overrides})


def save_hf(model: GPT | BertModel, directory: str | os.PathLike, *,
            tokenizer: Tokenizer | None = None) -> Path:
    """Write `model` as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` (a GPT) or
    `BertModel.from_pretrained` loads, with `tokenizer` (default: `model.tokenizer`) as tokenizer.json +
    tokenizer_config.json for `AutoTokenizer`. Rows of a vocabulary padded past the tokenizer's are
    cropped. Every file is written atomically."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if isinstance(model, BertModel):
        directory = save_hf_bert(model, directory)
    elif isinstance(model, GPT):
        directory = _save_gpt(model, Path(directory), tokenizer)
    else:
        raise TypeError(f"model must be a GPT or a BertModel, got {type(model).__name__}")
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, directory, model_max_length=_max_len(model))
    return directory


def _with_zero_biases(config: GPTConfig, state: Mapping[str, Tensor]) -> tuple[GPTConfig, dict[str, Tensor]]:
    """A GPT without biases (nanoGPT's bias=False) as the GPT-2 layout holds it, whose every linear
    layer and LayerNorm has a bias: zeros, which compute the same function."""
    with_biases = config.replace(bias=True)
    like = state["token_embedding.weight"]
    zeros = {name: torch.zeros(state[name.removesuffix(".bias") + ".weight"].shape[0], dtype=like.dtype)
             for w in weight_map(with_biases, GPT2) for name in w.ours if name.endswith(".bias")}
    return with_biases, {**state, **zeros}


def _max_len(model: GPT | BertModel) -> int:
    return model.config.block_size if isinstance(model, GPT) else model.config.max_len


def exported_state(model: GPT, tokenizer: Tokenizer | None) -> tuple[GPTConfig, dict[str, Tensor]]:
    """The config and weights a GPT is exported with: a vocabulary padded past the tokenizer's cropped to
    it (no id reaches those rows), and a GPT-2-layout model without biases given zero ones."""
    config, state = model.config, model.state_dict()
    if tokenizer is not None and tokenizer.vocab_size != config.vocab_size:
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                             f"vocab_size={config.vocab_size}")
        config = config.replace(vocab_size=tokenizer.vocab_size)  # why: padding rows no id reaches
        state = {k: v[:tokenizer.vocab_size] if k in ("token_embedding.weight", f"{HEAD}.weight") else v
                 for k, v in state.items()}
    if layout_for(config) is GPT2 and not config.bias:
        config, state = _with_zero_biases(config, state)
    return config, state


def _save_gpt(model: GPT, directory: Path, tokenizer: Tokenizer | None) -> Path:
    config, state = exported_state(model, tokenizer)
    hf_config = gpt_config_to_hf(config, tokenizer, dtype=model.token_embedding.weight.dtype)
    tensors = state_to_hf(state, config)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / SAFETENSORS) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_path(directory / HF_CONFIG) as tmp:
        tmp.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return directory


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / HF_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face model directory: {HF_CONFIG} is missing")
    return read_json_object(path)


def is_hf_directory(directory: str | os.PathLike) -> bool:
    """Whether `directory` looks like a Hugging Face model directory (config.json with a model_type)."""
    path = Path(directory) / HF_CONFIG
    try:
        return path.is_file() and "model_type" in read_json_object(path)
    except (OSError, ValueError):
        return False


def load_hf(directory: str | os.PathLike, *, backend: str = "auto") -> GPT | BertModel:
    """The model of a Hugging Face GPT-2, Llama, Mixtral or BERT directory, in eval mode, with its
    tokenizer (if the directory has one: tokenizer.json, GPT-2's vocab.json + merges.txt, BERT's
    vocab.txt) as `.tokenizer`."""
    directory = Path(directory)
    hf = read_hf_config(directory)
    model: GPT | BertModel
    if hf.get("model_type") == "bert":
        model = load_hf_bert(directory, backend=backend)
    else:
        config = gpt_config_from_hf(hf, backend=backend)
        check_model_memory(config, "gpt")  # from config.json alone, before the weights are read
        weights = _read_weights(directory)
        _check_weights_fit(directory, config, weights)
        model = GPT(config)
        state = state_from_hf(weights, config)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(f"the weights in {directory} do not fit its {HF_CONFIG}: {e}") from None
        model.eval()
    model.tokenizer = _read_tokenizer(directory, hf.get("model_type"))
    return model


def _check_weights_fit(directory: Path, config: GPTConfig, weights: Mapping[str, Tensor]) -> None:
    """Refuse, before building anything, a config.json describing far more parameters than the weights
    hold (num_hidden_layers: 100000 beside a small model's weights); a weight or two missing is named
    later, by `state_from_hf`."""
    needed = parameter_count(config, "gpt")
    stored = sum(t.numel() for t in weights.values())
    if needed > 2 * stored:
        raise ValueError(f"{directory / HF_CONFIG} describes a model of {needed:,} parameters but its weights "
                         f"hold {stored:,} values: they do not belong together")


def _read_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of model.safetensors, of the shards its index lists, or of pytorch_model.bin."""
    index = directory / SHARD_INDEX
    if (directory / SAFETENSORS).is_file() or not index.is_file():
        return read_hf_weights(directory)
    mapping = read_json_object(index).get("weight_map", {})
    if not isinstance(mapping, dict) or not all(isinstance(shard, str) for shard in mapping.values()):
        raise ValueError(f"{index}: weight_map must map weight names to shard file names, got {mapping!r:.100}")
    shards = sorted(set(mapping.values()))
    if not shards or any(Path(shard).name != shard for shard in shards):
        raise ValueError(f"{index} must map weights to shard files in {directory}")
    return {name: tensor for shard in shards for name, tensor in load_file(directory / shard).items()}


def _read_tokenizer(directory: Path, model_type: str | None) -> Tokenizer | None:
    if (directory / TOKENIZER_FILE).is_file() or has_gpt2_files(directory):
        return load_hf_tokenizer(directory)
    if model_type == "bert" and (directory / "vocab.txt").is_file():
        return load_hf_bert_tokenizer(directory)
    return None
