"""`plainformer prepare`: read, split, tokenize and encode a corpus once, to train on it many times.

The preparation is the one `train --data` does (`data.prepared.prepare_lm_data`), streamed and cached:
a later `train` with the same data and tokenizer starts at once. Ends with one JSON line of its
statistics on stdout; the split's log and a progress bar go to stderr.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..data.corpus import VAL_FRACTION
from ..data.parallel import prepare_parallel_data
from ..data.prepared import prepare_lm_data
from ..families.transformer import DEFAULT_VOCAB
from ..log import log
from . import UserError, fraction, positive_int

TOKENIZERS = ("char", "bpe")


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "prepare", help="prepare a corpus for training (split, tokenizer, token arrays)",
        description="Read --data (a text file, .gz, a folder of *.txt/*.md, a glob, or JSON Lines), hold "
                    "out validation, build the tokenizer and write the token arrays into the cache, "
                    "streaming: memory stays bounded whatever the corpus size.")
    parser.add_argument("--data", help="text file (documents between two blank lines), .gz, folder, glob "
                                       "or .jsonl[.gz] (default: bundled Shakespeare)")
    parser.add_argument("--val-data", help="held-out validation data, in any form --data takes "
                                           "(default: the end of --data)")
    parser.add_argument("--text-field", default="text", help="JSON Lines field holding the text "
                                                             "(default: %(default)s)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="char", help="char (default) or byte-level bpe")
    parser.add_argument("--bpe-vocab-size", type=positive_int, default=2048, help="BPE vocabulary (default: 2048)")
    parser.add_argument("--val-fraction", type=fraction, default=VAL_FRACTION,
                        help="share of the characters held out (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, help="default: $PLAINFORMER_CACHE or ~/.cache/plainformer")
    parallel = parser.add_argument_group(
        "translation: parallel data", "--data PREFIX of PREFIX.SRC and PREFIX.TGT, plain or .gz, a two-column .tsv "
        "or a .jsonl of {\"translation\": {SRC: ..., TGT: ...}}; --val-data in the same forms")
    parallel.add_argument("--source-lang", metavar="LANG", help="the source language (de): prepares parallel data")
    parallel.add_argument("--target-lang", metavar="LANG", help="the target language (en)")
    parallel.add_argument("--vocab-size", type=positive_int, default=DEFAULT_VOCAB,
                          help="SentencePiece pieces shared by both languages (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(run=run_prepare)


def run_prepare(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    if args.source_lang is not None or args.target_lang is not None:
        return _prepare_parallel(args, start)
    data = prepare_lm_data(args.data, tokenizer=args.tokenizer,
                           vocab_size=args.bpe_vocab_size if args.tokenizer == "bpe" else None,
                           cache_dir=args.cache_dir, val_fraction=args.val_fraction, val_path=args.val_data,
                           text_field=args.text_field, progress=not args.no_progress, log=log)
    return {**data.stats.to_dict(), "tokenizer": data.tokenizer.kind, "vocab_size": data.tokenizer.vocab_size,
            "cache": str(data.directory), "seconds": round(time.perf_counter() - start, 3)}


def _prepare_parallel(args: argparse.Namespace, start: float) -> dict[str, Any]:
    """Parallel data, as `train` with a translation recipe prepares it (the same cache entry)."""
    if args.source_lang is None or args.target_lang is None or args.data is None or args.val_data is None:
        raise UserError("parallel data needs --data, --val-data, --source-lang and --target-lang")
    data = prepare_parallel_data(args.data, args.val_data, source_lang=args.source_lang, target_lang=args.target_lang,
                                 vocab_size=args.vocab_size, cache_dir=args.cache_dir,
                                 progress=not args.no_progress, log=log)
    return {"train_pairs": len(data.train), "val_pairs": len(data.val_sources), **data.stats,
            "tokenizer": data.tokenizer.kind, "vocab_size": data.tokenizer.vocab_size, "cache": str(data.directory),
            "seconds": round(time.perf_counter() - start, 3)}
