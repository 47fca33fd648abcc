"""`plainformer eval` dispatches on the checkpoint's family and refuses flags of other families."""

from __future__ import annotations

import json

import torch
from torch import nn

import plainformer as pf
from plainformer.cli import main


def _run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_an_unknown_family_is_one_clear_error(capsys, tmp_path):
    pf.save_checkpoint(tmp_path / "ckpt", model=nn.Linear(2, 2), family="mystery", model_config={})
    status, out, err = _run(capsys, "eval", "--ckpt", str(tmp_path / "ckpt"))
    assert status == 2 and out == ""
    assert "'mystery'" in err and "gpt" in err and "transformer" in err


def test_gpt_checkpoint_gets_gpt_eval_and_refuses_seq2seq_flags(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("\n\n\n".join(f"work {i}: the quick brown fox.\n" * 20 for i in range(4)))
    data = pf.prepare_lm_data(text)
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=8, n_layers=1, n_heads=2,
                                d_model=16, d_ff=32))
    pf.save_checkpoint(tmp_path / "run" / "best", model=model, family="gpt",
                       model_config=model.config.to_dict(), tokenizer=data.tokenizer)
    status, out, err = _run(capsys, "eval", "--ckpt", str(tmp_path / "run"), "--beam", "4")
    assert status == 2 and out == "" and "--beam applies to transformer" in err
    status, out, _ = _run(capsys, "eval", "--ckpt", str(tmp_path / "run"), "--data", str(text))
    metrics = json.loads(out)
    assert status == 0 and metrics["tokens"] == len(data.val_tokens) - 1


def test_non_finite_weights_are_named_rather_than_printed_as_nan(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("\n\n\n".join(f"work {i}: the quick brown fox.\n" * 20 for i in range(4)))
    data = pf.prepare_lm_data(text)
    model = pf.GPT(pf.GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=8, n_layers=1, n_heads=2,
                                d_model=16, d_ff=32))
    with torch.no_grad():
        model.blocks[0].ff.W_1.weight.fill_(float("nan"))
    pf.save_checkpoint(tmp_path / "run" / "best", model=model, family="gpt",
                       model_config=model.config.to_dict(), tokenizer=data.tokenizer)
    status, out, err = _run(capsys, "eval", "--ckpt", str(tmp_path / "run"), "--data", str(text))
    assert status == 2 and out == "" and "non-finite perplexity, val_loss (NaN or inf)" in err
