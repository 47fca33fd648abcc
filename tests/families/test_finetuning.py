"""`plainformer finetune` end to end on tiny models: a trained `default` GPT fine-tuned on another text,
whole or through LoRA (a run that keeps the adapter and a reference to its base); sample, eval,
attention and export from the run; resume; a base that changed; a BERT classifier with LoRA."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

import plainformer as pf
from plainformer.cli import main

TINY_MODEL = ["--n-layers", "1", "--n-heads", "2", "--d-model", "32", "--d-ff", "64", "--block-size", "16"]
TINY_TRAINING = ["--batch-size", "4", "--eval-interval", "3", "--eval-batches", "2", "--warmup-steps", "1",
                 "--log-interval", "3", "--no-progress", "--dtype", "float32"]


def _text(tmp_path: Path, name: str, line: str) -> Path:
    """Five small 'works' separated by two blank lines; the last one becomes the validation split."""
    path = tmp_path / name
    path.write_text("\n\n\n".join(f"{line} {i}.\n" * 20 for i in range(5)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained_base(tmp_path_factory) -> Path:
    """A `default` GPT trained for a few steps on one text, once for the module."""
    tmp = tmp_path_factory.mktemp("trained")
    corpus = _text(tmp, "corpus.txt", "ACT I. To be, or not to be, that is the question")
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()) as err:
        patch.setenv("PLAINFORMER_CACHE", str(tmp / "cache"))
        code = main(["train", "--preset", "default", "--data", str(corpus), "--out", str(tmp / "base"),
                     "--max-steps", "6", "--no-fit-to-time", *TINY_MODEL, *TINY_TRAINING])
    assert code == 0, err.getvalue()
    return tmp / "base"


@pytest.fixture()
def base(trained_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The trained base, a copy of its own in tmp_path/base (a test may train it on or move it); the data cache in
    tmp_path/cache."""
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    return Path(shutil.copytree(trained_base, tmp_path / "base"))


@pytest.fixture()
def other_text(tmp_path: Path) -> Path:
    return _text(tmp_path, "other.txt", "that is not the question. to be, to be, or not")  # the base's characters


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def finetune(capsys, base: Path, data: Path, out: Path, *extra: str) -> dict:
    code, stdout, err = run_cli(capsys, "finetune", "--init", str(base), "--data", str(data), "--out", str(out),
                              "--max-steps", "6", "--lr", "3e-3", *TINY_TRAINING, *extra)
    assert code == 0, err
    return last_json(stdout)


def test_a_lora_run_keeps_only_the_adapter_and_its_model_is_the_base_plus_b_a(capsys, base, other_text, tmp_path):
    metrics = finetune(capsys, base, other_text, tmp_path / "ft", "--lora-r", "4", "--lora-alpha", "8")
    saved = load_file(tmp_path / "ft" / "last" / "model.safetensors")
    assert saved and all(".lora_A" in name or ".lora_B" in name for name in saved)  # no copy of the base
    model, before = pf.load_model(tmp_path / "ft"), pf.load_model(base)
    lora = pf.lora_parameters(model)
    assert metrics["trainable_parameters"] == sum(p.numel() for p in lora) == len(saved) // 2 * 4 * (32 + 32)
    assert metrics["parameters"] == before.num_parameters() + metrics["trainable_parameters"]
    adapted = dict(model.named_parameters())
    for name, weight in before.named_parameters():  # every base weight bit-identical, only B A added
        assert torch.equal(adapted[name], weight), name
    layer = model.blocks[0].self_attn.W_q
    assert layer.scaling == 8 / 4 and layer.lora_B.abs().sum() > 0
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = model(ids)[0]
        pf.merge_lora(model)
        merged = model(ids)[0]
        by_hand = before.blocks[0].self_attn.W_q.weight + 2.0 * layer.lora_B @ layer.lora_A
    torch.testing.assert_close(layer.weight, by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)


