"""The bert-cls family: a pretrained BERT (default: MiniLM) fine-tuned to classify a text or a sentence pair,
whole or through LoRA (`plainformer finetune`), scored (`eval`), run (`classify`) and exported as Hugging
Face's BertForSequenceClassification.

The task is the user's labelled data (`--data`, `--val-data`, `--text-field`, `--text-pair-field`,
`--label-field`: data/labelled.py), or without --data which of `--plays` a line of the bundled corpus comes
from. The model keeps the class names as its label_names (id2label). The batch source scores the model on the
whole validation set at every evaluation (`ScoredSource`, an `evaluation.Selection`), so that best/ is the model
of the highest validation accuracy; the scores are accuracy, macro-F1, Matthews correlation and the
confusion matrix (training/classification.py), which the run directory also gets as a picture,
confusion_{data}.png.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from ..checkpoint.format import load_checkpoint
from ..data.classification import (
    DEFAULT_PLAYS,
    ClassificationBatchSource,
    ClassificationData,
    EncodedTexts,
    Examples,
    play_lines_task,
)
from ..data.labelled import Fields, read_classification_data, read_labelled
from ..data.tokenizers import WordPieceTokenizer
from ..errors import UserError
from ..hf.auto import hf_family, load_hf, save_hf
from ..hf.directory import is_hf_directory
from ..hf.sentence import load_bert
from ..launch import is_main_process
from ..log import log
from ..models.bert import BertConfig, BertForSequenceClassification
from ..training.classification import classification_scores
from ..training.evaluation import Selection, evaluating
from ..training.plots import plot_confusion_matrix
from .bert import BERT_DATA_FIELDS, eval_batch_size, saved_batching
from .family import FINE_TUNING_OPTIONS, Family, Run, fit
from .finetuning import load_trained, starting_model
from .memory_estimates import check_evaluation_memory

#: The recipe options that describe a labelled file's fields.
FIELD_OPTIONS = ("text_field", "text_pair_field", "label_field")
#: The eval flags that apply to a classifier.
EVAL_OPTIONS = ("data", *FIELD_OPTIONS)
DEFAULT_EVAL_BATCH_SIZE = 64


# ----------------------------------------------------------------------------- data

def _fields(values: Mapping[str, Any]) -> Fields:
    return Fields(values.get("text_field"), values.get("text_pair_field"), values.get("label_field"))


def classification_data(options: Mapping[str, Any]) -> ClassificationData:
    """The task of a run's options: its --data (split, or with --val-data) read as labelled data, else
    which of its --plays (default: DEFAULT_PLAYS) a line comes from."""
    if options.get("data") is None:
        given = [name for name in ("val_data", *FIELD_OPTIONS) if options.get(name) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} describes the labelled data of --data: give --data")
        return play_lines_task(options.get("plays") or DEFAULT_PLAYS)
    if options.get("plays") is not None:
        raise UserError("--plays chooses the built-in task and --data your own: give one of them")
    return read_classification_data(options["data"], options.get("val_data"), _fields(options))


def _counts(data: ClassificationData, split: str) -> str:
    counts = data.counts(split)
    return f"{sum(counts.values()):,} ({', '.join(f'{name}: {count:,}' for name, count in counts.items())})"


def _describe(data: ClassificationData, options: Mapping[str, Any]) -> str:
    if options.get("data") is None:
        where = "lines of the bundled corpus"
    else:
        where = (f"{options['data']}, validation {options['val_data']}" if options.get("val_data") is not None
                 else f"{options['data']}, a stratified validation split of it")
    blank = f" ({data.blank_lines:,} blank lines skipped)" if data.blank_lines else ""
    return (f"task: {len(data.classes)} classes, {where}{blank}: training {_counts(data, 'train')}; "
            f"validation {_counts(data, 'val')}")


# ----------------------------------------------------------------------------- scoring

def class_logits(model: nn.Module, encoded: EncodedTexts, batch_size: int, *, progress: bool = False) -> Tensor:
    """(N, n_labels) float32 logits of the N encoded texts, in their order, computed in batches of texts of
    similar length (`EncodedTexts.by_length`), with a progress bar on stderr when `progress`."""
    device = next(model.parameters()).device
    batches = encoded.by_length(batch_size)
    logits: Tensor | None = None
    with evaluating(model):
        for rows in tqdm(batches, disable=not progress, file=sys.stderr, unit="batch", dynamic_ncols=True):
            batch = {name: tensor.to(device) for name, tensor in encoded.batch(rows).items()}
            out = model(**batch)[0].float().cpu()  # (B, n_labels)
            if logits is None:
                logits = torch.empty(len(encoded), out.shape[1])
            logits[torch.from_numpy(rows)] = out
    assert logits is not None  # EncodedTexts of no text cannot be built
    return logits


def scores(logits: Tensor, labels: Sequence[int] | Tensor, classes: Sequence[str]) -> dict[str, Any]:
    """loss (mean cross entropy), accuracy, macro_f1, mcc and confusion_matrix of `logits` (N, C) against
    `labels`, with the classes and the number of examples."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    loss = float(F.cross_entropy(logits, labels))
    return {"loss": loss, **classification_scores(labels, logits.argmax(dim=-1), len(classes)),
            "classes": list(classes), "examples": len(labels)}


