"""The encoder-decoder Transformer family on the built-in tasks (`plainformer.data.seq2seq`): trained
on a task, then its test split translated greedily; evaluated by BLEU (sacrebleu) and exact match of
whole sentences on a split of the task its run's recipe.yaml names."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..data.seq2seq import TASKS, Seq2SeqBatches, make_task, train_tokenizer
from ..errors import UserError
from ..files.json_file import read_json
from ..log import log
from ..models.transformer import Transformer, TransformerConfig
from ..training.evaluation import score_translations
from .family import Family, Run, fit
from .memory_estimates import check_beam_memory

LEGACY_TASK_FILE = "task.json"  # what run directories held before recipe.yaml


# ----------------------------------------------------------------------------- train

def train(run: Run) -> dict[str, Any]:
    """`plainformer train` for an encoder-decoder recipe: train on options["task"], then translate
    its test split greedily and report BLEU and exact match."""
    task_name = run.options["task"]
    start = time.perf_counter()
    task = make_task(task_name)
    tokenizer = run.checkpoint.load_tokenizer() if run.checkpoint is not None else train_tokenizer(task)
    source = Seq2SeqBatches(task, tokenizer, seed=run.train_config.seed)
    log(f"task {task_name}: {', '.join(f'{len(p):,} {s}' for s, p in task.pairs.items())} pairs, "
        f"BPE vocabulary of {tokenizer.vocab_size} tokens ({time.perf_counter() - start:.1f} s)")
    model_config = run.model_config(TransformerConfig)
    if not run.resume:
        model_config = model_config.replace(
            src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
            pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    torch.manual_seed(run.train_config.seed)
    model = Transformer(model_config)
    log(f"model: Transformer, {model.num_parameters():,} parameters, {torch.get_num_threads()} "
        f"thread(s) -> {run.out}")
    metrics = fit(run, model, source, tokenizer)
    best = Transformer.from_checkpoint(run.out / "best")
    scores = score_translations(best, task.sources("test"), task.targets("test"), beam_size=1,
                                tokenize=task.bleu_tokenize)
    log(f"test split, greedy: BLEU {scores['bleu']:.2f}, exact match {scores['exact_match']:.2%}; "
        f"evaluate with: plainformer eval --ckpt {run.out} --beam 4")
    return {**metrics, **{f"test_{k}": v for k, v in scores.items()}, "task": task_name, "out": str(run.out)}


# ----------------------------------------------------------------------------- decoding

def check_beam(model: Transformer, beam: int, sources: Sequence[str], batch_size: int) -> None:
    """Refuse a --beam the target vocabulary or the memory cannot hold, before decoding: beyond V
    hypotheses no two could differ; and `batch_size` sources of the longest length among `sources`
    at a time, with `beam` hypotheses each, must fit the memory available beside the model
    (`memory_estimates.check_beam_memory`)."""
    vocab_size = model.config.tgt_vocab_size
    if beam > vocab_size:
        raise UserError(f"--beam {beam} is more than the {vocab_size} tokens of the target vocabulary: "
                        f"at most --beam {vocab_size}")
    tokenizer = model.tokenizer  # without one, translate refuses: then the longest source max_len allows
    lengths = [len(tokenizer.encode(text)) for text in sources] if tokenizer is not None else [model.config.max_len]
    sentences, source_len = max(1, min(batch_size, len(sources))), max(1, *lengths)
    check_beam_memory(model, beam, sentences, source_len)


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
    values = read_json(path, error=UserError)
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
    batch_size = args.batch_size or 100
    check_beam(model, beam, task.sources(split), batch_size)
    scores = score_translations(model, task.sources(split), task.targets(split), beam_size=beam,
                                length_penalty=args.length_penalty, batch_size=batch_size,
                                tokenize=task.bleu_tokenize)
    log(f"{task_name} {split} split, beam {beam}: BLEU {scores['bleu']:.2f}, "
        f"exact match {scores['exact_match']:.2%}")
    return {**scores, "task": task_name, "split": split, "checkpoint": str(checkpoint)}


TRANSFORMER_FAMILY = Family(
    name="transformer", model=Transformer, config=TransformerConfig,
    data_fields=("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"), options=("task", "threads"),
    train=train, evaluate=evaluate, eval_options=("beam", "length_penalty", "task", "split"),
    cross_attention=True)
