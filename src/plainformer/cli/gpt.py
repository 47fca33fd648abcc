"""The GPT language model: its part of `plainformer train` and `plainformer eval`, and
`plainformer sample`, on the bundled corpus or any text."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..data.lm import LMBatchSource, prepare_lm_data
from ..data.tokenizers import Tokenizer
from ..generation.decoding import iter_generate
from ..hf.gpt import is_hf_directory, load_hf
from ..models.gpt import GPT, GPTConfig
from ..training.evaluation import validation_loss
from . import (
    UserError,
    add_dtype_argument,
    add_product_arguments,
    checkpoint_dir,
    log,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    seed_int,
)
from .train import Run, fit

DEFAULT_BPE_VOCAB = 2048


def register(subcommands: argparse._SubParsersAction) -> None:
    _register_sample(subcommands)


# ----------------------------------------------------------------------------- train

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


# ----------------------------------------------------------------------------- loading

def _load_model(path: Path, dtype: str) -> tuple[GPT, Tokenizer]:
    """The GPT of a checkpoint or run directory, or of a Hugging Face GPT-2 / Llama directory, and the
    tokenizer saved with it."""
    model = load_hf(path) if is_hf_directory(path) else GPT.from_checkpoint(checkpoint_dir(path))
    if not isinstance(model, GPT):
        raise UserError(f"{path} holds a {type(model).__name__}, not a language model (GPT-2 or Llama layout)")
    if model.tokenizer is None:
        raise UserError(f"{path} holds no tokenizer, so text cannot be encoded")
    return (model.to(torch.bfloat16) if dtype == "bfloat16" else model), model.tokenizer


# ----------------------------------------------------------------------------- sample

def _register_sample(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("sample", help="stream text from a trained GPT",
                                    description="Stream sampled text to stdout, and only that text; "
                                                "the same seed gives the same text. Metrics go to "
                                                "stderr (or end stdout with --json).")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="checkpoint directory, or a run directory (its best/ or last/)")
    add_dtype_argument(parser)
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=non_negative_int, default=500)
    parser.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=positive_int, default=None)
    parser.add_argument("--top-p", type=probability, default=None)
    parser.add_argument("--seed", type=seed_int, default=1337)
    parser.add_argument("--no-cache", action="store_true", help="recompute the context at each step")
    add_product_arguments(parser)
    parser.set_defaults(run=run_sample)


def run_sample(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = _load_model(args.ckpt, args.dtype)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    if prompt.shape[1] == 0:
        raise UserError("--prompt encodes to no tokens; give at least one character")
    generator = torch.Generator().manual_seed(args.seed)
    sys.stdout.write(args.prompt)
    new_ids: list[int] = []
    printed = ""
    start = time.perf_counter()
    with torch.inference_mode():
        steps = iter_generate(model.decoder(), prompt, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, use_cache=not args.no_cache,
                              generator=generator)
        for tokens, _ in steps:
            new_ids.append(int(tokens[0]))
            text = tokenizer.decode(new_ids)  # whole suffix: a BPE token may end mid-character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    return {"new_tokens": len(new_ids), "tokens_per_s": len(new_ids) / max(elapsed, 1e-9),
            "elapsed_s": elapsed, "seed": args.seed}


# ----------------------------------------------------------------------------- eval

def evaluate(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
             ) -> dict[str, Any]:
    """`plainformer eval` of a GPT: mean next-token loss over the whole validation split of --data
    (default: the run's, else the bundled corpus), in consecutive windows of block_size tokens."""
    model, tokenizer = _load_model(checkpoint, args.dtype)
    data = prepare_lm_data(args.data or recipe.get("data"), tokenizer=tokenizer,
                           val_path=None if args.data else recipe.get("val_data"),
                           text_field=recipe.get("text_field") or "text")
    loss, count = validation_loss(model, data.val_tokens, model.config.block_size, args.batch_size or 16)
    return {"val_loss": loss, "perplexity": math.exp(loss), "tokens": count}