class ScoredSource(ClassificationBatchSource):
    """The classification batches of a run, which also score the model on the whole validation set at each
    of the trainer's evaluations, in batches of `eval_batch_size` (`validation_metrics`, the score of the run's
    `evaluation.Selection`): best/ is the model of the highest validation accuracy. `last` holds the latest
    scores."""

    def __init__(self, data: ClassificationData, tokenizer: WordPieceTokenizer, max_len: int, *, seed: int,
                 eval_batch_size: int):
        super().__init__(data, tokenizer, max_len, seed=seed)
        self.eval_batch_size = eval_batch_size
        self.last: dict[str, Any] | None = None

    def validation_metrics(self, model: nn.Module) -> dict[str, float]:
        self.last = scores(class_logits(model, self.encoded["val"], self.eval_batch_size), self.data.val.labels,
                           self.data.classes)
        return {name: self.last[name] for name in ("loss", "accuracy", "macro_f1", "mcc")}


def save_confusion_picture(report: Mapping[str, Any], run_dir: Path, name: str) -> Path:
    """The confusion matrix of `report` as run_dir/confusion_{name}.png."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "data"
    return plot_confusion_matrix(report["confusion_matrix"], report["classes"], run_dir / f"confusion_{safe}.png",
                                 title=f"{name}: accuracy {report['accuracy']:.4f}, {report['examples']:,} examples")


# ----------------------------------------------------------------------------- finetune

def classifier_from_base(directory: Path, changes: Mapping[str, Any]) -> BertForSequenceClassification:
    """A classifier on the encoder of `directory` (a Hugging Face BERT, MiniLM's, or a plainformer BERT
    checkpoint of any head), its config changed by `changes` (n_labels and label_names, say). The head is
    new, unless `directory` holds a classifier of the same classes, whose head then trains on."""
    base = _classifier_in(directory)
    bert, tokenizer = (base.bert, base.tokenizer) if base is not None else load_bert(directory)
    model = BertForSequenceClassification(bert.config.replace(**changes))
    model.bert.load_state_dict(bert.state_dict())
    if base is not None and base.config.class_names() == model.config.class_names():
        model.classifier.load_state_dict(base.classifier.state_dict())
        log(f"the classifier of {directory} has these classes: its head trains on")
    model.tokenizer = tokenizer
    return model


def _classifier_in(directory: Path) -> BertForSequenceClassification | None:
    """The classifier a directory holds (Hugging Face's, or a whole-model bert-cls checkpoint), else None."""
    if is_hf_directory(directory):
        model = load_hf(directory) if hf_family(directory) == BERT_CLS_NAME else None
        return model if isinstance(model, BertForSequenceClassification) else None
    checkpoint = load_checkpoint(directory)
    if checkpoint.family != BERT_CLS_NAME or checkpoint.adapter is not None:
        return None
    return BertForSequenceClassification.from_loaded(checkpoint)


def finetune(run: Run) -> dict[str, Any]:
    """`plainformer finetune`: the labelled data of the run's options (or the play-lines task), every weight
    trained or with --lora-r the LoRA adapter and the classifier; best/ is the model of the highest
    validation accuracy, whose scores end the result (and picture the confusion matrix in the run)."""
    data = classification_data(run.options)
    torch.manual_seed(run.train_config.seed)
    model, adapter = starting_model(run, n_labels=len(data.classes), label_names=data.classes)
    assert isinstance(model, BertForSequenceClassification)  # the family's
    config = model.config
    if config.n_labels != len(data.classes) or config.label_names not in (None, data.classes):
        raise UserError(f"--resume continues a model of the classes {', '.join(config.class_names())}, not the "
                        f"data's {', '.join(data.classes)}")
    tokenizer = model.tokenizer
    if not isinstance(tokenizer, WordPieceTokenizer):
        raise UserError(f"{run.options['init']} holds no WordPiece tokenizer to encode the texts with")
    log(_describe(data, run.options))
    batch_size = eval_batch_size(run)
    source = ScoredSource(data, tokenizer, run.options["seq_len"], seed=run.train_config.seed,
                          eval_batch_size=batch_size)
    train_config = run.train_config.replace(eval_batches=source.num_batches("val", batch_size))
    log(f"model from {run.options['init']} -> {run.out}")
    metrics = fit(run, model, source, tokenizer, train_config, adapter,
                  selection=Selection(source.validation_metrics, "accuracy"))
    best = _best_scores(run, source, metrics["step"], batch_size)
    picture = save_confusion_picture(best, run.out, "val") if is_main_process() else None
    log(f"best/: validation accuracy {best['accuracy']:.4f}, macro-F1 {best['macro_f1']:.4f}, MCC "
        f"{best['mcc']:.4f} (majority class: {data.majority_baseline('val'):.4f}); classify with: "
        f"plainformer classify --ckpt {run.out} TEXT")
    return {**metrics, **{f"val_{name}": best[name] for name in ("accuracy", "macro_f1", "mcc", "confusion_matrix")},
            "majority_baseline": data.majority_baseline("val"), "classes": list(data.classes),
            "val_examples": len(data.val), "confusion_png": None if picture is None else str(picture),
            "out": str(run.out)}


def _best_scores(run: Run, source: ScoredSource, step: int, batch_size: int) -> dict[str, Any]:
    """The validation scores of best/: those of the trainer's last evaluation when best/ holds its step,
    else best/ loaded and scored."""
    best = load_checkpoint(run.out / "best")
    if source.last is not None and (best.trainer_state or {}).get("step") == step:
        return source.last
    model = load_trained(best, BERT_CLS_FAMILY)
    return scores(class_logits(model, source.encoded["val"], batch_size), source.data.val.labels,
                  source.data.classes)


# ----------------------------------------------------------------------------- eval and classify

def load_classifier(path: Path) -> BertForSequenceClassification:
    """The classifier (eval mode, with `.tokenizer`) of a Hugging Face BertForSequenceClassification
    directory or of a bert-cls checkpoint directory (a LoRA run's on its base)."""
    model = load_hf(path) if is_hf_directory(path) else load_trained(load_checkpoint(path), BERT_CLS_FAMILY)
    if not isinstance(model, BertForSequenceClassification):
        raise UserError(f"{path} holds a {type(model).__name__}, not a sequence classifier")
    if not isinstance(model.tokenizer, WordPieceTokenizer):
        raise UserError(f"{path} holds no WordPiece tokenizer to encode the texts with")
    return model


def evaluate_classifier(args: argparse.Namespace, run_dir: Path, checkpoint: Path, recipe: dict[str, Any]
                        ) -> dict[str, Any]:
    """`plainformer eval` of a classifier: its scores on --data (a labelled file, its fields as the flags or the
    run's recipe name them), else on the run's validation set; the confusion matrix is also pictured in the
    run directory (none for a Hugging Face directory, which is no run)."""
    model = load_classifier(checkpoint)
    examples, classes, name = _evaluation_examples(args, recipe, model.config, checkpoint)
    if args.batch_size:
        batch_size = args.batch_size
    else:
        batch_size = DEFAULT_EVAL_BATCH_SIZE if is_hf_directory(checkpoint) else saved_batching(
            args, load_checkpoint(checkpoint, verify=False))[0]
    seq_len = recipe.get("seq_len") or model.config.max_len
    check_evaluation_memory(model, batch_size, seq_len)
    assert isinstance(model.tokenizer, WordPieceTokenizer)  # load_classifier's
    encoded = EncodedTexts(model.tokenizer, examples.texts, examples.pairs, seq_len)
    report = scores(class_logits(model, encoded, batch_size), examples.labels, classes)
    picture = None if is_hf_directory(checkpoint) else save_confusion_picture(report, run_dir, name)
    counts = torch.bincount(torch.tensor(examples.labels), minlength=len(classes))
    return {**{key: report[key] for key in ("accuracy", "macro_f1", "mcc", "confusion_matrix", "loss", "classes",
                                            "examples")},
            "majority_baseline": counts.max().item() / len(examples), "data": name,
            "confusion_png": None if picture is None else str(picture)}


def _evaluation_examples(args: argparse.Namespace, recipe: Mapping[str, Any], config: BertConfig,
                         checkpoint: Path) -> tuple[Examples, tuple[str, ...], str]:
    """(the examples to score, labelled by the model's classes; the classes; the name of their data). A
    classifier trained before classifiers kept their classes' names has the names of its run's data."""
    given = {name: getattr(args, name, None) for name in FIELD_OPTIONS}
    if args.data is not None:
        fields = _fields({**{k: v for k, v in recipe.items() if k in FIELD_OPTIONS},
                          **{k: v for k, v in given.items() if v is not None}})
        path, classes = Path(args.data), config.class_names()
        return read_labelled(path, fields).examples(classes), classes, path.name.split(".")[0]
    if is_hf_directory(checkpoint):
        raise UserError(f"{checkpoint} is a Hugging Face classifier, with no run and no validation set: give --data")
    if any(value is not None for value in given.values()):
        raise UserError("--text-field, --text-pair-field and --label-field describe the file of --data: give --data")
    data = classification_data(recipe)
    if config.n_labels != len(data.classes) or config.label_names not in (None, data.classes):
        raise UserError(f"{checkpoint} classifies {', '.join(config.class_names())}, not the classes of its run's "
                        f"data ({', '.join(data.classes)}): give --data")
    return data.val, data.classes, "val"


def class_probabilities(model: BertForSequenceClassification, texts: Sequence[str],
                        pairs: Sequence[str] | None = None, *, batch_size: int = DEFAULT_EVAL_BATCH_SIZE,
                        max_len: int | None = None, progress: bool = False) -> Tensor:
    """(N, n_labels) float32 softmax probabilities of the classes for each text (and pair), in their order:
    what `plainformer classify` prints. Texts are truncated to `max_len` tokens (default: the model's)."""
    assert isinstance(model.tokenizer, WordPieceTokenizer)  # load_classifier's
    encoded = EncodedTexts(model.tokenizer, texts, pairs, max_len or model.config.max_len)
    return class_logits(model, encoded, batch_size, progress=progress).softmax(dim=-1)


# ----------------------------------------------------------------------------- registration

def export_classifier(model: nn.Module, directory: Path, tokenizer: Any) -> None:
    """A classifier as Hugging Face's BertForSequenceClassification, its classes as id2label."""
    save_hf(model, directory, tokenizer=tokenizer)  # type: ignore[arg-type]  # a BertForSequenceClassification


BERT_CLS_NAME = BertForSequenceClassification.family
BERT_CLS_FAMILY = Family(
    name=BERT_CLS_NAME, model=BertForSequenceClassification, config=BertForSequenceClassification.config_class,
    data_fields=BERT_DATA_FIELDS,
    options=("data", "val_data", *FIELD_OPTIONS, "seq_len", "plays", "threads", *FINE_TUNING_OPTIONS),
    train=finetune, evaluate=evaluate_classifier, eval_options=EVAL_OPTIONS,
    finetune_fields=("dropout", "attention_dropout"), from_base=classifier_from_base, head=("classifier",),
    export=export_classifier)
