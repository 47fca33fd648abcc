"""`plainformer sample`: stream text from a trained GPT (a checkpoint, a run, or a Hugging Face GPT-2 /
Llama directory) to stdout, and only that text."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..families.family import checkpoint_dir
from ..families.gpt import load_language_model
from ..generation.decoding import iter_generate
from ..nn.lora import unload_lora
from . import (
    UserError,
    add_dtype_argument,
    add_product_arguments,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    seed_int,
)


def register(subcommands: argparse._SubParsersAction) -> None:
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
    model, tokenizer = load_language_model(checkpoint_dir(args.ckpt), args.dtype)
    unload_lora(model)  # a LoRA run's adapter merged: decoding then costs what the base's does
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
