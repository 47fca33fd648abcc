"""`plainformer eval --ckpt PATH`: evaluate a checkpoint of any family, dispatched on the family its
config.json names; the data options default to those of the run's recipe.yaml."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.format import load_checkpoint
from ..data.seq2seq import TASKS
from ..hf.gpt import is_hf_directory
from . import (
    DTYPE_HELP,
    INFERENCE_DTYPES,
    UserError,
    add_threads_argument,
    non_negative_float,
    positive_int,
    run_and_checkpoint,
    set_threads,
)
from .train import read_run_recipe

Evaluator = Callable[[argparse.Namespace, Path, Path, dict[str, Any]], dict[str, Any]]

# Flag -> the families it applies to (a flag given for another family is an error).
FAMILY_FLAGS: Mapping[str, tuple[str, ...]] = {
    "data": ("gpt", "bert-mlm"), "dtype": ("gpt",), "beam": ("transformer",),
    "length_penalty": ("transformer",), "task": ("transformer",), "split": ("transformer",),
}


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/) or a checkpoint directory")
    parser.add_argument("--batch-size", type=positive_int, help="rows per batch (default: 16 for a GPT, 100 "
                                                       "sentences for an encoder-decoder, the run's for BERT)")
    add_threads_argument(parser)
    gpt = parser.add_argument_group("language models [gpt, bert-mlm]")
    gpt.add_argument("--data", help="text file, .gz, folder, glob or .jsonl[.gz] (default: the run's, else the "
                                   "bundled corpus)")
    gpt.add_argument("--dtype", choices=INFERENCE_DTYPES, help=f"{DTYPE_HELP} (default: float32) [gpt]")
    seq2seq = parser.add_argument_group("encoder-decoder [transformer]")
    seq2seq.add_argument("--beam", type=positive_int, help="beam size; 1 = greedy (default: 1)")
    seq2seq.add_argument("--length-penalty", type=non_negative_float, default=None, help="α (default: 0.6)")
    seq2seq.add_argument("--task", choices=list(TASKS), help="default: the run's recipe.yaml")
    seq2seq.add_argument("--split", choices=("test", "val"), help="default: test")
    parser.set_defaults(run=run_eval)


def register(subcommands: argparse._SubParsersAction) -> None:
    add_eval_arguments(subcommands.add_parser(
        "eval", help="evaluate a checkpoint of any family",
        description="GPT: validation loss and perplexity over the whole validation split. "
                    "Encoder-decoder: BLEU (sacrebleu) and exact match on the task's test split. "
                    "BERT: masked-token loss and accuracy, or classification accuracy, on the "
                    "validation set. Ends with one JSON line of metrics."))


def _evaluators() -> Mapping[str, Evaluator]:
    from . import bert, gpt, seq2seq

    return {"gpt": gpt.evaluate, "transformer": seq2seq.evaluate, "bert-mlm": bert.evaluate_mlm,
            "bert-cls": bert.evaluate_classifier}


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    if is_hf_directory(args.ckpt):  # a Hugging Face language model: evaluated as a GPT, no run recipe
        run_dir, checkpoint, family = args.ckpt, args.ckpt, "gpt"
    else:
        run_dir, checkpoint = run_and_checkpoint(args.ckpt)
        family = load_checkpoint(checkpoint, verify=False).family
    evaluators = _evaluators()
    if family not in evaluators:
        raise UserError(f"{checkpoint} holds a {family!r} model; eval knows {', '.join(evaluators)}")
    for name, families in FAMILY_FLAGS.items():
        if getattr(args, name) is not None and family not in families:
            raise UserError(f"--{name.replace('_', '-')} applies to {', '.join(families)} checkpoints, "
                            f"not to this {family} one")
    if args.length_penalty is None:
        args.length_penalty = 0.6
    return evaluators[family](args, run_dir, checkpoint, read_run_recipe(run_dir))
