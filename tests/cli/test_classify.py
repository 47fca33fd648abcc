"""`plainformer classify` on a Hugging Face BertForSequenceClassification built locally: the label and its
probability per text, in input order, every class's probability with --json (equal to transformers' softmax),
TEXT, --input or stdin, sentence pairs on tab-separated lines, and the mistakes refused in one line."""

from __future__ import annotations

import io
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from plainformer.cli import main
from tests.reference.tiny_models import tiny_hf_bert

CLASSES = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["a gripping , funny film", "dull", "the quick brown fox jumps over the lazy dog " * 3, "ok .", "meh"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return tiny_hf_bert(tmp_path_factory.mktemp("classifier"), id2label=CLASSES, seed=3)


def _reference(directory, texts, pairs=None):
    tokenizer = transformers.BertTokenizerFast.from_pretrained(directory)
    model = transformers.BertForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(**tokenizer(texts, pairs, padding=True, return_tensors="pt")).logits.softmax(dim=-1)


def _classify(capsys, *argv):
    code = main(["classify", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_json_lines_hold_every_class_probability_of_transformers_in_input_order(capsys, classifier):
    code, lines, err = _classify(capsys, "--ckpt", str(classifier), "--json", "--batch-size", "2", *TEXTS)
    assert code == 0 and len(lines) == len(TEXTS)
    expected = _reference(classifier, TEXTS)
    for line, probabilities in zip(lines, expected, strict=True):
        record = json.loads(line)
        assert list(record["probabilities"]) == list(CLASSES.values())
        assert torch.allclose(torch.tensor(list(record["probabilities"].values())), probabilities, atol=1e-5)
        assert record["label"] == CLASSES[int(probabilities.argmax())]
        assert record["probability"] == pytest.approx(float(probabilities.max()), abs=1e-5)
    metrics = json.loads(err.strip().splitlines()[-1])
    assert metrics["texts"] == len(TEXTS) and metrics["classes"] == list(CLASSES.values())


def test_plain_lines_are_the_label_and_its_probability_and_stdin_and_input_give_the_same(capsys, classifier,
                                                                                       monkeypatch, tmp_path):
    code, lines, _ = _classify(capsys, "--ckpt", str(classifier), *TEXTS)
    expected = _reference(classifier, TEXTS)
    assert code == 0 and [line.split("\t") for line in lines] == [
        [CLASSES[int(p.argmax())], f"{float(p.max()):.4f}"] for p in expected]
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    code, from_file, _ = _classify(capsys, "--ckpt", str(classifier), "--input", str(tmp_path / "texts.txt"))
    assert code == 0 and from_file == lines
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\n".join(TEXTS).encode())))
    code, from_stdin, _ = _classify(capsys, "--ckpt", str(classifier))
    assert code == 0 and from_stdin == lines


def test_tab_separated_lines_are_sentence_pairs(capsys, classifier, tmp_path):
    first, second = TEXTS[:3], ["yes", "no , not at all", "perhaps"]
    (tmp_path / "pairs.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in zip(first, second, strict=True)))
    code, lines, _ = _classify(capsys, "--ckpt", str(classifier), "--json", "--input", str(tmp_path / "pairs.tsv"))
    expected = _reference(classifier, first, second)
    got = torch.tensor([list(json.loads(line)["probabilities"].values()) for line in lines])
    assert code == 0 and torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("argv, stdin, message", [
    (["--input", "{tmp}/texts.txt", "a text"], "", "give TEXT or --input FILE, not both"),
    ([], "", "no text to classify"),
    ([], "a\tb\nsingle\n", "line 1 is a tab-separated pair, line 2 a single text"),
    (["--input", "{tmp}/absent.txt"], "", "--input {tmp}/absent.txt: no such file"),
])
def test_mistakes_are_one_line(capsys, classifier, monkeypatch, tmp_path, argv, stdin, message):
    (tmp_path / "texts.txt").write_text("x\n")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    code, lines, err = _classify(capsys, "--ckpt", str(classifier), *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and lines == [] and message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_a_model_that_is_no_classifier_is_refused(capsys, tmp_path):
    code, lines, err = _classify(capsys, "--ckpt", str(tiny_hf_bert(tmp_path / "encoder")), "text")
    assert code == 2 and lines == [] and "holds a BertModel, not a sequence classifier" in err
