"""The encoder-decoder Transformer on the built-in tasks (`plainformer.data.seq2seq`): its part of
`plainformer train` and `plainformer eval`, `plainformer translate`, and the older spellings
`plainformer seq2seq train | eval`.

A run directory's recipe.yaml names the task whose test split `eval` scores (BLEU with sacrebleu,
and exact match of whole sentences).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..data.seq2seq import TASKS, Seq2SeqBatches, make_task, train_tokenizer
from ..models.transformer import Transformer, TransformerConfig
from ..training.evaluation import score_translations
from . import (
    UserError,
    add_group,
    add_product_arguments,
    add_threads_argument,
    log,
    non_negative_float,
    positive_int,
    run_and_checkpoint,
    set_threads,
    stdin_lines,
)
from .train import Run, add_train_arguments, fit

DEFAULT_TASK = "numbers-en-fr"
LEGACY_TASK_FILE = "task.json"  # what run directories held before recipe.yaml


def register(subcommands: argparse._SubParsersAction) -> None:
    commands = add_group(subcommands, "seq2seq", help="older spelling of train/eval for the encoder-decoder",
                         description="`seq2seq train` is `train --preset seq2seq-TASK` and `seq2seq eval` "
                                     "is `eval`: kept for scripts written before one CLI shape.")
    legacy = commands.add_parser("train", help="= plainformer train --preset seq2seq-TASK")
    add_train_arguments(legacy, default_preset=f"seq2seq-{DEFAULT_TASK}", families=("transformer",))
    legacy.set_defaults(run=_run_legacy_train)
    from .evaluate import add_eval_arguments

    add_eval_arguments(commands.add_parser("eval", help="= plainformer eval"))
    _register_translate(subcommands)


def _run_legacy_train(args: argparse.Namespace) -> dict[str, Any]:
    from .train import run_train

    if args.preset is None and args.task is not None:
        args.preset = f"seq2seq-{args.task}"
    return run_train(args, f"seq2seq-{DEFAULT_TASK}", ("transformer",))


# ----------------------------------------------------------------------------- train

def train(run: Run) -> dict[str, Any]:
    """`plainformer train` for an encoder-decoder recipe: train on options["task"], then translate
    its test split greedily and report BLEU and exact match."""
    task_name = run.options["task"]
    start = time.perf_counter()
    task = make_task(task_name)
    tokenizer = run.checkpoint.load_tokenizer() if run.checkpoint is not None else train_tokenizer(task)
    source = Seq2SeqBatches(task, tokenizer, seed=run.train.seed)
    log(f"task {task_name}: {', '.join(f'{len(p):,} {s}' for s, p in task.pairs.items())} pairs, "
        f"BPE vocabulary of {tokenizer.vocab_size} tokens ({time.perf_counter() - start:.1f} s)")
    model_config = run.model_config(TransformerConfig)
    if not run.resume:
        model_config = model_config.replace(
            src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
            pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    torch.manual_seed(run.train.seed)
    model = Transformer(model_config)
    log(f"model: Transformer, {model.num_parameters():,} parameters, {torch.get_num_threads()} "
        f"thread(s) -> {run.out}")
    metrics = fit(run, model, source, tokenizer)
    best = Transformer.from_checkpoint(run.out / "best")
    scores = score_translations(best, task.sources("test"), task.targets("test"), beam_size=1,
                                tokenize=task.bleu_tokenize)
    log(f"test split, greedy: BLEU {scores['bleu']:.2f}, exact match {scores['exact_match']:.2%}; "
        f"evaluate with: plainformer eval --ckpt {run.out} --beam 4")
    return {**metrics, **{f"test_{k}": v for k, v in scores.items()}, "task": task_name,
            "parameters": model.num_parameters(), "out": str(run.out)}


# ----------------------------------------------------------------------------- eval

def _run_task(run_dir: Path, recipe: dict[str, Any]) -> str:
    if "task" in recipe:
        return recipe["task"]
    legacy = run_dir / LEGACY_TASK_FILE
    if legacy.is_file():
        return _read_legacy_task(legacy)
    raise UserError(f"{run_dir} has no recipe.yaml naming the task: pass --task to say which task's "
                    "split to score")


def _read_legacy_task(path: Path) -> str:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON: {error}") from None
    task = values.get("task") if isinstance(values, dict) else None
    if not isinstance(task, str) or task not in TASKS:
        raise UserError(f"{path} must hold an object whose 'task' is one of {', '.join(TASKS)}, got "
                        f"{json.dumps(values)[:80]}")
    return task


def evaluate(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
             ) -> dict[str, Any]:
    """`plainformer eval` of an encoder-decoder: BLEU and exact match on a split of the run's task."""
    model = Transformer.from_checkpoint(checkpoint)
    task_name = args.task or _run_task(run_dir, recipe)
    task = make_task(task_name)
    beam = args.beam or 1
    split = args.split or "test"
    scores = score_translations(model, task.sources(split), task.targets(split), beam_size=beam,
                                length_penalty=args.length_penalty, batch_size=args.batch_size or 100,
                                tokenize=task.bleu_tokenize)
    log(f"{task_name} {split} split, beam {beam}: BLEU {scores['bleu']:.2f}, "
        f"exact match {scores['exact_match']:.2%}")
    return {**scores, "task": task_name, "split": split, "checkpoint": str(checkpoint)}


# ----------------------------------------------------------------------------- translate

def _register_translate(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "translate", help="translate sentences with a trained encoder-decoder",
        description="Translate TEXT, or each line of stdin when TEXT is absent; stdout holds the "
                    "translations, one per line, and nothing else (metrics: stderr, or --json).")
    parser.add_argument("text", nargs="?", metavar="TEXT", help="a sentence (default: read stdin)")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/) or a checkpoint directory")
    parser.add_argument("--beam", type=positive_int, default=1, help="beam size; 1 = greedy (default: 1)")
    parser.add_argument("--length-penalty", type=non_negative_float, default=0.6, help="α (default: 0.6)")
    add_threads_argument(parser)
    add_product_arguments(parser)
    parser.set_defaults(run=run_translate)


def run_translate(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    model = Transformer.from_checkpoint(run_and_checkpoint(args.ckpt)[1])
    lines = [args.text] if args.text is not None else stdin_lines()
    start = time.perf_counter()
    translations = model.translate(lines, beam_size=args.beam, length_penalty=args.length_penalty)
    elapsed = time.perf_counter() - start
    for translation in translations:
        sys.stdout.write(translation + "\n")
    return {"sentences": len(lines), "beam": args.beam, "elapsed_s": elapsed}