def test_sample_eval_attention_and_export_take_a_lora_run(capsys, base, other_text, tmp_path):
    transformers = pytest.importorskip("transformers")
    finetune(capsys, base, other_text, tmp_path / "ft", "--lora-r", "4", "--lora-targets", "W_q,W_k,W_v,W_o,W_1")
    code, stdout, _ = run_cli(capsys, "sample", "--ckpt", str(tmp_path / "ft"), "--prompt", "To be",
                              "--max-new-tokens", "12", "--seed", "3")
    assert code == 0 and stdout.startswith("To be") and len(stdout) > len("To be\n")
    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "ft"))
    evaluation = last_json(stdout)
    assert code == 0 and evaluation["tokens"] > 0 and evaluation["val_loss"] > 0
    code, stdout, _ = run_cli(capsys, "attention", "--ckpt", str(tmp_path / "ft"), "--text", "To be",
                              "--out", str(tmp_path / "a.png"))
    assert code == 0 and (tmp_path / "a.png").is_file()

    code, stdout, _ = run_cli(capsys, "export", "--ckpt", str(tmp_path / "ft"), "--out", str(tmp_path / "hf"))
    assert code == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = pf.load_model(tmp_path / "ft")
    ids = torch.tensor([ours.tokenizer.encode("To be, or not")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids)[0], rtol=0, atol=1e-4)


def test_a_lora_run_resumed_midway_ends_with_the_adapter_of_one_run(capsys, base, other_text, tmp_path):
    lora = ["--lora-r", "2", "--decay-steps", "6", "--save-interval", "3"]
    whole = finetune(capsys, base, other_text, tmp_path / "whole", *lora)
    code, _, _ = run_cli(capsys, "finetune", "--init", str(base), "--data", str(other_text), "--out",
                         str(tmp_path / "split"), "--max-steps", "3", "--lr", "3e-3", *TINY_TRAINING, *lora)
    assert code == 0
    code, stdout, _ = run_cli(capsys, "finetune", "--resume", "--out", str(tmp_path / "split"), "--max-steps", "6",
                              "--no-progress")
    assert code == 0 and last_json(stdout)["val_loss"] == whole["val_loss"]
    one, resumed = (load_file(tmp_path / run / "last" / "model.safetensors") for run in ("whole", "split"))
    assert one.keys() == resumed.keys() and all(torch.equal(one[k], resumed[k]) for k in one)


def test_a_base_that_changed_or_is_gone_is_refused_with_one_line(capsys, base, other_text, tmp_path):
    finetune(capsys, base, other_text, tmp_path / "ft", "--lora-r", "2")
    code, _, _ = run_cli(capsys, "train", "--resume", "--out", str(base), "--max-steps", "9", "--no-progress")
    assert code == 0  # the base trained on: its best/ is another model now
    for argv in (["sample", "--ckpt", str(tmp_path / "ft"), "--prompt", "To"], ["eval", "--ckpt", str(tmp_path / "ft")],
                 ["finetune", "--resume", "--out", str(tmp_path / "ft"), "--max-steps", "8"]):
        code, stdout, err = run_cli(capsys, *argv)
        assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1
        assert "changed since the LoRA adapter" in err and "sha256" in err
    (base / "best").rename(tmp_path / "moved")
    (base / "last").rename(tmp_path / "moved-last")
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "ft"))
    assert code == 2 and "which is missing" in err and len(err.strip().splitlines()) == 1


def test_without_lora_the_whole_gpt_trains_into_a_checkpoint_of_its_own(capsys, base, other_text, tmp_path):
    metrics = finetune(capsys, base, other_text, tmp_path / "full", "--dropout", "0.1")
    assert metrics["trainable_parameters"] == metrics["parameters"] == pf.load_model(base).num_parameters()
    model = pf.GPT.from_checkpoint(tmp_path / "full" / "best")  # a whole model: no base needed
    assert model.config.dropout == 0.1
    assert not torch.equal(model.blocks[0].self_attn.W_q.weight, pf.load_model(base).blocks[0].self_attn.W_q.weight)


def test_a_lora_run_as_init_without_lora_r_fine_tunes_its_merged_model_whole(capsys, base, other_text, tmp_path):
    finetune(capsys, base, other_text, tmp_path / "lora", "--lora-r", "4")
    merged = pf.unload_lora(pf.load_model(tmp_path / "lora"))
    metrics = finetune(capsys, tmp_path / "lora", other_text, tmp_path / "whole")
    assert metrics["trainable_parameters"] == metrics["parameters"] == merged.num_parameters()
    whole = pf.load_model(tmp_path / "whole")
    assert not pf.lora_parameters(whole) and whole.state_dict().keys() == merged.state_dict().keys()
    moved = [name for name, weight in whole.named_parameters() if not torch.equal(weight, merged.get_parameter(name))]
    assert "blocks.0.ff.W_1.weight" in moved  # frozen in the LoRA run, trained here


