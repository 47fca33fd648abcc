"""`plainformer export | attention`: a run as a Hugging Face directory, a GGUF file or a LoRA adapter, and its
attention as a picture.

    plainformer export --ckpt RUN --out DIR        DIR loads with AutoModelForCausalLM / AutoTokenizer
    plainformer export --ckpt RUN --out FILE.gguf [--gguf-type f32|f16|q8_0]     llama-cli -m FILE.gguf
    plainformer export --ckpt LORA_RUN --out DIR --adapter     DIR loads with PeftModel.from_pretrained
    plainformer attention --ckpt RUN --text "..." --out attn.png [--layer L] [--head H]
    plainformer attention --ckpt RUN --text "..." --html attn.html     (the explorer: one self-contained page)
    plainformer attention --ckpt RUN --source "..." --target "..." --out attn.png   (encoder-decoder)

--ckpt takes a checkpoint directory, a run directory (its best/, else last/; a LoRA run's model is its
adapter on its base) or a Hugging Face directory. export writes a LoRA run's model merged, or with
--adapter its adapter alone.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import families
from ..checkpoint.format import load_checkpoint
from ..data.tokenizers import Tokenizer
from ..families.family import Family, checkpoint_dir
from ..files.atomic import atomic_path
from ..hf.directory import read_hf_config
from ..hf.gguf import GGUF_TYPES
from ..hf.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, has_peft_names, save_lora
from ..models.attention_html import DECIMALS, PROBABILITY_DECIMALS, attention_html, token_labels
from ..models.attention_maps import attention_maps, plot_attention_maps
from ..models.saved import SavedModel
from ..nn.lora import LoRALinear, unload_lora
from . import UserError

CKPT_HELP = "checkpoint directory, run directory (its best/, else last/) or Hugging Face directory"


def register(subcommands: argparse._SubParsersAction) -> None:
    _register_export(subcommands)
    _register_attention(subcommands)


def load_any(path: Path) -> tuple[SavedModel, Family]:
    """The model (with `.tokenizer`) of a Hugging Face directory or of a plainformer checkpoint or run,
    and its family."""
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist")
    model = families.load_model(path)
    return model, families.get(model.family)


# ----------------------------------------------------------------------------- export

def _register_export(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "export", help="write a trained model as a Hugging Face directory, a GGUF file or a LoRA adapter",
        description="Write config.json, model.safetensors and the tokenizer (tokenizer.json, "
                    "tokenizer_config.json) that transformers' AutoModelForCausalLM (a GPT: GPT-2 or "
                    "Llama layout) or BertModel (a BERT's encoder) and AutoTokenizer load; or a GPT as one "
                    "GGUF file that llama.cpp and Ollama run (--out FILE.gguf); or a LoRA run's adapter "
                    "alone, which PEFT loads (--adapter).")
    parser.add_argument("--ckpt", type=Path, required=True, help=CKPT_HELP)
    parser.add_argument("--out", type=Path, required=True,
                        help="the Hugging Face directory, GGUF file (FILE.gguf) or adapter directory to write")
    parser.add_argument("--format", choices=("hf", "gguf"),
                        help="what to write (default: gguf for an --out ending in .gguf, else hf)")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES,
                        help="GGUF: the weights' type (default f32); q8_0 is llama.cpp's 8-bit blocks of 32")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its adapter alone (adapter_model.safetensors, adapter_config.json "
                             "in PEFT's format) instead of the merged model")
    parser.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> dict[str, Any]:
    form = _export_format(args)
    model, family = load_any(args.ckpt)
    if not args.adapter:
        unload_lora(model)  # a LoRA run's model is exported merged, in the base's layout
    write = _export_adapter if args.adapter else _export_gguf if form == "gguf" else _export_hf
    created = not args.out.exists()
    try:
        return write(args, model, family)
    except BaseException:
        if created:  # nothing half-written is left where there was nothing (a file is written atomically)
            shutil.rmtree(args.out, ignore_errors=True)
        raise


def _export_hf(args: argparse.Namespace, model: SavedModel, family: Family) -> dict[str, Any]:
    tokenizer = model.tokenizer
    if family.export is None:
        raise UserError(f"a {type(model).__name__} has no Hugging Face layout here; export takes a GPT or a BERT")
    family.export(model, args.out, tokenizer)
    hf = read_hf_config(args.out)
    return {"out": str(args.out), "model_type": hf["model_type"], "architecture": hf["architectures"][0],
            "tokenizer": None if tokenizer is None else tokenizer.kind}


def _export_format(args: argparse.Namespace) -> str:
    """"hf" or "gguf": --format's, else the suffix of --out's; the flags that go together checked."""
    form = args.format or ("gguf" if args.out.suffix == ".gguf" else "hf")
    if args.adapter and (args.format or args.gguf_type or form != "hf"):
        raise UserError("--adapter writes an adapter directory in PEFT's format: leave out --format and "
                        "--gguf-type, and give --out a directory")
    if args.gguf_type and form != "gguf":
        raise UserError("--gguf-type sets the weights of a GGUF file: give --out FILE.gguf (or --format gguf)")
    return form


def _export_gguf(args: argparse.Namespace, model: SavedModel, family: Family) -> dict[str, Any]:
    if family.gguf is None:
        raise UserError(f"a {type(model).__name__} has no GGUF layout here; a GGUF export takes a GPT "
                        "(GPT-2 or Llama layout)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gguf_type = args.gguf_type or "f32"
    family.gguf(model, args.out, model.tokenizer, gguf_type)
    return {"out": str(args.out), "format": "gguf", "gguf_type": gguf_type, "bytes": args.out.stat().st_size,
            "tokenizer": None if model.tokenizer is None else model.tokenizer.kind}


def _export_adapter(args: argparse.Namespace, model: SavedModel, family: Family) -> dict[str, Any]:
    """A LoRA run's adapter alone, in PEFT's format, naming the base the run recorded."""
    if not any(isinstance(module, LoRALinear) for module in model.modules()):
        raise UserError(f"--adapter exports a LoRA run's adapter, and {args.ckpt} holds none "
                        "(fine-tune with --lora-r to make one)")
    if not has_peft_names(model):
        raise UserError(f"the LoRA adapter of {args.ckpt} has no PEFT form: its base's Hugging Face layout fuses "
                        "the layers it adapts (GPT-2's c_attn holds W_q, W_k and W_v in one tensor); export the "
                        "merged model instead (leave out --adapter)")
    adapter = load_checkpoint(checkpoint_dir(args.ckpt), verify=False).adapter or {}
    base = adapter.get("base", {}).get("path")
    save_lora(model, args.out, base_model_name_or_path=base)
    return {"out": str(args.out), "format": "adapter", "files": [ADAPTER_WEIGHTS, ADAPTER_CONFIG],
            "base_model_name_or_path": base}


# ----------------------------------------------------------------------------- attention

def _register_attention(subcommands: argparse._SubParsersAction) -> None:
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


def _attention_inputs(args: argparse.Namespace, model: SavedModel, family: Family,
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


def _plot(args: argparse.Namespace, model: SavedModel, tokenizer: Tokenizer, idx: Tensor,
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
