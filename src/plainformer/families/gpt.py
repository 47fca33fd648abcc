"""The GPT language model family: trained on a text corpus through its tokenizer (char or byte-level
BPE), or fine-tuned from a pretrained GPT (ours, or Hugging Face's GPT-2, Llama or Mixtral) on your
text, whole or through LoRA; evaluated by its next-token loss over a whole validation split, exported
in the GPT-2, Llama or Mixtral layout of Hugging Face."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.format import load_checkpoint
from ..data.lm import LMBatchSource
from ..data.prepared import prepare_lm_data
from ..data.tokenizers import Tokenizer
from ..errors import UserError
from ..gguf.writer import save_gguf
from ..hf.auto import load_hf, save_hf
from ..hf.directory import is_hf_directory
from ..inference.quantize import quantize
from ..log import log
from ..models.gpt import GPT, GPTConfig
from ..nn.lora import unload_lora
from ..training.evaluation import validation_loss
from .family import FINE_TUNING_OPTIONS, Family, Run, fit, refuse_non_model
from .finetuning import load_trained, starting_model
from .memory_estimates import check_evaluation_memory

DEFAULT_BPE_VOCAB = 2048


def train(run: Run) -> dict[str, Any]:
    """`plainformer train` for a GPT recipe: the data of options["data"] through its tokenizer; a
    fine-tuning recipe's model (and tokenizer) come from options["init"]."""
    options = run.options
    sources: dict[str, Any] = dict(val_path=options.get("val_data"),
                                   text_field=options.get("text_field") or "text", progress=run.progress,
                                   log=log)
    _check_text_field(options)
    if run.fine_tuning:
        return _fine_tune(run, sources)
    if run.checkpoint is not None:  # resuming
        data = prepare_lm_data(options.get("data"), tokenizer=run.checkpoint.load_tokenizer(), **sources)
        model_config = run.model_config(GPTConfig)
    else:
        kind = options.get("tokenizer") or "char"
        if kind == "char" and options.get("vocab_size") is not None:
            raise UserError("--vocab-size sizes a trained tokenizer; the char tokenizer has one token "
                            "per character of the text (add --tokenizer bpe)")
        vocab_size = (options.get("vocab_size") or DEFAULT_BPE_VOCAB) if kind == "bpe" else None
        data = prepare_lm_data(options.get("data"), tokenizer=kind, vocab_size=vocab_size, **sources)
        model_config = run.model_config(GPTConfig).replace(vocab_size=data.tokenizer.vocab_size)
    _log_data(data)
    torch.manual_seed(run.train_config.seed)
    model = GPT(model_config)
    log(f"model: GPT {run.preset}, {model.num_parameters():,} parameters -> {run.out}")
    return _fit(run, model, LMBatchSource(data.train_tokens, data.val_tokens, model_config.block_size,
                                          seed=run.train_config.seed), data.tokenizer)


def _check_text_field(options: dict[str, Any]) -> None:
    """--text-field names a field of JSON Lines records: given with other data, it is a mistake."""
    if options.get("text_field") is None:
        return
    plain_text = [str(path) for path in (options.get("data"), options.get("val_data"))
                  if path is not None and str(path).endswith((".txt", ".txt.gz"))]
    if options.get("data") is None:
        plain_text.insert(0, "the bundled corpus")
    if plain_text:
        raise UserError(f"--text-field names the field of JSON Lines records (.jsonl); {plain_text[0]} is plain text")


def _fine_tune(run: Run, sources: dict[str, Any]) -> dict[str, Any]:
    """A pretrained GPT (options["init"]) on the text of options["data"], through its own tokenizer:
    every weight, or with --lora-r only the LoRA adapter."""
    torch.manual_seed(run.train_config.seed)  # the adapter's A
    model, adapter = starting_model(run)
    assert isinstance(model, GPT) and model.tokenizer is not None  # from_base and checkpoints give both
    data = prepare_lm_data(run.options.get("data"), tokenizer=model.tokenizer, **sources)
    _log_data(data)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"model: GPT from {run.options['init']}, "
        f"{model.num_parameters():,} parameters, {trainable:,} trained "
        f"({'LoRA r=' + str(adapter['lora']['r']) if adapter else 'all'}) -> {run.out}")
    source = LMBatchSource(data.train_tokens, data.val_tokens, model.config.block_size, seed=run.train_config.seed)
    return _fit(run, model, source, data.tokenizer, adapter)


