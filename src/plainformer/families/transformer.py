"""The encoder-decoder Transformer family: trained to translate your parallel data (`data.parallel`: line-aligned
files, TSV or JSON Lines, one SentencePiece vocabulary for both languages, batches of similar length by token
count), best/ chosen by the validation BLEU, the last checkpoints averaged; or trained on a built-in task
(`data.seq2seq`), then its test split translated greedily. Evaluated by BLEU, chrF and tokenized BLEU on a
source/reference pair of files, or on a split of the task its run's recipe.yaml names."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.average import average_checkpoints, kept_checkpoints, replace_checkpoint
from ..checkpoint.format import load_checkpoint
from ..data.parallel import prepare_parallel_data, read_pairs
from ..data.seq2seq import TASKS, PairBatches, Seq2SeqBatches, make_task, train_tokenizer
from ..errors import UserError
from ..files.json_file import read_json
from ..hf.directory import is_hf_directory
from ..hf.marian import load_marian, save_marian
from ..log import log
from ..models.transformer import Transformer, TransformerConfig
from ..training.evaluation import Selection, evaluating, score_translations, translation_scores
from .family import Family, Run, fit, run_and_checkpoint
from .memory_estimates import check_beam_memory

LEGACY_TASK_FILE = "task.json"  # what run directories held before recipe.yaml
DEFAULT_VOCAB = 8000  # SentencePiece pieces shared by both languages, unless --vocab-size says
VAL_BATCH = 100  # validation sentences translated at once at each evaluation


# ----------------------------------------------------------------------------- train

def train(run: Run) -> dict[str, Any]:
    """`plainformer train` for an encoder-decoder recipe: on the parallel data of options["data"], or on
    options["task"], a built-in task."""
    if run.options.get("data") is not None:
        return train_translation(run)
    if not run.options.get("task"):
        raise UserError(f"recipe {run.preset!r} trains on your parallel data: give --data PREFIX and --val-data "
                        "PREFIX (PREFIX.SRC and PREFIX.TGT files, a .tsv or a .jsonl), or a built-in --task")
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


def train_translation(run: Run) -> dict[str, Any]:
    """Train on options["data"], validated on options["val_data"] (both as `data.parallel.open_parallel` reads
    them): BLEU and chrF of greedy translations of the whole validation set at each evaluation, best/ the
    highest BLEU; with keep_checkpoints > 1 the checkpoints kept are averaged at the end into OUT/averaged,
    which becomes best/ where its BLEU is higher."""
    options = run.options
    languages = options.get("source_lang") or "", options.get("target_lang") or ""
    if not all(languages) or options.get("val_data") is None:
        raise UserError("translation needs --source-lang and --target-lang (the suffixes or JSON keys of the data) "
                        "and --val-data (pairs held out, scored by BLEU at each evaluation)")
    model_config = run.model_config(TransformerConfig)
    tokenizer = run.checkpoint.load_tokenizer() if run.checkpoint is not None else None
    data = prepare_parallel_data(
        options["data"], options["val_data"], source_lang=languages[0], target_lang=languages[1], tokenizer=tokenizer,
        vocab_size=None if tokenizer else options.get("vocab_size") or DEFAULT_VOCAB,
        progress=run.progress, log=log)
    tokenizer = data.tokenizer
    if not run.resume:
        model_config = model_config.replace(
            src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, source_eos=True)
    source = PairBatches({"train": data.train, "val": data.val}, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id,
                         eos_id=tokenizer.eos_id, seed=run.train_config.seed,
                         batch_tokens=options.get("batch_tokens"), source_eos=True, max_len=model_config.max_len)
    for split in ("train", "val"):
        if source.left_out(split):
            log(f"{split}: {source.left_out(split):,} pairs longer than max_len={model_config.max_len} tokens left out")
    torch.manual_seed(run.train_config.seed)
    model = Transformer(model_config)
    model.tokenizer = tokenizer
    log(f"model: Transformer, {model.num_parameters():,} parameters, {torch.get_num_threads()} thread(s), "
        f"{source.batches_per_epoch('train', run.train_config.batch_size):,} batches an epoch -> {run.out}")

    val_sources, val_references = fitting_pairs(data.val_sources, data.val_references, tokenizer, model_config)

    def score(model: Any) -> dict[str, float]:
        hypotheses = model.translate(val_sources, batch_size=VAL_BATCH)
        scores = translation_scores(hypotheses, val_references)
        return {"bleu": scores["bleu"], "chrf": scores["chrf"]}

    metrics = fit(run, model, source, tokenizer, selection=Selection(score, "bleu"))
    metrics.update(average_kept(run, score))
    log(f"checkpoints in {run.out}/last and {run.out}/best; translate with: plainformer translate --ckpt {run.out}")
    return {**metrics, "out": str(run.out)}


def fitting_pairs(sources: list[str], references: list[str], tokenizer: Any, config: TransformerConfig
                  ) -> tuple[list[str], list[str]]:
    """The validation pairs whose source fits the model's positions, the others counted in the log."""
    fits = [len(ids) + config.source_eos <= config.max_len for ids in tokenizer.encode_many(sources)]
    if not all(fits):
        log(f"validation BLEU: {fits.count(False):,} sources longer than max_len={config.max_len} tokens left out")
    return ([s for s, fit in zip(sources, fits, strict=True) if fit],
            [r for r, fit in zip(references, fits, strict=True) if fit])


