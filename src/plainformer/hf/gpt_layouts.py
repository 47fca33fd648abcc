"""The Hugging Face layouts of a GPT: GPT-2, Llama, Mistral, Qwen3 and Mixtral, one `Layout` each, and `layout_for`.

Each layout is a small declarative table of (Hugging Face module, our module(s), kind), with its
config.json translation; `hf.gpt` reads the tables into tensors (`weight_map`). The kind says which
tensors the module holds and how they are laid out:

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

Mistral (MistralForCausalLM) is Llama without biases and with a sliding window (a GPT with
sliding_window=w): query i sees keys i − w < j ≤ i in every layer, config.json's `sliding_window`; its weights
are named as Llama's. A null window, or one of at least max_position_embeddings, is none. Mixtral's
`sliding_window` is the same window; Qwen3's applies to the layers from max_window_layers on, so a windowed
QK-norm GPT writes use_sliding_window=True, max_window_layers=0 and every layer_types entry
"sliding_attention" (a Qwen3 windowed on some layers only is refused).

Qwen3 (Qwen3ForCausalLM) is Llama with QK-norm (a GPT with qk_norm=True): each head's query and key
RMS-normalised over d_k before rotary, one weight of d_k shared by the heads:

    Qwen3                                             plainformer GPT
    model.layers.{i}.self_attn.q_norm | k_norm        blocks.{i}.self_attn.q_norm | k_norm

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..models.gpt import GPTConfig

EMBEDDING, NORM, LINEAR, CONV1D, EXPERTS = "embedding", "norm", "linear", "conv1d", "experts"


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

# Our activation -> GPT-2's activation_function (its "gelu_new" is the tanh approximation; transformers
# computes any name of its ACT2FN, "relu2" = max(0, x)² among them).
_GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "relu2": "relu2"}
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
    ours = {"gelu": "gelu", "relu": "relu", "relu2": "relu2", **dict.fromkeys(_GPT2_TANH_ALIASES, "gelu_tanh")}
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


_QK_NORMS = (("self_attn.q_norm", "self_attn.q_norm", NORM), ("self_attn.k_norm", "self_attn.k_norm", NORM))
_SWIGLU = (("mlp.gate_proj", "ff.W_1", LINEAR),
           ("mlp.up_proj", "ff.W_3", LINEAR),
           ("mlp.down_proj", "ff.W_2", LINEAR))


def _rotary_layout(model_type: str, architecture: str, feed_forward: tuple[tuple[str, str, str], ...],
                   attention: tuple[tuple[str, str, str], ...] = (), **translation: Any) -> Layout:
    """A Llama-family layout: the shared outside and attention names, the `attention` a variant adds,
    and `feed_forward`'s."""
    return Layout(model_type=model_type, architecture=architecture, base_prefix="model.",
                  modules=_ROTARY_OUTSIDE, layer_prefix="model.layers.{i}.",
                  layer=(*_ROTARY_ATTENTION, *attention, *feed_forward),
                  ignored_suffixes=(".rotary_emb.inv_freq",), **translation)


LLAMA = _rotary_layout("llama", "LlamaForCausalLM", _SWIGLU,
                       config_to_hf=_llama_config_to_hf, config_from_hf=_llama_config_from_hf)


_SLIDING = "sliding_attention"  # a windowed layer in transformers' layer_types


def _window_from_hf(hf: Mapping[str, Any], block_size: int) -> int | None:
    """config.json's sliding_window as ours: None for null or for a window of at least every position."""
    window = hf.get("sliding_window")
    return window if window is not None and window < block_size else None


def _mistral_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """Llama's keys with the window; Mistral's linear layers have no bias."""
    layout = f"Mistral (sliding_window={config.sliding_window})"
    _require(config, activation="swiglu", layout=layout)
    _require(config, bias=False, layout=layout)
    return {**_rotary_config_to_hf(config, "Mistral"), "sliding_window": config.sliding_window}


def _mistral_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    hf = {**_MISTRAL_DEFAULTS, **hf}
    rotary = _rotary_config_from_hf(hf)
    return {**rotary, "bias": False, "sliding_window": _window_from_hf(hf, rotary["block_size"])}


# What MistralConfig assumes for a key its config.json leaves out, where Llama's differs.
_MISTRAL_DEFAULTS = {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096}

MISTRAL = _rotary_layout("mistral", "MistralForCausalLM", _SWIGLU,
                         config_to_hf=_mistral_config_to_hf, config_from_hf=_mistral_config_from_hf)


def _qwen3_config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """Llama's keys with QK-norm, which Qwen3 always has, and no bias (its MLP has none)."""
    _require(config, activation="swiglu", layout="Qwen3")
    _require(config, bias=False, layout="Qwen3")
    window = config.sliding_window
    return {**_rotary_config_to_hf(config, "Qwen3"), "attention_bias": False, "use_sliding_window": window is not None,
            "sliding_window": window, "max_window_layers": 0 if window is not None else config.n_layers,
            "layer_types": [_SLIDING if window is not None else "full_attention"] * config.n_layers}


