"""`plainformer attention`: a model's attention as a picture, or as a self-contained HTML explorer.

    plainformer attention --ckpt RUN --text "..." --out attn.png [--layer L] [--head H]
    plainformer attention --ckpt RUN --text "..." --html attn.html     (the explorer: one self-contained page)
    plainformer attention --ckpt RUN --source "..." --target "..." --out attn.png   (encoder-decoder)

--ckpt takes a checkpoint directory, a run directory (its best/, else last/; a LoRA run's model is its
adapter on its base) or a Hugging Face directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..data.tokenizers import Tokenizer
from ..explorer.page import DECIMALS, PROBABILITY_DECIMALS, attention_html, token_labels
from ..families.family import Family
from ..files.atomic import atomic_path
from ..models.attention_maps import attention_maps, plot_attention_maps
from ..models.family_model import FamilyModel
from . import CKPT_HELP, UserError, check_output_path, load_any


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "attention", help="plot attention maps, layers x heads",
        description="A grid of heatmaps, one row per layer and one column per head, tokens on both axes: "
                    "self-attention of a GPT or a BERT over --text, or an encoder-decoder's "
                    "cross-attention of --target over --source.")
    parser.add_argument("--ckpt", type=Path, required=True, help=CKPT_HELP)
    parser.add_argument("--text", help="the text whose self-attention is plotted (GPT, BERT)")
    parser.add_argument("--source", help="encoder-decoder: the source sentence")
    parser.add_argument("--target", help="encoder-decoder: the target sentence (after BOS)")
    parser.add_argument("--out", type=Path, help="the PNG to write")
    parser.add_argument("--html", type=Path, help="the attention explorer to write: one self-contained HTML page "
                                                  "(head view, model view, a GPT's next tokens)")
    parser.add_argument("--decimals", type=int, default=DECIMALS,
                        help=f"--html: the weights are rounded to this many decimals (default {DECIMALS})")
    parser.add_argument("--layer", type=int, help="--out: one layer only (default: all)")
    parser.add_argument("--head", type=int, help="--out: one head only (default: all)")
    parser.set_defaults(run=run_attention)


def run_attention(args: argparse.Namespace) -> dict[str, Any]:
    _check_attention_outputs(args)
    model, family = load_any(args.ckpt)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UserError(f"{args.ckpt} holds no tokenizer, so the text cannot be encoded")
    idx, tgt = _attention_inputs(args, model, family, tokenizer)
    result: dict[str, Any] = {}
    if args.out is not None:
        result = _plot(args, model, tokenizer, idx, tgt)
    if args.html is not None:
        page = attention_html(model, idx, tgt, tokenizer=tokenizer, decimals=args.decimals,
                              title=f"{args.ckpt.name or args.ckpt}: attention")
        _write_text(args.html, page)
        result = {**result, "html": str(args.html), "bytes": len(page.encode())}
    return result


def _check_attention_outputs(args: argparse.Namespace) -> None:
    if args.out is None and args.html is None:
        raise UserError("give --out (a PNG of the maps), --html (the explorer page) or both")
    if args.out is None and (args.layer is not None or args.head is not None):
        raise UserError("--layer and --head choose what the PNG --out shows; the --html page holds every one")
    if not 1 <= args.decimals <= PROBABILITY_DECIMALS:
        raise UserError(f"--decimals must be in [1, {PROBABILITY_DECIMALS}], got {args.decimals}")
    for flag, path in (("--out", args.out), ("--html", args.html)):
        if path is not None:
            check_output_path(flag, path)


def _attention_inputs(args: argparse.Namespace, model: FamilyModel, family: Family,
                      tokenizer: Tokenizer) -> tuple[Tensor, Tensor | None]:
    """The ids whose attention is drawn: --text's, or --source's and BOS + --target's."""
    config: Any = model.config
    max_len = getattr(config, family.positions)
    if family.cross_attention:
        if args.source is None or args.target is None or args.text is not None:
            raise UserError("an encoder-decoder plots cross-attention: give --source and --target, not --text")
        source, target = tokenizer.encode(args.source), [config.bos_id, *tokenizer.encode(args.target)]
        _check_length("--source", source, max_len)
        _check_length("--target", target, max_len)
        return torch.tensor(source), torch.tensor(target)
    if args.text is None or args.source is not None or args.target is not None:
        raise UserError(f"a {type(model).__name__} plots self-attention: give --text, not --source/--target")
    ids = tokenizer.encode(args.text)
    _check_length("--text", ids, max_len)
    return torch.tensor(ids), None


def _plot(args: argparse.Namespace, model: FamilyModel, tokenizer: Tokenizer, idx: Tensor,
          tgt: Tensor | None) -> dict[str, Any]:
    weights = attention_maps(model, idx, tgt)
    keys = token_labels(tokenizer, idx.tolist())
    queries = keys if tgt is None else token_labels(tokenizer, tgt.tolist())
    layers = _selection("--layer", args.layer, weights.shape[0], "layers")
    heads = _selection("--head", args.head, weights.shape[1], "heads")
    plot_attention_maps(weights[layers][:, heads], args.out, queries=queries, keys=keys, layers=layers,
                        heads=heads)
    return {"out": str(args.out), "layers": len(layers), "heads": len(heads), "queries": len(queries),
            "keys": len(keys)}


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _check_length(flag: str, ids: Sequence[int], max_len: int) -> None:
    if not ids:
        raise UserError(f"{flag} encodes to no tokens; give at least one character")
    if len(ids) > max_len:
        raise UserError(f"{flag} encodes to {len(ids)} tokens, more than the model's {max_len} positions")


def _selection(flag: str, value: int | None, size: int, what: str) -> list[int]:
    if value is None:
        return list(range(size))
    if not 0 <= value < size:
        raise UserError(f"{flag} must be in [0, {size}) (the model has {size} {what}), got {value}")
    return [value]
