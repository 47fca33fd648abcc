"""BERT: masked-LM pretraining on the bundled corpus with a WordPiece tokenizer trained on it
(`bert-mlm`); the encoder alone (`bert`) is what Hugging Face's BertModel holds. Fine-tuning a pretrained
BERT to classify text (`bert-cls`) is classifier.py's."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.format import load_checkpoint
from ..data.corpus import SPLITS, load_split
from ..data.lm import build_tokenizer
from ..data.mlm import MLMBatchSource, encode_stream
from ..errors import UserError
from ..hf.auto import save_hf
from ..hf.bert import MINILM_NAME
from ..log import log
from ..models.bert import BertConfig, BertForMaskedLM, BertModel
from ..training.config import TrainConfig
from ..training.evaluation import accuracy, mean_loss
from .family import Family, Run, checkpoint_dir, fit
from .memory_estimates import check_evaluation_memory


def model_location(name: str) -> str | Path:
    """"minilm", else a directory: Hugging Face, a checkpoint, or a run directory (its best/ or last/)."""
    return name if name == MINILM_NAME else checkpoint_dir(Path(name))


def eval_batch_size(run: Run) -> int:
    return run.train_config.eval_batch_size or run.train_config.batch_size


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
    source = _mlm_source(options.get("data"), tokenizer, options["seq_len"], config, run.train_config.seed)
    torch.manual_seed(run.train_config.seed)
    model = BertForMaskedLM(config)
    log(f"model: BERT {run.preset}, {sum(p.numel() for p in model.parameters()):,} parameters -> {run.out}")
    metrics = fit(run, model, source, tokenizer)
    masked_accuracy = accuracy(model, source, run.train_config.eval_batches, eval_batch_size(run))
    log(f"validation: MLM loss {metrics['val_loss']:.4f}, masked-token accuracy {masked_accuracy:.4f}; "
        f"embed with: plainformer embed --model {run.out / 'last'}")
    return {**metrics, "val_mlm_loss": metrics["val_loss"], "val_masked_accuracy": masked_accuracy,
            "out": str(run.out)}


# ----------------------------------------------------------------------------- eval

def saved_batching(args: argparse.Namespace, checkpoint: Any) -> tuple[int, int, int]:
    """(batch size, seed, validation batches) of the evaluation: --batch-size, else the run's
    evaluation batch size."""
    train = checkpoint.config(TrainConfig, "train")
    return args.batch_size or train.eval_batch_size or train.batch_size, train.seed, train.eval_batches


def evaluate_mlm(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
                 ) -> dict[str, Any]:
    """`plainformer eval` of a masked LM: loss and masked-token accuracy over the run's fixed
    validation batches (the same masks as during training)."""
    saved = load_checkpoint(checkpoint)
    model = BertForMaskedLM.from_loaded(saved)
    batch_size, seed, n_batches = saved_batching(args, saved)
    seq_len = recipe.get("seq_len", 128)
    check_evaluation_memory(model, batch_size, seq_len)
    source = _mlm_source(args.data or recipe.get("data"), model.tokenizer, seq_len, model.config, seed)
    return {"val_mlm_loss": mean_loss(model, source, n_batches, batch_size),
            "val_masked_accuracy": accuracy(model, source, n_batches, batch_size), "batches": n_batches}


# ----------------------------------------------------------------------------- registration

def export_encoder(model: nn.Module, directory: Path, tokenizer: Any) -> None:
    """A BERT's encoder as Hugging Face's BertModel: a task model's head stays behind."""
    encoder = model if isinstance(model, BertModel) else model.bert
    save_hf(encoder, directory, tokenizer=tokenizer)  # type: ignore[arg-type]  # a BertModel


#: The BertConfig fields the data decides: the tokenizer's, and a classifier's classes.
BERT_DATA_FIELDS = ("vocab_size", "n_labels", "pad_id", "label_names")
BERT_FAMILY = Family(name="bert", model=BertModel, config=BertConfig, data_fields=BERT_DATA_FIELDS,
                     export=export_encoder)
BERT_MLM_FAMILY = Family(
    name="bert-mlm", model=BertForMaskedLM, config=BertConfig, data_fields=BERT_DATA_FIELDS,
    options=("data", "vocab_size", "seq_len", "threads"), train=pretrain, evaluate=evaluate_mlm,
    eval_options=("data",), export=export_encoder)
