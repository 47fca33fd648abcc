"""`plainformer search`: the corpus lines most similar to a query by the cosine of their sentence embeddings
(cli/embed.py's encoder), the corpus embeddings cached by the file's and the model's contents."""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..data.lm import default_cache_dir
from ..families.bert import model_location
from ..hf.bert import resolve_bert_path
from ..hf.sentence import SentenceEncoder
from ..log import log
from . import UserError, positive_int, utf8_text
from .embed import DTYPES, add_encoder_arguments, load_encoder, save_npy


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "search", help="the corpus lines most similar to a query",
        description="Rank the non-empty lines of --corpus by cosine similarity of their sentence "
                    "embeddings to QUERY's; prints the top K as `score<TAB>line`. The corpus "
                    "embeddings are cached, keyed by the file's and the model's contents.")
    parser.add_argument("query", metavar="QUERY", help="the text whose nearest lines to find")
    parser.add_argument("--corpus", type=Path, required=True, help="UTF-8 text file, one entry per line")
    parser.add_argument("--k", type=positive_int, default=5, help="how many lines to show (default: 5)")
    parser.add_argument("--cache-dir", type=Path,
                        help="where embeddings are cached (default: the plainformer cache, embeddings/)")
    add_encoder_arguments(parser)
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
    save_npy(cache, matrix)
    return matrix, False


def run_search(args: argparse.Namespace) -> dict[str, Any]:
    lines, raw = _corpus_lines(args.corpus)
    model_dir = resolve_bert_path(model_location(args.model))
    encoder = load_encoder(args.model)
    matrix, cached = corpus_embeddings(encoder, model_dir, lines, raw, args)
    query = encoder.encode(args.query, dtype=DTYPES[args.dtype]).cpu().numpy()
    scores = matrix @ query  # cosine similarities: every row is a unit vector
    top = np.argsort(-scores, kind="stable")[:args.k]
    results = [{"score": float(scores[i]), "line": lines[i]} for i in top]
    for result in results:
        sys.stdout.write(f"{result['score']:.4f}\t{result['line']}\n")
    return {"query": args.query, "results": results, "corpus_lines": len(lines), "cached": cached,
            "model": args.model}
