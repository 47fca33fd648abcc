"""`plainformer seq2seq train | eval` and `plainformer translate`: the encoder-decoder Transformer on
the built-in tasks (`plainformer.data.seq2seq`).

A run directory holds the trainer's last/ and best/ checkpoints and `task.json`, naming the task whose
test split `seq2seq eval` scores (BLEU with sacrebleu, and exact match of whole sentences).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..data.seq2seq import TASKS, Seq2SeqBatches, make_task, train_tokenizer
from ..io.checkpoint import load_checkpoint
from ..models.transformer import Transformer, TransformerConfig
from ..training.config import TrainConfig
from ..training.trainer import Trainer
from . import UserError, add_config_arguments, checkpoint_dir, config_overrides, log

DEFAULT_TASK = "numbers-en-fr"
TASK_FILE = "task.json"

# The paper's optimiser and schedule (section 5.3), warmup scaled down to runs of minutes.
_PAPER_TRAINING = dict(schedule="inverse_sqrt", lr=1.0, beta1=0.9, beta2=0.98, eps=1e-9,
                       weight_decay=0.0, grad_clip=0.0, eval_batches=8, log_interval=50)
# Per task: model preset, training, threads. The small models run faster on one thread than on two
# cores shared with other work (intra-op parallelism cannot pay for its synchronisation on ops this
# small); pass --threads to change it. Chosen by experiment: see benchmarks/seq2seq.py.
_SYMBOL_TASK = dict(preset="tiny", threads=1, train=dict(
    schedule="cosine", lr=7e-3, min_lr=1e-4, warmup_steps=50, max_steps=900, batch_size=64,
    beta1=0.9, beta2=0.98, eps=1e-9, weight_decay=0.0, grad_clip=0.0, eval_interval=0,
    save_interval=0, eval_batches=4, log_interval=50))
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "copy": _SYMBOL_TASK,
    "reverse": _SYMBOL_TASK,
    "numbers-en-fr": dict(preset="small", threads=1, train=dict(
        _PAPER_TRAINING, warmup_steps=400, max_steps=2000, batch_size=64, eval_interval=400,
        save_interval=400)),
}


def register(subcommands: argparse._SubParsersAction) -> None:
    seq2seq = subcommands.add_parser(
        "seq2seq", help="train and evaluate an encoder-decoder Transformer on a built-in task",
        description="The encoder-decoder Transformer of Vaswani et al. 2017 on a task generated "
                    f"offline: {', '.join(TASKS)}.")
    commands = seq2seq.add_subparsers(dest="seq2seq_command", metavar="COMMAND")
    _register_train(commands)
    _register_eval(commands)
    _register_translate(subcommands)


def _add_threads_argument(parser: argparse.ArgumentParser, default_doc: str) -> None:
    parser.add_argument("--threads", type=int, help=f"torch.set_num_threads (default: {default_doc})")


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads <= 0:
            raise UserError(f"--threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- train

def _register_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="train on a task, then score the test split",
        description="Train on a built-in task with the task's default preset and recipe, then "
                    "translate its test split greedily and report BLEU and exact match. Every "
                    "TransformerConfig and TrainConfig field is an option; given ones override.")
    parser.add_argument("--task", default=DEFAULT_TASK, choices=list(TASKS),
                        help="default: %(default)s")
    parser.add_argument("--preset", choices=TransformerConfig.preset_names(),
                        help="model shape (default: the task's: tiny for copy/reverse, small otherwise)")
    parser.add_argument("--out", type=Path, help="run directory (default: runs/seq2seq-TASK)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last exactly")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_threads_argument(parser, "1 for the built-in tasks' small models")
    add_config_arguments(parser, TransformerConfig, title="model (TransformerConfig)",
                         skip=("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"))
    add_config_arguments(parser, TrainConfig, title="training (TrainConfig)")
    parser.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    defaults = TASK_DEFAULTS[args.task]
    out = args.out or Path("runs") / f"seq2seq-{args.task}"
    _set_threads(defaults["threads"] if args.threads is None else args.threads)
    model_overrides = config_overrides(args, TransformerConfig)
    train_overrides = config_overrides(args, TrainConfig)
    if args.resume:
        checkpoint = load_checkpoint(out / "last")
        if _read_task(out)["task"] != args.task:
            raise UserError(f"{out} holds a run of task {_read_task(out)['task']!r}, not {args.task!r}")
        model_config = TransformerConfig.from_dict(checkpoint.model_config)
        changed = sorted(k for k, v in model_overrides.items() if getattr(model_config, k) != v)
        if changed or args.preset:
            raise UserError(f"--resume continues the saved model; drop --preset and the model options "
                            f"{', '.join(changed)}")
        train_config = TrainConfig.from_dict({**checkpoint.train_config, **train_overrides})
        tokenizer = checkpoint.load_tokenizer()
    else:
        # Validated before the data is generated, so that a bad option fails at once.
        shape = TransformerConfig.from_preset(args.preset or defaults["preset"], **model_overrides)
        recipe = {**defaults["train"], **train_overrides}
        if recipe.get("schedule") == "inverse_sqrt":
            recipe.setdefault("schedule_d_model", shape.d_model)
        train_config = TrainConfig.from_dict(recipe)
        tokenizer = None
    start = time.perf_counter()
    task = make_task(args.task)
    tokenizer = tokenizer or train_tokenizer(task)
    source = Seq2SeqBatches(task, tokenizer, seed=train_config.seed)
    log(f"task {args.task}: {', '.join(f'{len(p):,} {s}' for s, p in task.pairs.items())} pairs, "
        f"BPE vocabulary of {tokenizer.vocab_size} tokens ({time.perf_counter() - start:.1f} s)")
    if not args.resume:
        model_config = shape.replace(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
                                     pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id,
                                     eos_id=tokenizer.eos_id)
    torch.manual_seed(train_config.seed)
    model = Transformer(model_config)
    log(f"model: Transformer, {model.num_parameters():,} parameters, {torch.get_num_threads()} "
        f"thread(s) -> {out}")
    trainer = Trainer(model, source, train_config, out, tokenizer=tokenizer, resume=args.resume,
                      progress=not args.no_progress)
    _write_task(out, args.task)
    metrics = trainer.fit()
    best = Transformer.from_checkpoint(out / "best")
    scores = score_translations(best, task.sources("test"), task.targets("test"), beam_size=1)
    log(f"test split, greedy: BLEU {scores['bleu']:.2f}, exact match {scores['exact_match']:.2%}; "
        f"evaluate with: plainformer seq2seq eval --ckpt {out} --beam 4")
    return {**metrics, **{f"test_{k}": v for k, v in scores.items()}, "task": args.task,
            "parameters": model.num_parameters(), "out": str(out)}


def _write_task(out: Path, task: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{TASK_FILE}.tmp"
    tmp.write_text(json.dumps({"task": task}) + "\n")
    os.replace(tmp, out / TASK_FILE)


def _read_task(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TASK_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: pass --task to say which task's test split to score")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- eval

def score_translations(model: Transformer, sources: Sequence[str], references: Sequence[str], *,
                       beam_size: int, length_penalty: float = 0.6, batch_size: int = 100) -> dict[str, Any]:
    """Translate `sources` and compare with `references`: corpus BLEU (sacrebleu, 13a tokenisation)
    and the fraction of sentences translated exactly."""
    import sacrebleu

    start = time.perf_counter()
    hypotheses = model.translate(sources, beam_size=beam_size, length_penalty=length_penalty,
                                 batch_size=batch_size)
    elapsed = time.perf_counter() - start
    exact = sum(h == r for h, r in zip(hypotheses, references)) / len(references)
    bleu = sacrebleu.corpus_bleu(hypotheses, [list(references)]).score
    return {"bleu": bleu, "exact_match": exact, "sentences": len(references), "beam": beam_size,
            "decode_s": elapsed, "sentences_per_s": len(references) / max(elapsed, 1e-9)}


def _run_dir_and_checkpoint(path: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) from a run directory (its best/, else last/) or a
    checkpoint directory inside one."""
    checkpoint = checkpoint_dir(path)
    return (path if checkpoint != path else path.parent), checkpoint


