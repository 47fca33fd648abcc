"""GGUF files, which llama.cpp runs (`llama-cli -m FILE.gguf`, and Ollama, LM Studio built on it):
`save_gguf(model, path, dtype="f32" | "f16" | "q8_0")`, written with the `gguf` package's `GGUFWriter`.

A GPT goes out in the layout it has on Hugging Face (`hf.gpt_layouts`): the tensors are `state_to_hf`'s, named
as llama.cpp names them (`gguf.get_tensor_name_map`), in nn.Linear's (out, in) order:

    plainformer GPT        Hugging Face                       GGUF (general.architecture = gpt2 | llama | qwen3)
    token_embedding        transformer.wte / model.embed_tokens   token_embd
    position.embedding     transformer.wpe                     position_embd         (gpt2)
    W_q | W_k | W_v        attn.c_attn (fused, Conv1D's Wᵀ)    blk.{i}.attn_qkv      (gpt2, W again)
    W_q, W_k, W_v, W_o     self_attn.q_proj, ...               blk.{i}.attn_q, attn_k, attn_v, attn_output
    norm1, norm2, norm     ln_1, ln_2, ln_f / ...layernorm     blk.{i}.attn_norm, ffn_norm, output_norm
    W_1, W_3, W_2          mlp.gate_proj, up_proj, down_proj   blk.{i}.ffn_gate, ffn_up, ffn_down
    q_norm, k_norm         self_attn.q_norm, k_norm            blk.{i}.attn_q_norm, attn_k_norm (qwen3)
    router, W_1[e] ...     block_sparse_moe.gate, experts.{e}  blk.{i}.ffn_gate_inp, ffn_gate_exps (E, out, in)
    lm_head (untied)       lm_head                             output (absent when tied: llama.cpp reuses
                                                               token_embd)

Rotary positions: ours and Hugging Face's rotate the halves (x_j, x_{j+d/2}) of each head, as llama.cpp's
`qwen3` does; its `llama` rotates neighbours (x_{2j}, x_{2j+1}). So for `llama` the rows of W_q and W_k are
reordered within each head, r_0 .. r_{d-1} -> r_0, r_{d/2}, r_1, r_{d/2+1}, ..., which moves every pair next
to each other and leaves q·k unchanged (the same permutation of both).

dtype: "f32"; "f16" (every matrix in half precision); "q8_0", llama.cpp's block format: each run of 32
consecutive weights of a row is stored as 32 int8 q_j and one fp16 scale s = max_j |w_j| / 127, w_j ≈ s·q_j
(`gguf.quants`). Vectors (norms, biases) and the router stay f32, as llama.cpp's converter keeps them; at
q8_0 a matrix whose rows are not a multiple of 32 long is written f16.

A sliding window is refused: llama.cpp's `llama` and `qwen3` graphs read no window key (given
`llama.attention.sliding_window`, xllamacpp's llama.cpp still attends to every earlier position), so the
file would compute another function.

A GELU model (activation "gelu", erf's: nanoGPT's) goes out as `gpt2` too, whose FFN llama.cpp computes with
GELU's tanh approximation; the two differ by less than 5e-4 anywhere, and `save_gguf` says so in one line on
stderr with what the difference does to this model's logits, measured (`tanh_gelu_effect`). llama.cpp's
decoders with learned positions (gpt2, starcoder) both compute the tanh form.

The tokenizer: byte-level BPE as `tokenizer.ggml.model = gpt2` (tokens in GPT-2's byte alphabet, merges
in rank order, pre-tokenizer "gpt-2" (GPT-2's regex), special tokens as control tokens, BOS/EOS ids); a
character tokenizer as llama.cpp's `rwkv` model, a greedy longest match over its tokens, which are the
characters, so it takes one character (one id) at a time. No BOS is added in front of a text, as ours adds
none. A tokenizer's chat template (a Hugging Face base's) goes out as `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from ..data.tokenizers import TOKENIZER_FILE, BPETokenizer, CharTokenizer, Tokenizer
from ..files.atomic import atomic_path
from ..hf.gpt import exported_state, state_to_hf, weight_map
from ..hf.gpt_layouts import GPT2, LLAMA, MIXTRAL, QWEN3, Layout, layout_for
from ..log import log
from ..models.gpt import GPT, GPTConfig
from ..nn.modes import eval_mode

GGUF_TYPES = ("f32", "f16", "q8_0")
_ARCHITECTURES = {GPT2.model_type: "gpt2", LLAMA.model_type: "llama", MIXTRAL.model_type: "llama",
                  QWEN3.model_type: "qwen3"}


def save_gguf(model: GPT, path: str | os.PathLike, *, dtype: str = "f32",
              tokenizer: Tokenizer | None = None) -> Path:
    """Write `model` (a GPT in the GPT-2, Llama or Mixtral layout) and `tokenizer` (default:
    `model.tokenizer`) as one GGUF file at `path`, atomically; returns the path. `dtype` is "f32", "f16"
    or "q8_0" (see the module docstring). A config no GGUF layout expresses is refused naming the field; a
    GELU (erf) model is written with one line on stderr (see the module docstring)."""
    import gguf  # why here: the `gguf` extra, needed by this function alone

    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT, got {type(model).__name__}")
    _checks.check_choice("dtype", dtype, GGUF_TYPES)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("a GGUF file holds its tokenizer, and this model has none: pass tokenizer=")
    config, state = exported_state(model, tokenizer)
    layout = layout_for(config)
    layout.config_to_hf(config)  # refuses, naming the field, what the Hugging Face layout cannot express
    _check_expressible(config, layout)
    architecture = _ARCHITECTURES[layout.model_type]
    vocabulary = gguf_vocabulary(tokenizer)  # refused before anything is written
    if layout is GPT2 and config.activation == "gelu":
        logits, loss = tanh_gelu_effect(model, config.vocab_size)
        log(f"gguf: activation='gelu' goes out as llama.cpp's gpt2, which computes GELU's tanh approximation "
            f"(within 5e-4 of erf's): on {TANH_PROBE_TOKENS} random tokens it moves this model's logits by at "
            f"most {logits:.1e} and their mean loss by {loss:.1e}")
    path = Path(path)
    with atomic_path(path) as tmp:
        # why use_temp_file: the tensors are then copied in by Python's file writes, whose full-disk error
        # carries ENOSPC (numpy's `tofile`, used otherwise, reports a short write with no errno)
        writer = gguf.GGUFWriter(tmp, architecture, use_temp_file=True)
        writer.add_name(path.stem)
        writer.add_file_type(_FILE_TYPES[dtype])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hyperparameters(writer, config, architecture)
        _add_vocabulary(writer, vocabulary)
        if tokenizer.chat_template is not None:
            writer.add_chat_template(tokenizer.chat_template)
        for name, array, qtype in gguf_tensors(state, config, layout, dtype):
            writer.add_tensor(name, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _check_expressible(config: GPTConfig, layout: Layout) -> None:
    """What llama.cpp's gpt2, llama and qwen3 graphs compute beyond the Hugging Face layouts' own checks."""
    if config.sliding_window is not None:
        raise ValueError(f"sliding_window={config.sliding_window} has no GGUF layout here: llama.cpp's llama and "
                         "qwen3 read no window, so every layer would attend to all earlier positions "
                         "(sliding_window must be None)")
    if layout is GPT2 and config.activation not in ("gelu_tanh", "gelu"):
        raise ValueError(f"activation={config.activation!r} has no GGUF layout here: llama.cpp's gpt2 computes "
                         "GELU's tanh approximation (activation='gelu_tanh', or 'gelu', within 5e-4 of it)")


TANH_PROBE_TOKENS = 64  # at most; a block_size below it takes block_size


@torch.no_grad()
def tanh_gelu_effect(model: GPT, vocab_size: int | None = None) -> tuple[float, float]:
    """For a GELU (erf) GPT: (max |z - z'|, |L - L'|) over one row of up to TANH_PROBE_TOKENS random token
    ids below `vocab_size` (default: the model's; seeded, so the same each time), where z (n, V) are the
    model's logits, z' those of the same weights with GELU's tanh approximation, and L, L' the mean
    next-token loss of that row under each. The twin holds no weights of its own: it is built on the meta
    device and called with the model's tensors."""
    config = model.config
    n = min(TANH_PROBE_TOKENS, config.block_size)
    device = next(model.parameters()).device
    vocab_size = vocab_size or config.vocab_size
    ids = torch.randint(vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.device("meta"):
        twin = GPT(config.replace(activation="gelu_tanh"))
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with eval_mode(model), eval_mode(twin):
        erf = model(ids)[0][0, :, :vocab_size].double()  # (n, V): the ids' columns, not a padding's
        tanh = torch.func.functional_call(twin, tensors, (ids,))[0][0, :, :vocab_size].double()
    losses = [F.cross_entropy(z[:-1], ids[0, 1:]).item() for z in (erf, tanh)]
    return (erf - tanh).abs().max().item(), abs(losses[0] - losses[1])


_NORMAL, _CONTROL = 1, 3  # gguf.TokenType
_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # gguf.LlamaFileType: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


def _add_hyperparameters(writer: Any, config: GPTConfig, architecture: str) -> None:
    """The keys llama.cpp reads for `architecture` (`{architecture}.context_length`, ...)."""
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads or config.n_heads)
    if architecture == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
        return
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_base)
    if config.n_experts:
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.top_k)


