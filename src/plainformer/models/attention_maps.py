"""Attention maps: the weights softmax(q kᵀ / √d_k) each head puts on each key, for notebooks and plots.

    A[l, h, i, j] = weight that query i puts on key j in head h of layer l        (L, H, n, m)

The weights come from `MultiHeadAttention(need_weights=True)` itself: while `recorded_attention` is
open, every call of the chosen attention modules is made with need_weights=True (a forward pre-hook)
and the weights are kept (a forward hook), the module passing on its usual output; the model's own
forward runs unchanged. GPT and BERT give self-attention (n = m = tokens); the encoder-decoder
`Transformer` gives the decoder's cross-attention, target positions over source positions
(`all_attention_maps`: its encoder and decoder self-attention too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import _checks
from ..files.atomic import atomic_path
from ..nn.attention import MultiHeadAttention
from ..nn.dtypes import at_least_float32
from ..nn.modes import eval_mode
from .bert import BertModel
from .gpt import GPT
from .transformer import Transformer


@contextlib.contextmanager
def recorded_attention(modules: Sequence[MultiHeadAttention]) -> Iterator[list[Tensor]]:
    """While open, each call of one of `modules` also records its weights (B, h, n, m), in call order."""
    weights: list[Tensor] = []

    def ask_for_weights(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        return args, {**kwargs, "need_weights": True}

    def keep_weights(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Tensor:
        out, attention = output
        weights.append(attention.detach())
        return out

    handles = []
    try:
        for module in modules:
            if not isinstance(module, MultiHeadAttention):
                raise TypeError(f"modules must be MultiHeadAttention layers, got {type(module).__name__}")
            handles.append(module.register_forward_pre_hook(ask_for_weights, with_kwargs=True))
            handles.append(module.register_forward_hook(keep_weights, with_kwargs=True))
        yield weights
    finally:
        for handle in handles:
            handle.remove()


def attention_maps(model: nn.Module, idx: Tensor, tgt: Tensor | None = None) -> Tensor:
    """The attention weights of one sequence, (L, H, n, m), every row summing to 1.

    model: a GPT or BertModel (or a BERT task model, through its `.bert`): idx (n,) or (1, n) token
    ids -> self-attention, (L, H, n, n). A Transformer: idx the source (m,), tgt the decoder input
    (n,) -> the decoder's cross-attention, (L, H, n, m).
    """
    maps = all_attention_maps(model, idx, tgt)
    return maps["cross"] if "cross" in maps else maps["self"]


def all_attention_maps(model: nn.Module, idx: Tensor, tgt: Tensor | None = None) -> dict[str, Tensor]:
    """Every attention of one sequence, by kind, from one forward pass:

        GPT, BERT      {"self": (L, H, n, n)}
        Transformer    {"encoder": (L_enc, H, m, m), "decoder": (L_dec, H, n, n), "cross": (L_dec, H, n, m)}

    with idx (and tgt) as `attention_maps` takes them."""
    return recorded_forward(model, idx, tgt)[0]


def recorded_forward(model: nn.Module, idx: Tensor, tgt: Tensor | None = None) -> tuple[dict[str, Tensor], Any]:
    """`all_attention_maps` and the model's own output of the same forward pass (a GPT's: logits
    (1, n, V) and None), in eval mode without gradients."""
    idx = _one_sequence("idx", idx)
    model, groups, call = _attention_groups(model, idx, tgt)
    with eval_mode(model), torch.no_grad(), contextlib.ExitStack() as stack:
        recorded = {kind: stack.enter_context(recorded_attention(modules)) for kind, modules in groups.items()}
        output = call()
    return {kind: at_least_float32(torch.stack(weights)[:, 0]) for kind, weights in recorded.items()}, output


def _attention_groups(model: nn.Module, idx: Tensor, tgt: Tensor | None
                      ) -> tuple[nn.Module, dict[str, list[MultiHeadAttention]], Callable[[], Any]]:
    """The model to run, its attention layers by kind, and the call that runs it on idx (and tgt)."""
    bert = getattr(model, "bert", None)
    if isinstance(bert, BertModel):
        model = bert
    if isinstance(model, Transformer):
        if tgt is None:
            raise ValueError("tgt (the decoder's input ids) is required for a Transformer's cross-attention")
        tgt = _one_sequence("tgt", tgt)
        groups = {"encoder": [layer.self_attn for layer in model.encoder.layers],
                  "decoder": [layer.self_attn for layer in model.decoder.layers],
                  "cross": [layer.cross_attn for layer in model.decoder.layers]}
        return model, cast(dict[str, list[MultiHeadAttention]], groups), lambda: model(idx, tgt)
    if isinstance(model, (GPT, BertModel)):
        if tgt is not None:
            raise ValueError(f"tgt applies to an encoder-decoder Transformer only, not a {type(model).__name__}")
        blocks = model.blocks if isinstance(model, GPT) else model.layers
        groups = {"self": [block.self_attn for block in blocks]}
        return model, cast(dict[str, list[MultiHeadAttention]], groups), lambda: model(idx)
    raise TypeError(f"model must be a GPT, a BERT or a Transformer, got {type(model).__name__}")


def _one_sequence(name: str, ids: Tensor) -> Tensor:
    _checks.check_tensor(name, ids, ndim=(1, 2), shape_doc="(n,) or (1, n)")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"{name} must hold one sequence, (n,) or (1, n), got shape {tuple(ids.shape)}")
    if ids.shape[-1] == 0:
        raise ValueError(f"{name} must hold at least one token")
    return ids.reshape(1, -1)


DPI = 100
MIN_CELL_INCHES = 2.2  # one heatmap, title and tick labels included
TOKEN_INCHES = 0.16  # per token on an axis, so that 8-point labels of a short sentence do not overlap


def figure_size(n_layers: int, n_heads: int, n: int, m: int) -> tuple[int, int]:
    """(width, height) in pixels of the PNG `plot_attention_maps` writes for a grid of n_layers x
    n_heads maps of n queries x m keys."""
    cell = max(MIN_CELL_INCHES, 1.0 + TOKEN_INCHES * max(n, m))
    return round(n_heads * cell * DPI), round(n_layers * cell * DPI)


VISIBLE = {" ": "\u2423", "\n": "\u23ce", "\t": "\u21e5", "\r": "\u21a9"}  # ␣ ⏎ ⇥ ↩


def visible(text: str) -> str:
    """text with spaces, line breaks and tabs as ␣ ⏎ ⇥, other control characters as \\xNN."""
    return "".join(VISIBLE.get(c, f"\\x{ord(c):02x}" if ord(c) < 32 else c) for c in text)


def plot_attention_maps(weights: Tensor, png_path: str | os.PathLike, *, queries: Sequence[str],
                        keys: Sequence[str] | None = None, layers: Sequence[int] | None = None,
                        heads: Sequence[int] | None = None) -> Path:
    """A grid of heatmaps, one row per layer and one column per head, queries down and keys across,
    written atomically as a PNG of `figure_size(L, H, n, m)` pixels.

    weights (L, H, n, m) as `attention_maps` returns; queries (n) and keys (m, default: queries) are the
    tokens' texts; layers and heads (default: all) are the row and column labels of the weights given.
    """
    from matplotlib.figure import Figure

    _checks.check_tensor("weights", weights, ndim=4, shape_doc="(L, H, n, m)")
    keys = list(queries if keys is None else keys)
    n_layers, n_heads, n, m = weights.shape
    if (len(queries), len(keys)) != (n, m):
        raise ValueError(f"queries and keys must label the weights' (n, m) = {(n, m)} axes, got "
                         f"{len(queries)} and {len(keys)} tokens")
    layers = list(range(n_layers)) if layers is None else list(layers)
    heads = list(range(n_heads)) if heads is None else list(heads)
    width, height = figure_size(n_layers, n_heads, n, m)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    for row, layer in enumerate(layers):
        for column, head in enumerate(heads):
            ax = axes[row][column]
            ax.imshow(weights[row, column].cpu().numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ax.set_xticks(range(m), [visible(k) for k in keys], rotation=90, fontsize=8)
            ax.set_yticks(range(n), [visible(q) for q in queries], fontsize=8)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return png_path
