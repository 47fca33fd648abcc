"""`plainformer classify`: label texts with a trained classifier, a run of `finetune` or a Hugging Face
BertForSequenceClassification directory; stdout holds one line per text, in input order, and nothing else.

    plainformer classify --ckpt runs/sst2 "a gripping , funny film"     1<TAB>0.9873
    plainformer classify --ckpt runs/sst2 --input texts.txt --json      {"label": "1", "probability": ...,
                                                                         "probabilities": {"0": ..., "1": ...}}

The texts are TEXT, else the lines of --input, else those of stdin; a line with a tab is a sentence pair
(before and after the first tab). They are batched by length and printed in input order, with a progress
bar on stderr for a long input; the metrics go to stderr as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..families.classifier import DEFAULT_EVAL_BATCH_SIZE, class_probabilities, load_classifier
from ..families.family import run_and_checkpoint
from ..families.memory_estimates import check_evaluation_memory
from ..hf.directory import is_hf_directory
from . import CKPT_HELP, UserError, add_max_memory_argument, add_threads_argument, positive_int, set_threads, utf8_text
from .train import read_run_recipe

#: Inputs of at least this many batches show a progress bar.
PROGRESS_BATCHES = 20


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "classify", help="label texts (or sentence pairs) with a trained classifier",
        description="Label each TEXT, else each line of --input, else each line of stdin (a line with a tab: "
                    "a sentence pair). Prints the label and its probability per line, in input order, or with "
                    "--json one object per line with every class's probability. Metrics go to stderr.")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="a text to label; a tab in it makes a sentence pair "
                                                                 "(default: --input, else stdin)")
    parser.add_argument("--ckpt", type=Path, required=True, help=CKPT_HELP)
    parser.add_argument("--input", type=Path, metavar="FILE", help="a UTF-8 file, one text (or tab-separated "
                                                                  "pair) per line (default: stdin)")
    parser.add_argument("--json", dest="json_lines", action="store_true",
                        help='one JSON object per line: {"label", "probability", "probabilities": {class: p}}')
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULT_EVAL_BATCH_SIZE,
                        help="texts per batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, metavar="INT",
                        help="tokens per text, the rest cut off (default: the run's seq_len, else the model's max_len)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    parser.set_defaults(run=run_classify, product=True, json=False)  # the metrics: always stderr


def read_texts(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """(texts, pairs or None): TEXT, the lines of --input or of stdin; a tab splits a line into a pair."""
    if args.texts and args.input is not None:
        raise UserError("give TEXT or --input FILE, not both")
    if args.texts:
        lines = list(args.texts)
    elif args.input is not None:
        if not args.input.is_file():
            raise UserError(f"--input {args.input}: no such file")
        lines = utf8_text(args.input.read_bytes(), str(args.input)).splitlines()
    else:
        lines = utf8_text(sys.stdin.buffer.read(), "standard input").splitlines()
    if not lines:
        raise UserError("no text to classify: give TEXT, --input FILE or lines on stdin")
    split = [line.split("\t", 1) for line in lines]
    pairs = [len(parts) == 2 for parts in split]
    if any(pairs) and not all(pairs):
        other = pairs.index(not pairs[0])
        kinds = ("a single text", "a tab-separated pair")
        raise UserError(f"line 1 is {kinds[pairs[0]]}, line {other + 1} {kinds[pairs[other]]}: give every line "
                        "as a pair, or none")
    if all(pairs):
        return [parts[0] for parts in split], [parts[1] for parts in split]
    return lines, None


def run_classify(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    texts, pairs = read_texts(args)
    if not args.ckpt.exists():
        raise UserError(f"--ckpt {args.ckpt} does not exist")
    if is_hf_directory(args.ckpt):
        checkpoint, recipe = args.ckpt, {}
    else:
        run_dir, checkpoint = run_and_checkpoint(args.ckpt)
        recipe = read_run_recipe(run_dir)
    model = load_classifier(checkpoint)
    seq_len = args.seq_len or recipe.get("seq_len") or model.config.max_len
    check_evaluation_memory(model, args.batch_size, seq_len)
    start = time.perf_counter()
    long_input = len(texts) >= PROGRESS_BATCHES * args.batch_size
    probabilities = class_probabilities(model, texts, pairs, batch_size=args.batch_size, max_len=seq_len,
                                        progress=long_input and not args.no_progress)
    elapsed = time.perf_counter() - start
    classes = model.config.class_names()
    best, chosen = probabilities.max(dim=-1)
    lines = []
    for row, (p, label) in enumerate(zip(best.tolist(), chosen.tolist(), strict=True)):
        if args.json_lines:
            every = dict(zip(classes, probabilities[row].tolist(), strict=True))
            lines.append(json.dumps({"label": classes[label], "probability": p, "probabilities": every}))
        else:
            lines.append(f"{classes[label]}\t{p:.4f}")
    sys.stdout.write("\n".join(lines) + "\n")
    return {"texts": len(texts), "pairs": pairs is not None, "classes": list(classes), "seq_len": seq_len,
            "elapsed_s": elapsed, "texts_per_s": len(texts) / max(elapsed, 1e-9)}