def _log_data(data: Any) -> None:
    log(f"data: {len(data.train_tokens):,} train / {len(data.val_tokens):,} validation tokens, "
        f"{data.tokenizer.kind} tokenizer of {data.tokenizer.vocab_size} tokens")


def _fit(run: Run, model: GPT, source: LMBatchSource, tokenizer: Tokenizer,
         adapter: dict[str, Any] | None = None) -> dict[str, Any]:
    metrics = fit(run, model, source, tokenizer, adapter=adapter)
    log(f"checkpoints in {run.out}/last and {run.out}/best; sample with: plainformer sample --ckpt {run.out}")
    return {**metrics, "out": str(run.out)}


def from_base(directory: Path, changes: Mapping[str, Any]) -> GPT:
    """The GPT of `directory` (a checkpoint, a LoRA run's merged, or a Hugging Face GPT-2 / Llama /
    Mixtral) with its tokenizer, its config changed by `changes`."""
    base, tokenizer = load_language_model(directory)
    unload_lora(base)
    config = base.config.replace(**changes)
    if config == base.config:
        return base
    model = GPT(config)
    model.load_state_dict(base.state_dict())
    model.tokenizer = tokenizer
    return model


def load_language_model(path: Path, dtype: str = "float32", quantized: str | None = None
                        ) -> tuple[GPT, Tokenizer]:
    """The GPT of a checkpoint directory (a LoRA run's on its base), or of a Hugging Face GPT-2 / Llama /
    Mixtral directory, and the tokenizer saved with it, in `dtype` ("float32" or "bfloat16"), or
    `quantized` ("int8": a LoRA run's adapter merged first; `inference.quantize`)."""
    refuse_non_model(path)
    model = load_hf(path) if is_hf_directory(path) else load_trained(load_checkpoint(path), GPT_FAMILY)
    if not isinstance(model, GPT):
        raise UserError(f"{path} holds a {type(model).__name__}, not a language model "
                        "(GPT-2, Llama or Mixtral layout)")
    if model.tokenizer is None:
        raise UserError(f"{path} holds no tokenizer, so text cannot be encoded")
    if quantized is not None:
        if dtype != "float32":
            raise UserError(f"--quantize {quantized} quantizes the float32 weights: leave --dtype out")
        try:
            quantize(unload_lora(model), quantized, log=log)
        except ValueError as error:
            raise UserError(f"--quantize {quantized}: {error}") from None
    return (model.to(torch.bfloat16) if dtype == "bfloat16" else model), model.tokenizer


def evaluate(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
             ) -> dict[str, Any]:
    """`plainformer eval` of a GPT: mean next-token loss over the whole validation split of --data
    (default: the run's, else the bundled corpus), in consecutive windows of block_size tokens."""
    model, tokenizer = load_language_model(checkpoint, args.dtype or "float32", quantized=args.quantize)
    data = prepare_lm_data(args.data or recipe.get("data"), tokenizer=tokenizer,
                           val_path=None if args.data else recipe.get("val_data"),
                           text_field=recipe.get("text_field") or "text")
    batch_size = args.batch_size or 16
    windows = (len(data.val_tokens) - 1) // model.config.block_size  # validation_loss's batches hold no more
    check_evaluation_memory(model, max(1, min(batch_size, windows)))
    loss, count = validation_loss(model, data.val_tokens, model.config.block_size, batch_size)
    return {"val_loss": loss, "perplexity": math.exp(loss), "tokens": count}


def export(model: nn.Module, directory: Path, tokenizer: Any) -> None:
    save_hf(model, directory, tokenizer=tokenizer)  # type: ignore[arg-type]  # a GPT, as its family says


def export_gguf(model: nn.Module, path: Path, tokenizer: Any, dtype: str) -> None:
    save_gguf(model, path, tokenizer=tokenizer, dtype=dtype)  # type: ignore[arg-type]  # a GPT, as above


GPT_FAMILY = Family(
    name="gpt", model=GPT, config=GPTConfig, data_fields=("vocab_size",),
    options=("data", "val_data", "text_field", "tokenizer", "vocab_size", "threads", *FINE_TUNING_OPTIONS),
    train=train, evaluate=evaluate, eval_options=("data", "dtype", "quantize"), finetune_fields=("dropout",),
    from_base=from_base, export=export, gguf=export_gguf, positions="block_size")
