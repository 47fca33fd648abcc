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
from ..data.prepared import prepare_lm_data
from ..log import log
from . import fraction, positive_int

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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(run=run_prepare)


def run_prepare(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    data = prepare_lm_data(args.data, tokenizer=args.tokenizer,
                           vocab_size=args.bpe_vocab_size if args.tokenizer == "bpe" else None,
                           cache_dir=args.cache_dir, val_fraction=args.val_fraction, val_path=args.val_data,
                           text_field=args.text_field, progress=not args.no_progress, log=log)
    return {**data.stats.to_dict(), "tokenizer": data.tokenizer.kind, "vocab_size": data.tokenizer.vocab_size,
            "cache": str(data.directory), "seconds": round(time.perf_counter() - start, 3)}