def _register_eval(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="BLEU and exact match on a task's test split",
        description="Translate the test split of the task the checkpoint was trained on and report "
                    "corpus BLEU (sacrebleu) and the exact-match rate.")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/) or a checkpoint directory")
    parser.add_argument("--beam", type=int, default=1, help="beam size; 1 = greedy (default: 1)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="α (default: 0.6)")
    parser.add_argument("--batch-size", type=int, default=100, help="sentences per batch")
    parser.add_argument("--task", choices=list(TASKS), help="default: the run's task.json")
    parser.add_argument("--split", choices=("test", "val"), default="test")
    _add_threads_argument(parser, "torch's")
    parser.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    _set_threads(args.threads)
    run_dir, checkpoint = _run_dir_and_checkpoint(args.ckpt)
    model = Transformer.from_checkpoint(checkpoint)
    task_name = args.task or _read_task(run_dir)["task"]
    task = make_task(task_name)
    scores = score_translations(model, task.sources(args.split), task.targets(args.split),
                                beam_size=args.beam, length_penalty=args.length_penalty,
                                batch_size=args.batch_size)
    log(f"{task_name} {args.split} split, beam {args.beam}: BLEU {scores['bleu']:.2f}, "
        f"exact match {scores['exact_match']:.2%}")
    return {**scores, "task": task_name, "split": args.split, "checkpoint": str(checkpoint)}


# ----------------------------------------------------------------------------- translate

def _register_translate(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "translate", help="translate sentences with a trained encoder-decoder",
        description="Translate TEXT, or each line of stdin when TEXT is absent; translations go to "
                    "stdout one per line, then one JSON line of metrics.")
    parser.add_argument("text", nargs="?", metavar="TEXT", help="a sentence (default: read stdin)")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="run directory (its best/, else last/) or a checkpoint directory")
    parser.add_argument("--beam", type=int, default=1, help="beam size; 1 = greedy (default: 1)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="α (default: 0.6)")
    _add_threads_argument(parser, "torch's")
    parser.set_defaults(run=run_translate)


def run_translate(args: argparse.Namespace) -> dict[str, Any]:
    _set_threads(args.threads)
    model = Transformer.from_checkpoint(_run_dir_and_checkpoint(args.ckpt)[1])
    lines = [args.text] if args.text is not None else [line.rstrip("\n") for line in sys.stdin]
    start = time.perf_counter()
    translations = model.translate(lines, beam_size=args.beam, length_penalty=args.length_penalty)
    elapsed = time.perf_counter() - start
    for translation in translations:
        sys.stdout.write(translation + "\n")
    return {"sentences": len(lines), "beam": args.beam, "elapsed_s": elapsed}
