"""The GPT language model family: trained on a text corpus through its tokenizer (char or byte-level
BPE), evaluated by its next-token loss over a whole validation split, exported in the GPT-2 or Llama
layout of Hugging Face."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.lm import LMBatchSource
from ..data.prepared import prepare_lm_data
from ..data.tokenizers import Tokenizer
from ..errors import UserError
from ..hf.gpt import is_hf_directory, load_hf, save_hf
from ..models.gpt import GPT, GPTConfig
from ..training.distributed import log
from ..training.evaluation import validation_loss
from .family import Family, Run, fit

DEFAULT_BPE_VOCAB = 2048


def train(run: Run) -> dict[str, Any]:
    """`plainformer train` for a GPT recipe: the data of options["data"] through its tokenizer."""
    options = run.options
    sources: dict[str, Any] = dict(val_path=options.get("val_data"),
                                   text_field=options.get("text_field") or "text", progress=run.progress,
                                   log=log)
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
    source = LMBatchSource(data.train_tokens, data.val_tokens, model_config.block_size,
                           seed=run.train.seed)
    log(f"data: {len(data.train_tokens):,} train / {len(data.val_tokens):,} validation tokens, "
        f"{data.tokenizer.kind} tokenizer of {data.tokenizer.vocab_size} tokens")
    torch.manual_seed(run.train.seed)
    model = GPT(model_config)
    log(f"model: GPT {run.preset}, {model.num_parameters():,} parameters -> {run.out}")
    metrics = fit(run, model, source, data.tokenizer)
    log(f"checkpoints in {run.out}/last and {run.out}/best; sample with: plainformer sample --ckpt {run.out}")
    return {**metrics, "parameters": model.num_parameters(), "out": str(run.out)}


def load_language_model(path: Path, dtype: str = "float32") -> tuple[GPT, Tokenizer]:
    """The GPT of a checkpoint directory, or of a Hugging Face GPT-2 / Llama directory, and the
    tokenizer saved with it, in `dtype` ("float32" or "bfloat16")."""
    model = load_hf(path) if is_hf_directory(path) else GPT.from_checkpoint(path)
    if not isinstance(model, GPT):
        raise UserError(f"{path} holds a {type(model).__name__}, not a language model (GPT-2 or Llama layout)")
    if model.tokenizer is None:
        raise UserError(f"{path} holds no tokenizer, so text cannot be encoded")
    return (model.to(torch.bfloat16) if dtype == "bfloat16" else model), model.tokenizer


def evaluate(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
             ) -> dict[str, Any]:
    """`plainformer eval` of a GPT: mean next-token loss over the whole validation split of --data
    (default: the run's, else the bundled corpus), in consecutive windows of block_size tokens."""
    model, tokenizer = load_language_model(checkpoint, args.dtype or "float32")
    data = prepare_lm_data(args.data or recipe.get("data"), tokenizer=tokenizer,
                           val_path=None if args.data else recipe.get("val_data"),
                           text_field=recipe.get("text_field") or "text")
    loss, count = validation_loss(model, data.val_tokens, model.config.block_size, args.batch_size or 16)
    return {"val_loss": loss, "perplexity": math.exp(loss), "tokens": count}


def export(model: nn.Module, directory: Path, tokenizer: Any) -> None:
    save_hf(model, directory, tokenizer=tokenizer)  # type: ignore[arg-type]  # a GPT, as its family says


GPT_FAMILY = Family(
    name="gpt", model=GPT, config=GPTConfig, data_fields=("vocab_size",),
    options=("data", "val_data", "text_field", "tokenizer", "vocab_size", "threads"),
    train=train, evaluate=evaluate, eval_options=("data", "dtype"), export=export, positions="block_size")