# ----------------------------------------------------------------------------- tensors

def gguf_tensors(state: dict[str, Tensor], config: GPTConfig, layout: Layout,
                 dtype: str) -> Iterator[tuple[str, np.ndarray, Any]]:
    """(GGUF name, data, GGML type) of every tensor, in the layout's order: data is what `GGUFWriter.add_tensor`
    takes (float32, float16, or q8_0's bytes (rows, n/32·34) uint8)."""
    import gguf

    architecture = {"gpt2": gguf.MODEL_ARCH.GPT2, "llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}
    names = gguf.get_tensor_name_map(architecture[_ARCHITECTURES[layout.model_type]], config.n_layers)
    hf_state = state_to_hf(state, config, layout)  # its checks (a Mixtral router bias must be zero) included
    for w in weight_map(config, layout):
        if w.expert not in (None, 0):
            continue  # the experts go out stacked, with expert 0
        module, _, leaf = w.hf.rpartition(".")
        if w.expert is None:
            tensor = hf_state[w.hf].T if w.transpose else hf_state[w.hf]  # (out, in) again
        else:
            module = module.replace("experts.0.", "experts.")  # one name for all E experts
            tensor = state[w.ours[0]].detach().cpu()  # (E, out, in), as GGUF stacks them
        name = names.get_name(module)
        if name is None:
            raise AssertionError(f"gguf names no tensor for {module}")  # a layout the table lacks
        tensor = _rotary_pairs_adjacent(name, tensor, config, layout)
        yield (f"{name}.{leaf}", *_encoded(name, tensor.float().numpy(), dtype))


def _rotary_pairs_adjacent(name: str, tensor: Tensor, config: GPTConfig, layout: Layout) -> Tensor:
    """For llama.cpp's `llama`, W_q's or W_k's rows (or bias) r_0 .. r_{d-1} of each head as r_0, r_{d/2}, r_1,
    r_{d/2+1}, ...: (H·d, ...) -> (H, 2, d/2, ...) -> (H, d/2, 2, ...) -> (H·d, ...). Its `qwen3` rotates the
    halves (NeoX's rotary), as we do, and takes the rows as they are."""
    if _ARCHITECTURES[layout.model_type] != "llama" or not name.endswith(("attn_q", "attn_k")):
        return tensor
    heads = config.n_heads if name.endswith("attn_q") else config.n_kv_heads or config.n_heads
    d = config.head_dim
    return tensor.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(tensor.shape)


def _encoded(name: str, array: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """`array` as `dtype` where a matrix can be (vectors and the router stay float32) and its GGML type."""
    import gguf

    types = gguf.GGMLQuantizationType
    if array.ndim == 1 or name.endswith("ffn_gate_inp"):
        return array, types.F32
    if dtype == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0] == 0:
        return gguf.quants.quantize(array, types.Q8_0), types.Q8_0
    if dtype == "f32":
        return array, types.F32
    return array.astype(np.float16), types.F16


# ----------------------------------------------------------------------------- tokenizer

def gguf_vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """`tokenizer` as one of llama.cpp's tokenizer models (its `tokenizer.ggml.*` keys): a char tokenizer as
    `rwkv`, a byte-level BPE as `gpt2`; refused, naming what llama.cpp cannot express, for any other."""
    if isinstance(tokenizer, CharTokenizer):
        return _char_vocabulary(tokenizer)
    if isinstance(tokenizer, BPETokenizer):
        return _bpe_vocabulary(tokenizer)
    raise ValueError(f"a {tokenizer.kind} tokenizer has no GGUF form here: llama.cpp's rwkv and gpt2 tokenizer "
                     "models express the char and bpe tokenizers")


def _rwkv_escaped(char: str) -> str:
    """A character as llama.cpp's rwkv vocabulary writes a token: control characters and the backslash as
    \\xHH (lowercase hex), every other character as itself."""
    return "".join(f"\\x{b:02x}" for b in char.encode()) if ord(char) < 0x20 or char in "\\\x7f" else char


def _char_vocabulary(tokenizer: CharTokenizer) -> dict[str, Any]:
    """One token per character, in llama.cpp's rwkv model: a greedy longest match, which over tokens of one
    character each takes one character at a time. (Its gpt2 model would split alike, but takes id 11 for the
    end-of-text token of a vocabulary that names none, so generation would stop at that character.)"""
    return {"model": "rwkv", "tokens": [_rwkv_escaped(c) for c in tokenizer.chars],
            "types": [_NORMAL] * tokenizer.vocab_size}


# The one pre-tokenizer a bpe tokenizer trained here has (BPETokenizer.train), which is GPT-2's: the regex
# split of llama.cpp's pre-tokenizer "gpt-2", then bytes mapped to the alphabet.
_GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _bpe_vocabulary(tokenizer: BPETokenizer) -> dict[str, Any]:
    """Tokens in GPT-2's byte alphabet by id, the special ones as control tokens, and the merges in rank order."""
    spec = json.loads(tokenizer._files()[TOKENIZER_FILE])
    pre = spec.get("pre_tokenizer") or {}
    if {k: pre.get(k) for k in _GPT2_PRE} != _GPT2_PRE or spec.get("normalizer") or spec.get("post_processor"):
        raise ValueError(f"this BPE tokenizer's normalizer, pre-tokenizer {pre.get('type')!r} or post-processor has "
                         "no GGUF form here: llama.cpp's 'gpt-2' pre-tokenizer is GPT-2's ByteLevel regex "
                         "(add_prefix_space=False), with no normalizer and no post-processor")
    if tokenizer.eos_id is None:
        raise ValueError("a BPE tokenizer without an end-of-text token has no GGUF form here: llama.cpp would take "
                         "token 11 for it and stop generating there (train it with special_tokens=('eos',))")
    special = set(tokenizer.all_special_ids)
    return {"model": "gpt2", "pre": "gpt-2",
            "tokens": [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)],
            "types": [_CONTROL if i in special else _NORMAL for i in range(tokenizer.vocab_size)],
            "merges": [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]],
            "bos": tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id, "eos": tokenizer.eos_id}


def _add_vocabulary(writer: Any, vocabulary: dict[str, Any]) -> None:
    writer.add_tokenizer_model(vocabulary["model"])
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    if vocabulary["model"] == "gpt2":
        writer.add_tokenizer_pre(vocabulary["pre"])
        writer.add_token_merges(vocabulary["merges"])
        writer.add_bos_token_id(vocabulary["bos"])
        writer.add_eos_token_id(vocabulary["eos"])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
