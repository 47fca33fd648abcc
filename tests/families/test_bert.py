"""The BERT command line end to end: embed, search (with its cache), `train --preset bert-pretrain` ->
`finetune` -> `eval` on a tiny model, and the one-line errors."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from plainformer.cli import main
from plainformer.hf.sentence import SentenceEncoder

TINY_MODEL = ["--n-layers", "1", "--n-heads", "2", "--d-model", "16", "--d-ff", "32", "--max-len", "32"]
TINY_TRAINING = ["--batch-size", "4", "--eval-interval", "3", "--eval-batches", "2", "--warmup-steps", "1",
                 "--log-interval", "3", "--no-progress", "--dtype", "float32"]
TEXTS = ["Good night, sweet prince.", "The rest is silence."]


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_pretrained("minilm")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_embed_prints_only_one_array_per_text(capsys, encoder):
    code, lines, err = run_cli(capsys, "embed", *TEXTS)
    assert code == 0 and len(lines) == len(TEXTS)
    printed = torch.tensor([json.loads(line) for line in lines])
    assert torch.allclose(printed, encoder.encode(TEXTS), atol=1e-6)
    assert last_json(err)["dim"] == 384
    code, with_json, _ = run_cli(capsys, "embed", "--json", *TEXTS)
    assert with_json[:-1] == lines and json.loads(with_json[-1])["sentences"] == 2


def test_embed_reads_stdin_lines_and_writes_a_matrix(capsys, monkeypatch, tmp_path, encoder):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("".join(t + "\n" for t in TEXTS).encode())))
    code, lines, err = run_cli(capsys, "embed", "--npy", str(tmp_path / "e.npy"))
    assert code == 0 and lines == []
    assert last_json(err)["sentences"] == 2
    matrix = np.load(tmp_path / "e.npy")
    assert np.allclose(matrix, encoder.encode(TEXTS).numpy(), atol=1e-6)


def test_search_ranks_lines_by_cosine_and_caches_the_corpus(capsys, tmp_path, cache):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The king is dead.\n\nI love you more than words can wield the matter.\n"
                      "Fair is foul, and foul is fair.\nA horse! a horse! my kingdom for a horse!\n")
    code, lines, _ = run_cli(capsys, "search", "--corpus", str(corpus), "--k", "2", "--json",
                             "a horse for my kingdom")
    assert code == 0 and len(lines) == 3
    first = json.loads(lines[-1])
    assert first["results"][0]["line"] == "A horse! a horse! my kingdom for a horse!"
    assert first["results"][0]["score"] >= first["results"][1]["score"]
    assert lines[0].split("\t")[1] == first["results"][0]["line"]
    assert not first["cached"] and first["corpus_lines"] == 4
    assert len(list((cache / "embeddings").glob("*.npy"))) == 1
    code, lines, err = run_cli(capsys, "search", "--corpus", str(corpus), "--k", "2", "a horse for my kingdom")
    assert len(lines) == 2 and lines[0].split("\t")[1] == first["results"][0]["line"]
    second = last_json(err)
    assert second["cached"] and second["results"] == first["results"]
    corpus.write_text("Something is rotten in the state of Denmark.\n")
    code, lines, _ = run_cli(capsys, "search", "--corpus", str(corpus), "--k", "3", "--json", "Denmark")
    assert not json.loads(lines[-1])["cached"] and len(json.loads(lines[-1])["results"]) == 1


@pytest.fixture()
def text_file(tmp_path: Path, cache: Path) -> Path:
    """Four small works separated by two blank lines; the last one becomes the validation split."""
    works = [f"Thou art {word}, and I am thine; the night is {word} and long.\n" * 30
             for word in ("fair", "cold", "dark", "sweet")]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n\n".join(works), encoding="utf-8")
    return path


def test_pretrain_finetune_and_eval_agree_on_their_metrics(capsys, tmp_path, text_file):
    code, lines, _ = run_cli(capsys, "train", "--preset", "bert-pretrain", "--data", str(text_file),
                             "--out", str(tmp_path / "mlm"), "--vocab-size", "60", "--seq-len", "12",
                             "--max-steps", "4", *TINY_MODEL, *TINY_TRAINING)
    assert code == 0
    pretrain = json.loads(lines[-1])
    assert pretrain["step"] == 4 and pretrain["val_mlm_loss"] == pretrain["val_loss"] > 0
    assert (tmp_path / "mlm" / "last" / "tokenizer.json").is_file()
    code, lines, _ = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "mlm" / "last"))
    evaluation = json.loads(lines[-1])
    assert code == 0 and evaluation["batches"] == 2  # the run's eval_batches, seq_len from its recipe
    assert evaluation["val_masked_accuracy"] == pretrain["val_masked_accuracy"]
    assert evaluation["val_mlm_loss"] == pytest.approx(pretrain["val_loss"], abs=1e-6)

    code, lines, _ = run_cli(capsys, "finetune", "--init", str(tmp_path / "mlm"), "--out", str(tmp_path / "cls"),
                             "--max-steps", "3", "--seq-len", "24", "--dropout", "0.2", *TINY_TRAINING)
    assert code == 0
    finetune = json.loads(lines[-1])
    assert finetune["classes"] == ["Macbeth", "A Midsummer Night's Dream"] and finetune["step"] == 3
    correct = finetune["val_accuracy"] * finetune["val_examples"]  # the whole validation set is scored
    assert correct == pytest.approx(round(correct), abs=1e-9)
    assert 0.5 < finetune["majority_baseline"] < 1.0
    code, lines, _ = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "cls" / "last"))
    assert code == 0 and json.loads(lines[-1])["accuracy"] == finetune["val_accuracy"]

    code, lines, _ = run_cli(capsys, "embed", "--model", str(tmp_path / "mlm"), "thou art fair")
    assert code == 0 and len(json.loads(lines[0])) == 16


def test_pretrain_resumed_midway_ends_where_an_uninterrupted_run_does(capsys, tmp_path, text_file):
    def pretrain(out: Path, steps: int, *extra: str) -> dict:
        code, lines, _ = run_cli(capsys, "train", "--preset", "bert-pretrain", "--data", str(text_file),
                                 "--out", str(out), "--vocab-size", "60", "--seq-len", "12",
                                 "--max-steps", str(steps), "--save-interval", "3",
                                 "--decay-steps", "6",  # one schedule for both
                                 *TINY_MODEL, *TINY_TRAINING, *extra)
        assert code == 0
        return json.loads(lines[-1])

    straight = pretrain(tmp_path / "straight", 6)
    pretrain(tmp_path / "resumed", 3)
    resumed = pretrain(tmp_path / "resumed", 6, "--resume")
    assert resumed["step"] == 6
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["val_masked_accuracy"] == straight["val_masked_accuracy"]


@pytest.mark.parametrize("argv, message", [
    (["search", "--corpus", "no/such/file.txt", "query"], "corpus file not found"),
    (["search", "--corpus", "x", "--k", "0", "query"], "--k"),
    (["embed", "--model", "no/such/model", "text"], "no model directory"),
    (["embed", "--npy", "e.txt", "text"], ".npy"),
    (["finetune", "--plays", "Macbeth", "Hamlet II"], "Hamlet II"),
    (["finetune", "--n-layers", "3"], "fine-tuning keeps the shape of --init"),
    (["finetune", "--preset", "bert-pretrain"], "bert-finetune"),
    (["train", "--preset", "bert-pretrain", "--tokenizer", "bpe"], "--tokenizer applies to gpt"),
    (["train", "--preset", "bert-pretrain", "--seq-len", "500"], "--seq-len must be in [3, max_len=128]"),
])
def test_user_errors_print_one_line_and_exit_2(capsys, argv, message):
    code, lines, err = run_cli(capsys, *argv)
    assert code == 2 and lines == []
    assert message in err and "Traceback" not in err
