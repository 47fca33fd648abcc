"""`plainformer eval --ckpt PATH`: evaluate a checkpoint of any family, dispatched on the family its
config.json names; the data options default to those of the run's recipe.yaml."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from .. import families
from ..checkpoint.format import load_checkpoint
from ..data.seq2seq import TASKS
from ..families.family import refuse_non_model, run_and_checkpoint
from ..hf.auto import hf_family
from ..hf.directory import is_hf_directory
from . import (
    DTYPE_HELP,
    INFERENCE_DTYPES,
    QUANTIZE_HELP,
    UserError,
    add_max_memory_argument,
    add_threads_argument,
    non_negative_number,
    positive_int,
    set_threads,
)
from .train import read_run_recipe


def flag_families(name: str) -> tuple[str, ...]:
    """The families whose `eval_options` name the flag `name` (given for another family: an error)."""
    return tuple(f.name for f in families.FAMILIES.values() if name in f.eval_options)


# The flags of some families only (each family's `eval_options` says which apply to it).
EVAL_FLAGS = ("data", "dtype", "quantize", "source_lang", "target_lang", "beam", "length_penalty", "task", "split",
              "text_field", "text_pair_field", "label_field")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/) or a checkpoint directory")
    parser.add_argument("--batch-size", type=positive_int, help="rows per batch (default: 16 for a GPT, 100 "
                                                       "sentences for an encoder-decoder, the run's for BERT)")
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    gpt = parser.add_argument_group(f"language models [{', '.join(flag_families('data'))}]")
    gpt.add_argument("--data", help="text file, .gz, folder, glob or .jsonl[.gz] (default: the run's, else the "
                                   "bundled corpus); encoder-decoder: the pairs to score, in any form train's "
                                   "--data takes (PREFIX of PREFIX.SRC and PREFIX.TGT, .tsv, .jsonl); a "
                                   "classifier's: a labelled .tsv, .csv or .jsonl[.gz] (default: the run's "
                                   "validation set)")
    gpt.add_argument("--dtype", choices=INFERENCE_DTYPES, help=f"{DTYPE_HELP} (default: float32) [gpt]")
    gpt.add_argument("--quantize", choices=("int8",), help=f"{QUANTIZE_HELP} [gpt]")
    classifier = parser.add_argument_group(f"classifiers [{', '.join(flag_families('label_field'))}]")
    classifier.add_argument("--text-field", metavar="NAME", help="--data's text field (default: the run's, else "
                                                                  "sentence or text)")
    classifier.add_argument("--text-pair-field", metavar="NAME",
                            help="--data's second text, for sentence pairs (default: the run's)")
    classifier.add_argument("--label-field", metavar="NAME", help="--data's label field (default: the run's, "
                                                                   "else label)")
    seq2seq = parser.add_argument_group(f"encoder-decoder [{', '.join(flag_families('beam'))}]")
    seq2seq.add_argument("--source-lang", metavar="LANG", help="the source language of --data (default: the run's)")
    seq2seq.add_argument("--target-lang", metavar="LANG", help="the target language of --data (default: the run's)")
    seq2seq.add_argument("--beam", type=positive_int, help="beam size; 1 = greedy (default: 1)")
    seq2seq.add_argument("--length-penalty", type=non_negative_number, default=None, help="α (default: 0.6)")
    seq2seq.add_argument("--task", choices=list(TASKS), help="default: the run's recipe.yaml")
    seq2seq.add_argument("--split", choices=("test", "val"), help="default: test")
    parser.set_defaults(run=run_eval)


def register(subcommands: argparse._SubParsersAction) -> None:
    add_eval_arguments(subcommands.add_parser(
        "eval", help="evaluate a checkpoint of any family",
        description="GPT: validation loss and perplexity over the whole validation split. "
                    "Encoder-decoder: BLEU (sacrebleu) and exact match on the task's test split. "
                    "BERT: masked-token loss and accuracy on the validation set. A classifier: accuracy, "
                    "macro-F1, Matthews correlation and the confusion matrix on --data or the run's validation "
                    "set (the matrix also as RUN/confusion_DATA.png). Ends with one JSON line of metrics."))


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    if is_hf_directory(args.ckpt):  # a Hugging Face model: a classifier, a translator (Marian), else evaluated
        run_dir, checkpoint = args.ckpt, args.ckpt  # as a GPT; no run recipe
        family = hf_family(args.ckpt)
        family = family if family in ("bert-cls", "transformer") else "gpt"
    else:
        run_dir, checkpoint = run_and_checkpoint(args.ckpt)
        refuse_non_model(checkpoint)
        family = load_checkpoint(checkpoint, verify=False).family
    evaluated = {f.name: f.evaluate for f in families.FAMILIES.values() if f.evaluate is not None}
    if family not in evaluated:
        raise UserError(f"{checkpoint} holds a {family!r} model; eval knows {', '.join(evaluated)}")
    for name in EVAL_FLAGS:
        if getattr(args, name) is not None and name not in families.get(family).eval_options:
            raise UserError(f"--{name.replace('_', '-')} applies to {', '.join(flag_families(name))} checkpoints, "
                            f"not to this {family} one")
    if args.length_penalty is None:
        args.length_penalty = 0.6
    metrics = evaluated[family](args, run_dir, checkpoint, read_run_recipe(run_dir))
    non_finite = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if non_finite:
        raise UserError(f"{checkpoint} gives a non-finite {', '.join(non_finite)} (NaN or inf): its weights or "
                        "its outputs are not finite numbers")
    return metrics
