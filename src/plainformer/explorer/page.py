"""An attention explorer: one self-contained HTML page of every attention weight of one sequence.

    pf.attention_html(model, ids)             GPT, BERT: self-attention of ids (n,)
    pf.attention_html(model, src, tgt)        Transformer: encoder, decoder and cross-attention

The page (inline CSS and JavaScript, no network, opens from file://) has a head view (the tokens in
two columns, lines weighted by A[l, h, i, j] for the chosen layer and heads, one colour per head;
hovering or focusing a token keeps only its row), a model view (every layer x head as a small
heatmap; clicking one opens it in the head view) and, for a GPT, the top-5 next tokens at the
hovered position, softmax(logits[i]).

What it draws is embedded as JSON in <script type="application/json" id="attention-data">:

    tokens                   the n token labels (GPT, BERT)
    source_tokens, target_tokens                the m source and n target labels (Transformer)
    layers, heads            L and H of `weights` (a Transformer's `encoder_layers` may differ)
    weights                  (L, H, n, n) self-attention (a Transformer's: the decoder's)
    weights_encoder          (L_enc, H, m, m) a Transformer's encoder self-attention
    weights_cross            (L, H, n, m) a Transformer's cross-attention, target over source
    next_tokens              a GPT's, per position: the top-5 [label, probability]
    decimals                 every weight is rounded to this many decimals (probabilities to 6)

Token labels make whitespace and special tokens visible (␣ for a space, ⏎ for a line break, ⇥ for
a tab, <eos> as its name); a byte-level BPE piece that is not whole UTF-8 shows its bytes as \\xNN.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import torch
from torch import Tensor, nn

from ..data.tokenizers import Tokenizer
from ..models.attention_maps import recorded_forward, visible
from ..models.gpt import GPT
from ..models.transformer import Transformer

DECIMALS = 3  # 1e-3 of a weight in [0, 1]: finer than a line's opacity or a heatmap cell can show
PROBABILITY_DECIMALS = 6
TOP_K = 5


def attention_html(model: nn.Module, ids: Tensor | Sequence[int], tgt: Tensor | Sequence[int] | None = None, *,
                   tokenizer: Tokenizer | None = None, title: str | None = None, decimals: int = DECIMALS) -> str:
    """The explorer page of `attention_data(model, ids, tgt, ...)`, as one HTML string."""
    data = attention_data(model, ids, tgt, tokenizer=tokenizer, decimals=decimals)
    title = title or f"{type(model).__name__} attention"
    return _template("explorer.html").format(
        title=html.escape(title), css=_template("explorer.css"), js=_template("explorer.js"),
        data=_script_safe_json(data))


def attention_data(model: nn.Module, ids: Tensor | Sequence[int], tgt: Tensor | Sequence[int] | None = None, *,
                   tokenizer: Tokenizer | None = None, decimals: int = DECIMALS) -> dict[str, Any]:
    """The JSON object the page draws (see the module docstring), from one forward pass.

    ids (n,) token ids (a Transformer: the source, and tgt the decoder input). tokenizer (default:
    `model.tokenizer`) labels the tokens; without one the labels are the ids."""
    if not (isinstance(decimals, int) and 1 <= decimals <= PROBABILITY_DECIMALS):
        raise ValueError(f"decimals must be an int in [1, {PROBABILITY_DECIMALS}], got {decimals!r}")
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    src, target = torch.as_tensor(ids), None if tgt is None else torch.as_tensor(tgt)
    maps, output = recorded_forward(model, src, target)
    label = _labeller(tokenizer)
    if isinstance(model, Transformer):
        assert target is not None  # recorded_forward refuses a Transformer without tgt
        cross = maps["cross"]
        return {"source_tokens": label(src.flatten().tolist()), "target_tokens": label(target.flatten().tolist()),
                "layers": cross.shape[0], "heads": cross.shape[1], "encoder_layers": maps["encoder"].shape[0],
                "weights": rounded(maps["decoder"], decimals), "weights_encoder": rounded(maps["encoder"], decimals),
                "weights_cross": rounded(cross, decimals), "decimals": decimals}
    weights = maps["self"]
    data: dict[str, Any] = {"tokens": label(src.flatten().tolist()), "layers": weights.shape[0],
                            "heads": weights.shape[1], "weights": rounded(weights, decimals), "decimals": decimals}
    if isinstance(model, GPT):
        data["next_tokens"] = _next_tokens(output[0][0], label)
    return data


def rounded(weights: Tensor, decimals: int) -> list:
    """weights as nested lists, each rounded to `decimals` (0 written as 0, not 0.0)."""
    return _nested(weights.double().mul(10**decimals).round().div(10**decimals).tolist())


def _nested(values: Any) -> Any:
    if isinstance(values, list):
        return [_nested(v) for v in values]
    return 0 if values == 0 else values


def _next_tokens(logits: Tensor, label: Any) -> list[list[list[Any]]]:
    """logits (n, V) -> per position the top-5 [label, p] of p = softmax(logits)."""
    probabilities = torch.softmax(logits.double(), dim=-1)
    top = probabilities.topk(min(TOP_K, probabilities.shape[-1]), dim=-1)
    return [[[text, round(p, PROBABILITY_DECIMALS)] for text, p in zip(label(ids), ps, strict=True)]
            for ids, ps in zip(top.indices.tolist(), top.values.tolist(), strict=True)]


def _labeller(tokenizer: Tokenizer | None) -> Any:
    """ids -> their labels (`token_labels`), or the ids themselves without a tokenizer."""
    if tokenizer is None:
        return lambda ids: [str(i) for i in ids]
    return lambda ids: token_labels(tokenizer, ids)


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token as `token_label` shows it, special tokens by name (decoding would drop them)."""
    special = {tokenizer.token_to_id(token): token for token in tokenizer.special_tokens.values()}
    return [special[i] if i in special else token_label(tokenizer, i) for i in ids]


def token_label(tokenizer: Tokenizer, i: int) -> str:
    """Token i as readable text with its whitespace visible; a piece of a UTF-8 character as \\xNN."""
    text = tokenizer.decode([i])
    if "\ufffd" in text:
        piece = _byte_level_bytes(tokenizer.id_to_token(i))
        if piece is not None:
            text = piece.decode("utf-8", errors="backslashreplace")
    return visible(text)


@cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable bytes stand for themselves, the
    other 68 (controls, space, ...) for the characters 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


def _byte_level_bytes(piece: str | None) -> bytes | None:
    alphabet = _byte_alphabet()
    if not piece or any(c not in alphabet for c in piece):
        return None
    return bytes(alphabet[c] for c in piece)


def _script_safe_json(data: dict[str, Any]) -> str:
    """JSON that cannot end its <script> element early: <, > and & written as \\u escapes."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


@cache
def _template(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")
