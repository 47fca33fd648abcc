"""`plainformer translate`: translate sentences with a trained encoder-decoder; stdout holds the
translations, one per line, and nothing else."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..families.transformer import check_beam, load_translator
from ..inference.linear_kernels import measure_kernels
from . import (
    add_max_memory_argument,
    add_product_arguments,
    add_threads_argument,
    non_negative_number,
    positive_int,
    set_threads,
    stdin_lines,
)

BATCH_SIZE = 64  # sentences translated at once


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "translate", help="translate sentences with a trained encoder-decoder",
        description="Translate TEXT, or each line of stdin when TEXT is absent; stdout holds the "
                    "translations, one per line, and nothing else (metrics: stderr, or --json).")
    parser.add_argument("text", nargs="?", metavar="TEXT", help="a sentence (default: read stdin)")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/), a checkpoint directory, or a Marian "
                             "directory (transformers' MarianMTModel, an opus-mt model)")
    parser.add_argument("--beam", type=positive_int, default=1, help="beam size; 1 = greedy (default: 1)")
    parser.add_argument("--length-penalty", type=non_negative_number, default=0.6, help="α (default: 0.6)")
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    add_product_arguments(parser)
    parser.set_defaults(run=run_translate)


def run_translate(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    model = load_translator(args.ckpt)
    measure_kernels(model)  # decoding's few-row products on the kernel measured fastest here
    lines = [args.text] if args.text is not None else stdin_lines()
    check_beam(model, args.beam, lines, BATCH_SIZE)
    start = time.perf_counter()
    translations = model.translate(lines, beam_size=args.beam, length_penalty=args.length_penalty,
                                   batch_size=BATCH_SIZE)
    elapsed = time.perf_counter() - start
    for translation in translations:
        sys.stdout.write(translation + "\n")
    return {"sentences": len(lines), "beam": args.beam, "elapsed_s": elapsed}
