"""`plainformer train | sample | eval`: the GPT language model on the bundled corpus or any text."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.lm import LMBatchSource, prepare_lm_data
from ..generation.decoding import iter_generate
from ..io.checkpoint import load_checkpoint
from ..models.gpt import GPT, GPTConfig
from ..training.config import TrainConfig
from ..training.trainer import Trainer
from . import UserError, add_config_arguments, checkpoint_dir, config_overrides, log

TOKENIZERS = ("char", "bpe")


def register(subcommands: argparse._SubParsersAction) -> None:
    _register_train(subcommands)
    _register_sample(subcommands)
    _register_eval(subcommands)


# ----------------------------------------------------------------------------- train

def _register_train(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "train", help="train a GPT language model",
        description="Train a GPT on the bundled Shakespeare corpus (or --data). With no arguments: "
                    "the `default` preset, about 5 minutes on 2 cores, into ./runs/default. Every "
                    "GPTConfig and TrainConfig field is an option; given ones override the preset.")
    parser.add_argument("--preset", default="default", choices=GPTConfig.preset_names(),
                        help="model shape and training recipe (default: %(default)s)")
    parser.add_argument("--data", type=Path, help="UTF-8 text file (default: bundled Shakespeare)")
    parser.add_argument("--out", type=Path, help="run directory (default: runs/PRESET)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last exactly")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, help="char (default) or byte-level bpe")
    parser.add_argument("--bpe-vocab-size", type=int, default=2048, help="BPE vocabulary (default: 2048)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_config_arguments(parser, GPTConfig, skip=("vocab_size",), title="model (GPTConfig)")
    add_config_arguments(parser, TrainConfig, title="training (TrainConfig)")
    parser.set_defaults(run=run_train)


def _training_preset(preset: str) -> dict[str, Any]:
    return dict(TrainConfig.PRESETS.get(preset, {}))


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path("runs") / args.preset
    model_overrides = config_overrides(args, GPTConfig)
    train_overrides = config_overrides(args, TrainConfig)
    if args.resume:
        checkpoint = load_checkpoint(out / "last")
        model_config = GPTConfig.from_dict(checkpoint.model_config)
        changed = sorted(k for k, v in model_overrides.items() if getattr(model_config, k) != v)
        if changed:
            raise UserError(f"--resume continues the saved model, whose {', '.join(changed)} differ "
                            "from the options given; drop those options")
        train_config = TrainConfig.from_dict({**checkpoint.train_config, **train_overrides})
        data = prepare_lm_data(args.data, tokenizer=checkpoint.load_tokenizer())
    else:
        # Both configs are validated before the data is prepared, so a bad option fails at once.
        model_config = GPTConfig.from_preset(args.preset, **model_overrides)
        train_config = TrainConfig.from_dict({**_training_preset(args.preset), **train_overrides})
        kind = args.tokenizer or "char"
        data = prepare_lm_data(args.data, tokenizer=kind,
                               vocab_size=args.bpe_vocab_size if kind == "bpe" else None)
        model_config = model_config.replace(vocab_size=data.tokenizer.vocab_size)
    source = LMBatchSource(data.train_tokens, data.val_tokens, model_config.block_size,
                           seed=train_config.seed)
    log(f"data: {len(data.train_tokens):,} train / {len(data.val_tokens):,} validation tokens, "
        f"{data.tokenizer.kind} tokenizer of {data.tokenizer.vocab_size} tokens")
    torch.manual_seed(train_config.seed)
    model = GPT(model_config)
    log(f"model: GPT {args.preset}, {model.num_parameters():,} parameters -> {out}")
    trainer = Trainer(model, source, train_config, out, tokenizer=data.tokenizer, resume=args.resume,
                      progress=not args.no_progress)
    metrics = trainer.fit()
    log(f"checkpoints in {out}/last and {out}/best; sample with: plainformer sample --ckpt {out}")
    return {**metrics, "parameters": model.num_parameters(), "out": str(out)}


# ----------------------------------------------------------------------------- loading

def _load_model(path: Path, dtype: str) -> GPT:
    model = GPT.from_checkpoint(checkpoint_dir(path))
    return model.to(torch.bfloat16) if dtype == "bfloat16" else model


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="checkpoint directory, or a run directory (its best/ or last/)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights' dtype for inference (bfloat16 halves the bytes read per token)")


# ----------------------------------------------------------------------------- sample

def _register_sample(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("sample", help="stream text from a trained GPT",
                                    description="Stream sampled text to stdout; the same seed gives "
                                                "the same text. Ends with one JSON line of metrics.")
    _add_checkpoint_arguments(parser)
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--no-cache", action="store_true", help="recompute the context at each step")
    parser.set_defaults(run=run_sample)


def run_sample(args: argparse.Namespace) -> dict[str, Any]:
    model = _load_model(args.ckpt, args.dtype)
    tokenizer = model.tokenizer
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

def _register_eval(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("eval", help="validation loss and perplexity of a trained GPT",
                                    description="Mean next-token loss over the whole validation split "
                                                "of --data (default: the bundled corpus), in "
                                                "consecutive windows of block_size tokens.")
    _add_checkpoint_arguments(parser)
    parser.add_argument("--data", type=Path, help="UTF-8 text file (default: bundled Shakespeare)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.set_defaults(run=run_eval)


def validation_loss(model: GPT, tokens: np.ndarray, batch_size: int) -> tuple[float, int]:
    """Mean cross entropy over every token of `tokens` after the first, predicted in consecutive
    windows of block_size (each window starts its context afresh). Returns (loss, tokens scored)."""
    block = model.config.block_size
    n_full = (len(tokens) - 1) // block
    full = np.asarray(tokens[:n_full * block + 1], dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(full, block + 1)[::block]  # (n_full, T + 1)
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, n_full, batch_size):
            total, count = _add_window_losses(model, windows[i:i + batch_size], total, count)
        tail = np.asarray(tokens[n_full * block:], dtype=np.int64)
        if len(tail) > 1:
            total, count = _add_window_losses(model, tail[None], total, count)
    return total / count, count


def _add_window_losses(model: GPT, windows: np.ndarray, total: float, count: int) -> tuple[float, int]:
    batch = torch.from_numpy(np.ascontiguousarray(windows))  # (B, T + 1)
    logits, _ = model(batch[:, :-1])
    losses = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(),
                                               reduction="sum")
    return total + float(losses), count + batch[:, 1:].numel()


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    model = _load_model(args.ckpt, args.dtype)
    data = prepare_lm_data(args.data, tokenizer=model.tokenizer)
    loss, count = validation_loss(model, data.val_tokens, args.batch_size)
    return {"val_loss": loss, "perplexity": math.exp(loss), "tokens": count}
