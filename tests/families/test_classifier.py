"""The bert-cls family on the command line: fine-tuning on labelled files (TSV, CSV, JSON Lines, pairs), best/
by validation accuracy, `eval`'s scores and picture, the export that transformers' pipeline runs with our
probabilities, a Hugging Face classifier loaded for classify, eval and more fine-tuning, a LoRA classifier that
PEFT loads, the bad inputs refused with nothing written, and a slice of SST-2 learnt in seconds."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

import plainformer as pf
from plainformer.cli import main
from plainformer.families.classifier import class_probabilities
from plainformer.hf.lora import ADAPTER_CONFIG
from tests.reference.shared_data import shared_data
from tests.reference.tiny_models import tiny_hf_bert

TRAINING = ["--batch-size", "4", "--eval-interval", "3", "--warmup-steps", "1", "--log-interval", "3",
            "--no-progress", "--dtype", "float32", "--no-fit-to-time", "--seq-len", "32"]
WORDS = {"negative": ["bad", "awful", "dull"], "neutral": ["fine", "okay", "plain"],
         "positive": ["great", "superb", "lovely"]}
TEXTS = ["a great and lovely film", "dull , dull , dull", "it is okay", "superb acting but an awful plot"]


def _rows(n: int, offset: int = 0) -> list[tuple[str, str]]:
    classes = list(WORDS)
    return [(f"the film was {WORDS[classes[i % 3]][(i // 3) % 3]} , scene {i + offset}", classes[i % 3])
            for i in range(n)]


def _tsv(path: Path, rows, header: str = "sentence\tlabel") -> Path:
    path.write_text(header + "\n" + "".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    jsonl = folder / "other.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in _rows(9, 500)))
    return {"train": _tsv(folder / "train.tsv", _rows(48)), "val": _tsv(folder / "val.tsv", _rows(12, 100)),
            "other": jsonl}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_hf_bert(tmp_path_factory.mktemp("base") / "bert")


def run_cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err


def finetune(capsys, base: Path, data: dict[str, Path], out: Path, *extra: str) -> dict:
    code, lines, err = run_cli(capsys, "finetune", "--init", str(base), "--data", str(data["train"]), "--val-data",
                               str(data["val"]), "--out", str(out), "--max-steps", "6", *TRAINING, *extra)
    assert code == 0, err
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory, base, data) -> tuple[Path, dict]:
    """A 3-class classifier fine-tuned 6 steps from `base`, and the metrics its finetune printed."""
    out = tmp_path_factory.mktemp("runs") / "cls"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["finetune", "--init", str(base), "--data", str(data["train"]), "--val-data", str(data["val"]),
                     "--out", str(out), "--max-steps", "6", *TRAINING])
    assert code == 0
    return out, json.loads(printed.getvalue().splitlines()[-1])


def test_finetune_names_the_classes_keeps_the_best_accuracy_and_eval_agrees(capsys, run, data):
    out, metrics = run
    assert metrics["classes"] == ["negative", "neutral", "positive"] and metrics["val_examples"] == 12
    assert metrics["val_accuracy"] == metrics["best_val_accuracy"]
    scored = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracies = [(r["step"], r["val_accuracy"]) for r in scored if "val_accuracy" in r]
    assert [step for step, _ in accuracies] == [3, 6] and metrics["best_val_accuracy"] == max(a for _, a in accuracies)
    best_step = pf.load_checkpoint(out / "best").trainer_state["step"]
    assert best_step == next(step for step, a in accuracies if a == metrics["best_val_accuracy"])
    assert pf.load_model(out).config.label_names == ("negative", "neutral", "positive")
    assert (out / "confusion_val.png").read_bytes()[:4] == b"\x89PNG"
    code, lines, _ = run_cli(capsys, "eval", "--ckpt", str(out))
    evaluation = json.loads(lines[-1])
    assert code == 0 and evaluation["accuracy"] == metrics["val_accuracy"]
    assert evaluation["confusion_matrix"] == metrics["val_confusion_matrix"] and evaluation["examples"] == 12
    assert evaluation["mcc"] == pytest.approx(metrics["val_mcc"], abs=1e-12)
    code, lines, _ = run_cli(capsys, "eval", "--ckpt", str(out), "--data", str(data["other"]))
    other = json.loads(lines[-1])
    assert code == 0 and other["examples"] == 9 and sum(map(sum, other["confusion_matrix"])) == 9
    assert other["data"] == "other" and Path(other["confusion_png"]) == out / "confusion_other.png"


def test_the_export_runs_in_transformers_pipeline_with_our_labels_and_probabilities(capsys, run, tmp_path):
    out, _ = run
    code, lines, _ = run_cli(capsys, "export", "--ckpt", str(out), "--out", str(tmp_path / "hf"))
    assert code == 0 and json.loads(lines[-1])["architecture"] == "BertForSequenceClassification"
    pipeline = transformers.pipeline("text-classification", model=str(tmp_path / "hf"), top_k=None)
    code, lines, _ = run_cli(capsys, "classify", "--ckpt", str(out), "--json", *TEXTS)
    assert code == 0
    for ours, theirs in zip(map(json.loads, lines), pipeline(TEXTS), strict=True):
        by_label = {entry["label"]: entry["score"] for entry in theirs}
        assert set(by_label) == set(ours["probabilities"])
        assert max(by_label, key=by_label.get) == ours["label"]
        assert all(abs(by_label[label] - p) <= 1e-5 for label, p in ours["probabilities"].items())


def test_a_hugging_face_classifier_classifies_evaluates_and_fine_tunes_on_with_its_head(capsys, data, tmp_path):
    hf = tiny_hf_bert(tmp_path / "hf", id2label=dict(enumerate(WORDS)), seed=5)
    model = pf.load_model(hf)
    assert model.family == "bert-cls" and model.config.label_names == tuple(WORDS)
    code, lines, _ = run_cli(capsys, "eval", "--ckpt", str(hf), "--data", str(data["val"]))
    evaluation = json.loads(lines[-1])
    assert code == 0 and evaluation["examples"] == 12 and evaluation["confusion_png"] is None
    assert not any(path.suffix == ".png" for path in hf.iterdir())  # nothing written into the model's directory
    code, lines, err = run_cli(capsys, "finetune", "--init", str(hf), "--data", str(data["train"]), "--val-data",
                               str(data["val"]), "--out", str(tmp_path / "more"), "--max-steps", "1", *TRAINING,
                               "--lr", "1e-12", "--eval-interval", "1")
    assert code == 0 and "its head trains on" in err
    tuned = pf.load_model(tmp_path / "more")
    assert torch.allclose(tuned.classifier.weight, model.classifier.weight, atol=1e-6)  # the head came along


def test_a_lora_classifier_exports_an_adapter_peft_loads_with_equal_logits(capsys, base, data, tmp_path):
    metrics = finetune(capsys, base, data, tmp_path / "lora", "--lora-r", "2", "--lr", "1e-2")
    assert metrics["trainable_parameters"] < metrics["parameters"] / 10
    code, _, _ = run_cli(capsys, "export", "--ckpt", str(tmp_path / "lora"), "--adapter", "--out",
                         str(tmp_path / "adapter"))
    assert code == 0 and json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["task_type"] == "SEQ_CLS"
    ours = pf.load_model(tmp_path / "lora")
    peft = pytest.importorskip("peft")
    hf_base = transformers.BertForSequenceClassification.from_pretrained(base, num_labels=3).eval()
    theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    tokenizer = transformers.BertTokenizerFast.from_pretrained(base)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        assert (ours(**batch)[0] - theirs(**batch).logits).abs().max() <= 1e-5
    assert torch.allclose(class_probabilities(ours, TEXTS), theirs(**batch).logits.softmax(-1), atol=1e-5)


def test_sentence_pairs_train_and_classify(capsys, base, tmp_path):
    rows = [(f"is it {a}", f"it is {b}", "same" if a == b else "other") for a in ("red", "blue", "green")
            for b in ("red", "blue", "green")] * 3
    train = _tsv(tmp_path / "pairs.tsv", rows, header="first\tsecond\tlabel")
    code, lines, err = run_cli(capsys, "finetune", "--init", str(base), "--data", str(train), "--text-field", "first",
                               "--text-pair-field", "second", "--out", str(tmp_path / "pairs"), "--max-steps", "2",
                               *TRAINING)
    assert code == 0, err
    assert json.loads(lines[-1])["classes"] == ["other", "same"]
    (tmp_path / "in.txt").write_text("is it red\tit is red\nis it red\tit is blue\n")
    code, lines, _ = run_cli(capsys, "classify", "--ckpt", str(tmp_path / "pairs"), "--input", str(tmp_path / "in.txt"))
    assert code == 0 and len(lines) == 2 and all(line.split("\t")[0] in ("other", "same") for line in lines)


@pytest.mark.parametrize("train, val, extra, message", [
    ("sentence\tlabel\ngood\t1\nbad\t\n", None, [], "train.tsv:3: no label (field 'label' is empty)"),
    ("sentence\tlabel\ngood\t1\n\t0\n", None, [], "train.tsv:3: no text (field 'sentence' is empty)"),
    ("sentence\tlabel\ngood\t1\nbad\t0\tx\n", None, [], "train.tsv:3: 3 fields, the header has 2"),
    ("sentence\tlabel\ngood\t1\nbad\t1\nfine\t1\n", None, [], "field 'label' holds one class, '1'"),
    ("sentence\tlabel\ngood\t1\nbad\t0\n", "sentence\tlabel\nok\t1\nmeh\t2\n", [],
     "val.tsv:3: label '2' is not among the labels of the training data"),
    ("sentence\tlabel\ngood\t1\nbad\t0\n", None, ["--label-field", "stars"], "has no field 'stars', the label"),
    ("sentence\tlabel\ngood\t1\nbad\t0\n", None, ["--plays", "Macbeth", "Hamlet"], "--plays chooses the built-in"),
])
def test_bad_labelled_data_is_refused_in_one_line_with_nothing_written(capsys, base, tmp_path, train, val, extra,
                                                                      message):
    (tmp_path / "train.tsv").write_text(train)
    given = []
    if val is not None:
        (tmp_path / "val.tsv").write_text(val)
        given = ["--val-data", str(tmp_path / "val.tsv")]
    code, lines, err = run_cli(capsys, "finetune", "--init", str(base), "--data", str(tmp_path / "train.tsv"),
                               *given, "--out", str(tmp_path / "run"), *extra, *TRAINING)
    assert code == 2 and lines == [] and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_slice_of_sst2_is_learnt_in_seconds_above_70_percent(capsys, tmp_path):
    """MiniLM fine-tuned on 640 SST-2 phrases (40 steps of 16, about 25 s on one core) scores above 70% on 200
    sentences of GLUE's dev set, whose majority class is 51% of them; it reached 78% when this was written."""
    sst2 = shared_data("sst2")
    train = tmp_path / "train.tsv"
    train.write_text("".join((sst2 / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)[:2001]))
    dev = tmp_path / "dev.tsv"
    dev.write_text("".join((sst2 / "glue_dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)[:201]))
    code, lines, err = run_cli(capsys, "finetune", "--preset", "sst2", "--data", str(train), "--val-data", str(dev),
                               "--out", str(tmp_path / "sst2"), "--max-steps", "40", "--batch-size", "16", "--lr",
                               "3e-4", "--warmup-steps", "4", "--dropout", "0", "--attention-dropout", "0",
                               "--no-fit-to-time", "--no-progress")
    assert code == 0, err
    metrics = json.loads(lines[-1])
    assert metrics["val_accuracy"] > 0.70 and metrics["majority_baseline"] < 0.55


def test_a_classifier_run_resumes_with_its_classes_and_best_accuracy(capsys, base, data, tmp_path):
    finetune(capsys, base, data, tmp_path / "run", "--max-steps", "3", "--save-interval", "3", "--decay-steps", "6")
    first_best = pf.load_checkpoint(tmp_path / "run" / "best").trainer_state["best_score"]
    metrics = finetune(capsys, base, data, tmp_path / "run", "--resume", "--decay-steps", "6")
    assert metrics["step"] == 6 and metrics["best_val_accuracy"] >= first_best
    assert metrics["classes"] == ["negative", "neutral", "positive"]
