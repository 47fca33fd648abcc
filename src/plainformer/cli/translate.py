"""`plainformer translate`: translate sentences with a trained encoder-decoder; stdout holds the
translations, one per line in the input's order, and nothing else."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..families.transformer import check_beam, load_translator
from ..inference.linear_kernels import measure_kernels
from . import (
    UserError,
    add_max_memory_argument,
    add_product_arguments,
    add_threads_argument,
    non_negative_number,
    positive_int,
    set_threads,
    stdin_lines,
    utf8_text,
)

BATCH_SIZE = 64  # sentences translated at once


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "translate", help="translate sentences with a trained encoder-decoder",
        description="Translate TEXT, or each line of --input FILE, or of stdin when neither is given; sentences "
                    "of similar length are translated together, and stdout holds the translations, one per line "
                    "in the input's order, and nothing else (progress and metrics: stderr, or --json).")
    parser.add_argument("text", nargs="?", metavar="TEXT", help="a sentence (default: --input, else stdin)")
    parser.add_argument("--input", type=Path, metavar="FILE", help="a UTF-8 file of sentences, one a line")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/), a checkpoint directory, or a Marian "
                             "directory (transformers' MarianMTModel, an opus-mt model)")
    parser.add_argument("--beam", type=positive_int, default=4,
                        help="beam size; 1 = greedy (default: 4, the paper's)")
    parser.add_argument("--length-penalty", type=non_negative_number, default=0.6,
                        help="α of GNMT's length penalty ((5 + |Y|) / 6)^α (default: 0.6)")
    parser.add_argument("--batch-size", type=positive_int, default=BATCH_SIZE,
                        help="sentences translated at once (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    add_product_arguments(parser)
    parser.set_defaults(run=run_translate)


def input_lines(args: argparse.Namespace) -> list[str]:
    """TEXT, the lines of --input, or those of stdin."""
    if args.text is not None and args.input is not None:
        raise UserError("give TEXT or --input FILE, not both")
    if args.text is not None:
        return [args.text]
    if args.input is not None:
        if not args.input.is_file():
            raise UserError(f"--input {args.input} is not a file")
        return utf8_text(args.input.read_bytes(), f"--input {args.input}").splitlines()
    return stdin_lines()


def run_translate(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    model = load_translator(args.ckpt)
    lines = input_lines(args)
    measure_kernels(model)  # decoding's few-row products on the kernel measured fastest here
    check_beam(model, args.beam, lines, args.batch_size)
    start = time.perf_counter()
    with tqdm(total=len(lines), unit=" sentences", file=sys.stderr, leave=False, mininterval=0.5,
              disable=args.no_progress or len(lines) <= args.batch_size) as bar:
        translations = model.translate(lines, beam_size=args.beam, length_penalty=args.length_penalty,
                                       batch_size=args.batch_size, progress=bar.update)
    elapsed = time.perf_counter() - start
    for translation in translations:
        sys.stdout.write(translation + "\n")
    return {"sentences": len(lines), "beam": args.beam, "elapsed_s": elapsed,
            "sentences_per_s": len(lines) / max(elapsed, 1e-9)}