def average_kept(run: Run, score: Any) -> dict[str, Any]:
    """The checkpoints the run kept (TrainConfig.keep_checkpoints) averaged into OUT/averaged and scored; it
    replaces best/ where its BLEU is higher (and best_val_bleu is then its)."""
    kept = kept_checkpoints(run.out)
    if len(kept) < 2:
        return {}
    averaged = average_checkpoints(kept, run.out / "averaged")
    model = Transformer.from_checkpoint(averaged)
    with evaluating(model):
        scores = score(model)
    best = load_checkpoint(run.out / "best").trainer_state or {}
    log(f"the last {len(kept)} checkpoints averaged -> {averaged}: validation BLEU {scores['bleu']:.2f}, "
        f"best/ {best.get('best_score', float('nan')):.2f}")
    metrics = {"averaged": len(kept), **{f"averaged_val_{k}": v for k, v in scores.items()}}
    if best.get("best_score") is None or scores["bleu"] > best["best_score"]:
        replace_checkpoint(averaged, run.out / "best")
        log(f"{run.out}/best now holds the average")
        metrics["best_val_bleu"] = scores["bleu"]
    return metrics


# ----------------------------------------------------------------------------- decoding

def load_translator(path: Path) -> Transformer:
    """The Transformer, in eval mode with its tokenizer, of a run or checkpoint directory (a run's best/,
    else last/) or of a Marian directory (transformers' MarianMTModel, Helsinki-NLP's opus-mt)."""
    if is_hf_directory(path):
        return load_marian(path)
    return Transformer.from_checkpoint(run_and_checkpoint(path)[1])


def export(model: Any, directory: Path, tokenizer: Any) -> None:
    """`plainformer export`: a Marian directory (`hf.marian`), which transformers and CTranslate2 read."""
    save_marian(model, directory, tokenizer=tokenizer)


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
    if tokenizer is None:
        lengths = [model.config.max_len]
    else:
        lengths = [len(ids) + model.config.source_eos for ids in tokenizer.encode_many(sources)]
        too_long = next((i for i, length in enumerate(lengths) if length > model.config.max_len), None)
        if too_long is not None:
            raise UserError(f"sentence {too_long + 1} is {lengths[too_long]} tokens long, more than the model's "
                            f"max_len={model.config.max_len}: split it")
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
    """`plainformer eval` of an encoder-decoder: BLEU, chrF and tokenized BLEU on the pairs of --data, or BLEU
    and exact match on a split of the run's task."""
    model = load_translator(checkpoint)
    if args.data is not None or (recipe.get("data") is not None and args.task is None):
        return _evaluate_pairs(args, model, checkpoint, recipe)
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


def _evaluate_pairs(args: argparse.Namespace, model: Transformer, checkpoint: Path, recipe: dict[str, Any]
                    ) -> dict[str, Any]:
    """Scores on the pairs of --data (sources translated, targets the references), the languages those of
    --source-lang / --target-lang or else the run's."""
    if args.data is None:
        raise UserError("give --data: the pairs to score (the run's own validation pairs chose best/; its "
                        "test set is yours to name)")
    languages = [getattr(args, key) or recipe.get(key) or "" for key in ("source_lang", "target_lang")]
    if not all(languages):
        raise UserError("give --source-lang and --target-lang: the run's recipe.yaml names no languages")
    if args.split is not None:
        raise UserError("--split names a split of a built-in task; with --data the pairs are those of --data")
    sources, references = read_pairs(args.data, *languages)
    if not sources:
        raise UserError(f"--data {args.data} holds no pair")
    beam, batch_size = args.beam or 1, args.batch_size or 100
    check_beam(model, beam, sources, batch_size)
    scores = score_translations(model, sources, references, beam_size=beam, length_penalty=args.length_penalty,
                                batch_size=batch_size, target_lang=languages[1])
    log(f"{args.data} ({len(sources):,} pairs), beam {beam}: BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f}, "
        f"tokenized BLEU {scores['tokenized_bleu']:.2f}")
    return {**scores, "data": str(args.data), "source_lang": languages[0], "target_lang": languages[1],
            "checkpoint": str(checkpoint)}


TRANSFORMER_FAMILY = Family(
    name="transformer", model=Transformer, config=TransformerConfig,
    data_fields=("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id", "source_eos"),
    options=("data", "val_data", "source_lang", "target_lang", "vocab_size", "batch_tokens", "task", "threads"),
    train=train, evaluate=evaluate,
    eval_options=("data", "source_lang", "target_lang", "beam", "length_penalty", "task", "split"),
    export=export, cross_attention=True)
