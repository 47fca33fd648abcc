"""`plainformer export`: a run as a Hugging Face directory, a GGUF file or a LoRA adapter.

    plainformer export --ckpt RUN --out DIR        DIR loads with AutoModelForCausalLM / AutoTokenizer
                                                   (a translation run's: MarianMTModel / MarianTokenizer,
                                                   and ct2-transformers-converter converts it)
    plainformer export --ckpt RUN --out FILE.gguf [--gguf-type f32|f16|q8_0]     llama-cli -m FILE.gguf
    plainformer export --ckpt LORA_RUN --out DIR --adapter     DIR loads with PeftModel.from_pretrained
    plainformer export --ckpt CLASSIFIER_RUN --out DIR         pipeline("text-classification", model=DIR) runs it

--ckpt takes a checkpoint directory, a run directory (its best/, else last/; a LoRA run's model is its
adapter on its base) or a Hugging Face directory. export writes a LoRA run's model merged, or with
--adapter its adapter alone.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint.format import load_checkpoint
from ..families.family import Family, checkpoint_dir
from ..gguf.writer import GGUF_TYPES
from ..hf.directory import read_hf_config
from ..hf.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, has_peft_names, save_lora
from ..models.family_model import FamilyModel
from ..nn.lora import LoRALinear, unload_lora
from . import CKPT_HELP, UserError, check_output_path, load_any


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "export", help="write a trained model as a Hugging Face directory, a GGUF file or a LoRA adapter",
        description="Write config.json, model.safetensors and the tokenizer (tokenizer.json, "
                    "tokenizer_config.json) that transformers' AutoModelForCausalLM (a GPT: GPT-2 or "
                    "Llama layout), BertModel (a BERT's encoder) or BertForSequenceClassification (a classifier, "
                    "its classes as id2label) and AutoTokenizer load, or a translation model as the Marian "
                    "directory that MarianMTModel and MarianTokenizer load (and CTranslate2's "
                    "ct2-transformers-converter converts); or a GPT as one "
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


def _export_hf(args: argparse.Namespace, model: FamilyModel, family: Family) -> dict[str, Any]:
    tokenizer = model.tokenizer
    if family.export is None:
        raise UserError(f"a {type(model).__name__} has no Hugging Face layout here; export takes a GPT, a BERT or "
                        "a translation Transformer")
    family.export(model, args.out, tokenizer)
    hf = read_hf_config(args.out)
    return {"out": str(args.out), "model_type": hf["model_type"], "architecture": hf["architectures"][0],
            "tokenizer": None if tokenizer is None else tokenizer.kind}


def _export_format(args: argparse.Namespace) -> str:
    """"hf" or "gguf": --format's, else the suffix of --out's; the flags that go together checked."""
    form = args.format or ("gguf" if args.out.suffix == ".gguf" else "hf")
    check_output_path("--out", args.out)
    if form == "gguf" and args.out.is_dir():
        raise UserError(f"--out {args.out} is a directory; a GGUF export writes one file: give --out FILE.gguf")
    if args.adapter and (args.format or args.gguf_type or form != "hf"):
        raise UserError("--adapter writes an adapter directory in PEFT's format: leave out --format and "
                        "--gguf-type, and give --out a directory")
    if args.gguf_type and form != "gguf":
        raise UserError("--gguf-type sets the weights of a GGUF file: give --out FILE.gguf (or --format gguf)")
    return form


def _export_gguf(args: argparse.Namespace, model: FamilyModel, family: Family) -> dict[str, Any]:
    if family.gguf is None:
        raise UserError(f"a {type(model).__name__} has no GGUF layout here; a GGUF export takes a GPT "
                        "(GPT-2 or Llama layout)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gguf_type = args.gguf_type or "f32"
    family.gguf(model, args.out, model.tokenizer, gguf_type)
    return {"out": str(args.out), "format": "gguf", "gguf_type": gguf_type, "bytes": args.out.stat().st_size,
            "tokenizer": None if model.tokenizer is None else model.tokenizer.kind}


def _export_adapter(args: argparse.Namespace, model: FamilyModel, family: Family) -> dict[str, Any]:
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
