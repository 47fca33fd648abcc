"""MoE statistics while training: per-step loads over every micro-batch, the window's metrics by hand,
the trainer's metrics rows and load plot, the router bias in checkpoints (resume bit-exact), and
`plainformer train --preset moe` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import plainformer as pf
from plainformer.cli import main
from plainformer.nn.moe import moe_layers
from plainformer.training.moe_stats import MoEStats, plot_expert_load
from tests.reference.torch_reference import assert_close

VOCAB, SEQ = 13, 8
TINY_MOE = dict(vocab_size=VOCAB, block_size=SEQ, n_layers=2, n_heads=2, d_model=16, d_ff=12,
                pos_encoding="rope", norm="rmsnorm", activation="swiglu", n_experts=4, top_k=2)


def _gpt(seed: int = 0, **overrides) -> pf.GPT:
    torch.manual_seed(seed)
    return pf.GPT(pf.GPTConfig(**{**TINY_MOE, **overrides}))


class CountingTokens:
    """Deterministic in (split, index): rows count up mod VOCAB from a random start."""

    def get_batch(self, split, index, batch_size):
        g = torch.Generator().manual_seed(2 * index + (split == "val"))
        x = (torch.randint(VOCAB, (batch_size, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
        return {"idx": x[:, :-1], "targets": x[:, 1:]}


def _train(out_dir: Path, *, resume: bool = False, model: pf.GPT | None = None, **overrides):
    values = dict(max_steps=6, batch_size=4, grad_accum_steps=2, lr=1e-2, min_lr=1e-3, warmup_steps=1,
                  eval_interval=3, eval_batches=1, log_interval=1, save_interval=0, seed=3, decay_steps=6)
    trainer = pf.Trainer(model or _gpt(bias_update_rate=0.01), CountingTokens(),
                         pf.TrainConfig(**{**values, **overrides}), out_dir, resume=resume, progress=False)
    return trainer, trainer.fit()


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_step_counts_every_micro_batch_once_and_flush_gives_the_window_metrics():
    model = _gpt().train()
    stats = MoEStats(model)
    batch = CountingTokens().get_batch("train", 0, 3)
    for _ in range(2):  # two micro-batches of one optimizer step
        model(**batch)
    layers = moe_layers(model)
    expected_load = torch.stack([layer.step_load.clone() for layer in layers])  # (L, E)
    assert expected_load.sum(dim=1).tolist() == [2 * 3 * SEQ * 2] * 2  # micro-batches · B · n · K
    aux = torch.stack([pf.load_balancing_loss(layer.router_logits, 2) for layer in layers]).mean()
    stats.after_step()
    assert all(layer.step_load.sum() == 0 for layer in layers)  # reset for the next step
    row = stats.flush()
    fractions = expected_load / expected_load.sum(dim=1, keepdim=True)
    assert_close(torch.tensor(row["expert_load"]), fractions)
    violation = max(((f.max() - f.mean()) / f.mean()).item() for f in fractions)
    assert row["max_violation"] == pytest.approx(violation, rel=1e-6)
    assert row["aux_loss"] == pytest.approx(aux.item(), rel=1e-6)
    assert "dropped_tokens" not in row and stats.flush() == {}


def test_dropped_tokens_are_reported_when_a_capacity_is_set():
    model = _gpt(capacity_factor=0.5).train()
    stats = MoEStats(model)
    model(**CountingTokens().get_batch("train", 0, 4))
    dropped = sum(layer.step_dropped for layer in moe_layers(model))
    assert dropped > 0
    stats.after_step()
    assert stats.flush()["dropped_tokens"] == dropped


def test_a_dense_model_has_no_statistics():
    stats = MoEStats(_gpt(n_experts=0))
    stats.after_step()
    assert not stats and stats.flush() == {}


def test_training_rows_carry_the_moe_metrics_and_the_run_plots_the_load(tmp_path):
    trainer, _ = _train(tmp_path)
    rows = [row for row in _rows(tmp_path) if "train_loss" in row]
    assert len(rows) == 6
    for row in rows:
        assert {"aux_loss", "z_loss", "expert_load", "max_violation"} <= set(row)
        assert len(row["expert_load"]) == 2 and all(abs(sum(load) - 1) < 1e-6 for load in row["expert_load"])
    assert (tmp_path / "expert_load.png").is_file() and (tmp_path / "loss.png").is_file()
    biases = [layer.expert_bias for layer in moe_layers(trainer.model)]
    assert any(bias.abs().sum() > 0 for bias in biases)  # a sign-update bias may also oscillate back to 0
    assert all(abs(bias.mean().item()) < 1e-6 for bias in biases)


def test_resume_is_bit_exact_with_the_router_bias(tmp_path):
    reference, _ = _train(tmp_path / "whole")
    _train(tmp_path / "split", max_steps=3)
    resumed, _ = _train(tmp_path / "split", resume=True, model=_gpt(seed=99, bias_update_rate=0.01))
    losses = [[row["train_loss"] for row in _rows(tmp_path / run) if "train_loss" in row] for run in ("whole", "split")]
    assert losses[0] == losses[1]
    for name, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert any("expert_bias" in name for name in reference.model.state_dict())


def test_plot_expert_load_writes_nothing_without_load_rows(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "train_loss": 2.0}) + "\n")
    assert plot_expert_load(metrics, tmp_path / "expert_load.png") is None
    assert not (tmp_path / "expert_load.png").exists()


def test_train_preset_moe_end_to_end(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    works = [f"ACT {i}. To be, or not to be, that is the question {i}.\n" * 20 for i in range(5)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n\n".join(works), encoding="utf-8")
    code = main(["train", "--preset", "moe", "--data", str(text), "--out", str(tmp_path / "run"), "--no-progress",
                 "--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--d-ff", "16", "--block-size", "16",
                 "--batch-size", "4", "--max-steps", "4", "--eval-interval", "2", "--eval-batches", "1",
                 "--warmup-steps", "1", "--log-interval", "2"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["step"] == 4
    rows = [row for row in _rows(tmp_path / "run") if "train_loss" in row]
    assert rows and all(len(row["expert_load"]) == 2 and len(row["expert_load"][0]) == 8 for row in rows)
    assert (tmp_path / "run" / "expert_load.png").is_file()