def test_finetune_picks_the_recipe_of_the_inits_family(capsys, base, other_text, tmp_path):
    finetune(capsys, base, other_text, tmp_path / "ft", "--lora-r", "2")
    assert "preset: gpt-finetune" in (tmp_path / "ft" / "recipe.yaml").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--lora-alpha", "4"], "--lora-alpha sets up LoRA, which --lora-r turns on"),
    (["--lora-r", "2", "--lora-targets", "W_q,W_x"], "'W_x' are not LoRA targets"),
    (["--lora-r", "2", "--lora-targets", "lm_head"], "lm_head.weight is tied to token_embedding.weight"),
    (["--lora-r", "0"], "--lora-r: expected a positive integer"),
    (["--lora-r", "2", "--lora-dropout", "1"], "--lora-dropout: expected a number in [0, 1)"),
    (["--tokenizer", "bpe"], "the tokenizer is --init's"),
    (["--n-layers", "2"], "fine-tuning keeps the shape of --init"),
])
def test_finetune_errors_are_one_line(capsys, base, other_text, extra, message):
    code, stdout, err = run_cli(capsys, "finetune", "--init", str(base), "--data", str(other_text), *extra)
    assert code == 2 and stdout == "" and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["train", "--lora-r", "4"], "--lora-r applies to the fine-tuning recipes"),
    (["finetune", "--preset", "gpt-finetune"], "fine-tunes the model of --init MODEL"),
    (["finetune", "--preset", "default"], "finetune takes gpt-finetune, bert-finetune"),
    (["finetune", "--init", "no/such/dir", "--lora-r", "2"], "--init no/such/dir: no such model directory"),
])
def test_lora_and_init_where_they_do_not_apply_are_one_line(capsys, argv, message):
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 2 and stdout == "" and message in err and "Traceback" not in err


def test_a_bert_classifier_with_lora_trains_the_adapter_and_the_head_only(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    corpus = _text(tmp_path, "corpus.txt", "Good night, sweet prince; the rest is silence")
    tiny_bert = ["--n-layers", "1", "--n-heads", "2", "--d-model", "16", "--d-ff", "32", "--max-len", "32"]
    code, _, _ = run_cli(capsys, "train", "--preset", "bert-pretrain", "--data", str(corpus), "--out",
                         str(tmp_path / "mlm"), "--vocab-size", "60", "--seq-len", "12", "--max-steps", "3",
                         *tiny_bert, *TINY_TRAINING)
    assert code == 0
    code, stdout, _ = run_cli(capsys, "finetune", "--init", str(tmp_path / "mlm"), "--lora-r", "2",
                              "--out", str(tmp_path / "cls"), "--max-steps", "3", "--seq-len", "24", *TINY_TRAINING)
    assert code == 0
    metrics = last_json(stdout)
    saved = load_file(tmp_path / "cls" / "last" / "model.safetensors")
    assert {n for n in saved if ".lora_" not in n} == {"classifier.weight", "classifier.bias"}
    assert metrics["trainable_parameters"] == sum(t.numel() for t in saved.values())
    code, stdout, _ = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "cls"))
    assert code == 0 and last_json(stdout)["accuracy"] == metrics["val_accuracy"]


def test_a_hugging_face_directory_is_a_base_too(capsys, base, other_text, tmp_path):
    code, _, _ = run_cli(capsys, "export", "--ckpt", str(base), "--out", str(tmp_path / "hf"))  # a Llama layout
    assert code == 0
    finetune(capsys, tmp_path / "hf", other_text, tmp_path / "ft", "--lora-r", "2")
    config = json.loads((tmp_path / "ft" / "best" / "config.json").read_text())
    assert config["adapter"]["base"]["path"] == str((tmp_path / "hf").resolve())
    ours, hf_base = pf.load_model(tmp_path / "ft"), pf.load_model(tmp_path / "hf")
    ids = torch.tensor([ours.tokenizer.encode("to be")])
    with torch.no_grad():
        assert not torch.equal(ours(ids)[0], hf_base(ids)[0])  # B trained away from zero
        pf.unload_lora(ours)
    assert ours.state_dict().keys() == hf_base.state_dict().keys()