def _qwen3_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported for Qwen3: plainformer has one bias switch, and "
                         "Qwen3's MLP has no bias")
    rotary = _rotary_config_from_hf(hf)
    window = _window_from_hf(hf, rotary["block_size"]) if hf.get("use_sliding_window", False) else None
    if window is not None:
        n_layers = rotary["n_layers"]
        # Qwen3Config's own default: the window on the layers from max_window_layers (28) on
        types = hf.get("layer_types") or [_SLIDING if i >= hf.get("max_window_layers", 28) else "full_attention"
                                          for i in range(n_layers)]
        windowed = sum(t == _SLIDING for t in types)
        if windowed not in (0, n_layers):
            raise ValueError(f"use_sliding_window=True on {windowed} of {n_layers} layers (max_window_layers / "
                             "layer_types) is not supported: plainformer's sliding_window covers every layer")
        window = window if windowed else None
    return {**rotary, "bias": False, "qk_norm": True, "sliding_window": window}


QWEN3 = _rotary_layout("qwen3", "Qwen3ForCausalLM", _SWIGLU, attention=_QK_NORMS,
                       config_to_hf=_qwen3_config_to_hf, config_from_hf=_qwen3_config_from_hf)

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
            "router_aux_loss_coef": config.aux_loss_coef, "router_jitter_noise": 0.0,
            "sliding_window": config.sliding_window, "output_router_logits": False}


def _mixtral_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    hf = {**_MIXTRAL_DEFAULTS, **hf}
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported: plainformer's "
                         "router takes its input unperturbed (router_jitter_noise must be 0)")
    rotary = _rotary_config_from_hf(hf)
    return {**rotary, "bias": False, "n_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"],
            "aux_loss_coef": hf["router_aux_loss_coef"], "z_loss_coef": 0.0,
            "sliding_window": _window_from_hf(hf, rotary["block_size"])}


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


MIXTRAL = _rotary_layout(
    "mixtral", "MixtralForCausalLM",
    (("block_sparse_moe.gate", "ff.router", LINEAR),
     ("block_sparse_moe.experts.{e}.w1", "ff.W_1", EXPERTS),
     ("block_sparse_moe.experts.{e}.w3", "ff.W_3", EXPERTS),
     ("block_sparse_moe.experts.{e}.w2", "ff.W_2", EXPERTS)),
    config_to_hf=_mixtral_config_to_hf, config_from_hf=_mixtral_config_from_hf,
    buffers=_zero_router_biases, renamed=_per_expert)

LAYOUTS = {layout.model_type: layout for layout in (GPT2, LLAMA, MISTRAL, QWEN3, MIXTRAL)}
_LAYOUT_OF_POSITIONS = {"learned": GPT2, "rope": LLAMA}


def _require(config: GPTConfig, *, layout: str, **expected: Any) -> None:
    ((field, value),) = expected.items()
    if getattr(config, field) != value:
        raise ValueError(f"{field}={getattr(config, field)!r} has no Hugging Face layout here: "
                         f"{layout} needs {field}={value!r}")


# GPTConfig fields that change what the model computes and that none of these architectures has, at the value
# that leaves them out. (zero_init changes the initialisation alone: a model trained with it exports as any.)
_ONLY_OURS: dict[str, Any] = dict(attn_softcap=None, logit_softcap=None, embed_norm=False,
                                  x0_mix=False, value_residual=False, token_shift=False, bigram_embedding=False)


def field_without_layout(config: GPTConfig) -> str | None:
    """The first field of `_ONLY_OURS` that `config` sets, None if it sets none."""
    return next((field for field, value in _ONLY_OURS.items() if getattr(config, field) != value), None)


def layout_for(config: GPTConfig) -> Layout:
    """The layout a GPT with this config exports to: Mixtral with experts, else Qwen3 with QK-norm, else
    Mistral with a sliding window, else GPT-2 for learned positions, Llama for rotary; refused, naming the
    field, for a variant none of them computes."""
    field = field_without_layout(config)
    if field is not None:
        raise ValueError(f"{field}={getattr(config, field)!r} has no Hugging Face or GGUF layout here: "
                         f"GPT-2, Llama, Mistral, Qwen3 and Mixtral need {field}={_ONLY_OURS[field]!r}")
    if config.n_experts:
        _require(config, layout="Mixtral (experts)", qk_norm=False)
        return MIXTRAL
    if config.qk_norm:
        if config.pos_encoding != "rope":
            raise ValueError(f"qk_norm=True has no Hugging Face layout here with pos_encoding="
                             f"{config.pos_encoding!r}: Qwen3, the layout with QK-norm, needs pos_encoding='rope'")
        return QWEN3
    if config.sliding_window is not None and config.pos_encoding == "rope":
        return MISTRAL
    if config.sliding_window is not None:
        raise ValueError(f"sliding_window={config.sliding_window} has no Hugging Face layout here with "
                         f"pos_encoding={config.pos_encoding!r}: Mistral, the layout with a window, needs "
                         "pos_encoding='rope'")
    if config.pos_encoding not in _LAYOUT_OF_POSITIONS:
        raise ValueError(f"pos_encoding={config.pos_encoding!r} has no Hugging Face layout: GPT-2 learns "
                         "positions (pos_encoding='learned'), Llama rotates them (pos_encoding='rope')")
    return _LAYOUT_OF_POSITIONS[config.pos_encoding]
