"""Tests for plainformer.training.trainer: schedules, AdamW groups, exact resume, Ctrl-C, bf16, time budget."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plainformer as pf
from plainformer.checkpoint.average import kept_checkpoints
from plainformer.checkpoint.format import CheckpointError, load_checkpoint
from plainformer.config import Config
from plainformer.files.run_lock import RunDirectoryBusy
from plainformer.training.config import TrainConfig
from plainformer.training.evaluation import Selection
from plainformer.training.optim import lr_at, make_optimizer, parameter_groups
from plainformer.training.trainer import Trainer, TrainingInterrupted

VOCAB, SEQ = 13, 8


@dataclasses.dataclass
class TinyConfig(Config):
    vocab_size: int = VOCAB
    d_model: int = 8
    d_ff: int = 16
    dropout: float = 0.1


class TinyLM(nn.Module):
    """Embedding -> 2-layer MLP -> LayerNorm -> output tied to the embedding; dropout in between."""

    family = "tiny-lm"

    def __init__(self, config: TinyConfig | None = None):
        super().__init__()
        self.config = config = config if config is not None else TinyConfig()
        self.emb = nn.Embedding(config.vocab_size, config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets=None):
        x = self.emb(idx)                                          # (B, T, d)
        x = x + self.fc2(self.drop(F.gelu(self.fc1(x))))
        logits = self.head(self.norm(x))                           # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class CountingTokens:
    """Deterministic in (seed, split, index): rows start at a random token and count up mod VOCAB,
    so the next token is learnable."""

    def __init__(self, seed: int = 0, sigint_at: int | None = None, delay_s: float = 0.0):
        self.seed, self.sigint_at, self.delay_s = seed, sigint_at, delay_s

    def get_batch(self, split, index, batch_size):
        if index == self.sigint_at and split == "train":
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 2 * index + (split == "val"))
        start = torch.randint(VOCAB, (batch_size, 1), generator=g)
        x = (start + torch.arange(SEQ + 1)) % VOCAB                # (B, T+1)
        return {"idx": x[:, :-1], "targets": x[:, 1:]}


def small_config(**overrides) -> TrainConfig:
    values = dict(max_steps=8, batch_size=4, grad_accum_steps=2, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                  eval_interval=3, eval_batches=2, log_interval=1, save_interval=0, seed=7,
                  dtype="float32")  # not "auto": the same arithmetic on every machine
    return TrainConfig(**{**values, **overrides})


def fresh_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def train(out_dir, source=None, *, resume=False, model=None, **overrides):
    model = model or fresh_model()
    trainer = Trainer(model, source or CountingTokens(), small_config(**overrides), out_dir,
                      resume=resume, progress=False)
    return trainer, trainer.fit()


def read_metrics(out_dir, key):
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in lines if key in r]


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


# ----------------------------------------------------------------------------- schedules

def test_cosine_warms_up_linearly_then_decays_to_min_lr():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)        # halfway: cos(π/2) = 0
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(85, cfg) == pytest.approx(1e-4 + 0.45e-3 * (1 + math.cos(0.75 * math.pi)))


def test_cosine_reaches_min_lr_at_decay_steps_and_stays_there():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0, max_steps=200, decay_steps=100)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(150, cfg) == pytest.approx(1e-4)


def test_linear_schedule_falls_in_a_straight_line_to_min_lr_at_decay_steps():
    cfg = TrainConfig(schedule="linear", lr=1e-3, min_lr=0.0, warmup_steps=10, max_steps=200, decay_steps=110)
    assert [lr_at(t, cfg) for t in (5, 10, 35, 60, 110, 150)] == pytest.approx([5e-4, 1e-3, 7.5e-4, 5e-4, 0, 0])
    assert lr_at(85, cfg.replace(min_lr=1e-4)) == pytest.approx(1e-4 + 0.9e-3 * 0.25)


def test_constant_schedule_holds_lr_after_warmup():
    cfg = TrainConfig(schedule="constant", lr=3e-4, warmup_steps=4)
    assert [lr_at(t, cfg) for t in (1, 4, 5, 1000)] == pytest.approx([0.75e-4, 3e-4, 3e-4, 3e-4])


def test_inverse_sqrt_matches_the_paper_formula_computed_by_hand():
    # lrate = 512^-0.5 * min(t^-0.5, t * 4000^-1.5), values worked out to 10 digits with a calculator.
    cfg = TrainConfig.from_preset("transformer-paper")
    assert lr_at(1, cfg) == pytest.approx(1.746928107e-07, rel=1e-9)
    assert lr_at(1000, cfg) == pytest.approx(1.746928107e-04, rel=1e-9)
    assert lr_at(4000, cfg) == pytest.approx(6.987712429e-04, rel=1e-9)
    assert lr_at(16000, cfg) == pytest.approx(3.493856215e-04, rel=1e-9)
    assert lr_at(8000, cfg.replace(lr=2.0)) == pytest.approx(2 * 4.941058844e-04, rel=1e-9)


@pytest.mark.parametrize("bad, field", [
    (dict(schedule="step"), "schedule"), (dict(batch_size=0), "batch_size"),
    (dict(min_lr=1.0, lr=0.1), "min_lr"), (dict(schedule="inverse_sqrt"), "schedule_d_model"),
    (dict(dtype="float16"), "dtype"), (dict(beta2=1.0), "beta2"), (dict(max_time=0), "max_time"),
    (dict(decay_steps=50, warmup_steps=100), "decay_steps"), (dict(fit_to_time=True), "fit_to_time"),
])
def test_invalid_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**bad)


# ----------------------------------------------------------------------------- optimizer

def test_no_weight_decay_on_biases_norms_and_embeddings():
    model = fresh_model()
    decay, no_decay = parameter_groups(model)
    assert {id(p) for p in decay} == {id(model.fc1.weight), id(model.fc2.weight)}
    assert {id(p) for p in no_decay} == {id(p) for p in model.parameters()} - {id(p) for p in decay}

    # With zero gradients AdamW only decays: decayed weights shrink by (1 - lr·wd), the rest stay put.
    cfg = TrainConfig(lr=0.5, weight_decay=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = make_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 0.5 * 0.1 if name in ("fc1.weight", "fc2.weight") else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- the loop

def test_resume_gives_the_same_losses_and_bit_identical_weights(tmp_path):
    reference, _ = train(tmp_path / "a", max_steps=8)
    train(tmp_path / "b", max_steps=4, decay_steps=8)
    resumed, metrics = train(tmp_path / "b", resume=True, model=fresh_model(seed=99),
                             max_steps=8, decay_steps=8)
    assert metrics["step"] == 8 and resumed.data_position == 16
    assert read_metrics(tmp_path / "b", "train_loss") == read_metrics(tmp_path / "a", "train_loss")
    assert len(read_metrics(tmp_path / "b", "train_loss")) == 8
    assert_same_weights(resumed.model, reference.model)
    for s, t in zip(resumed.optimizer.state.values(), reference.optimizer.state.values(), strict=True):
        assert all(torch.equal(s[k], t[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_sigint_finishes_the_step_saves_last_and_resume_continues_exactly(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        train(tmp_path / "run", CountingTokens(sigint_at=5), max_steps=6)   # index 5: 2nd half of step 3
    assert signal.getsignal(signal.SIGINT) is before
    assert info.value.step == 3 and info.value.checkpoint == tmp_path / "run" / "last"
    state = load_checkpoint(tmp_path / "run" / "last").trainer_state
    assert (state["step"], state["data_position"]) == (3, 6)

    resumed, _ = train(tmp_path / "run", resume=True, max_steps=6)
    reference, _ = train(tmp_path / "ref", max_steps=6)
    assert_same_weights(resumed.model, reference.model)
    assert read_metrics(tmp_path / "run", "train_loss") == read_metrics(tmp_path / "ref", "train_loss")


def test_sigint_before_the_first_log_line_still_records_the_loss_and_plots(tmp_path):
    with pytest.raises(TrainingInterrupted):
        train(tmp_path, CountingTokens(sigint_at=0), log_interval=10)
    assert [step for step, _ in read_metrics(tmp_path, "train_loss")] == [1]
    assert (tmp_path / "loss.png").exists()
    assert load_checkpoint(tmp_path / "last").trainer_state["train_loss"] is not None


def test_bf16_autocast_runs_matmuls_in_bfloat16_with_a_finite_loss(tmp_path):
    model = fresh_model()
    seen = []
    model.fc1.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    _, metrics = train(tmp_path, model=model, dtype="bfloat16", max_steps=2)
    assert seen and set(seen) == {torch.bfloat16}
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["val_loss"])
    assert model.fc1.weight.dtype == torch.float32


def test_max_time_stops_early_and_counts_time_spent_before_resume(tmp_path):
    slow = CountingTokens(delay_s=0.02)
    _, metrics = train(tmp_path, slow, max_steps=1000, max_time=0.15)
    assert metrics["stopped_by"] == "max_time" and 1 <= metrics["step"] < 1000
    assert metrics["elapsed_s"] >= 0.15
    _, again = train(tmp_path, slow, resume=True, max_steps=1000, max_time=0.15)
    assert again["step"] == metrics["step"]
    _, longer = train(tmp_path, slow, resume=True, max_steps=metrics["step"] + 2, max_time=100.0)
    assert longer["step"] == metrics["step"] + 2 and longer["stopped_by"] == "max_steps"


def test_fit_to_time_plans_steps_that_end_by_max_time_with_the_schedule_annealed(tmp_path):
    slow = CountingTokens(delay_s=0.01)  # about 20 ms per step (two micro-batches): a slow machine
    fitted = dict(max_steps=100_000, max_time=1.5, fit_to_time=True, warmup_steps=20, eval_interval=25)
    _, metrics = train(tmp_path, slow, **fitted)
    assert metrics["stopped_by"] == "max_steps"  # the plan ended the run before the hard stop
    assert 30 < metrics["step"] < 150 and read_metrics(tmp_path, "elapsed_s")[-1][1] < 1.5  # before loss.png
    assert read_metrics(tmp_path, "lr")[-1] == (metrics["step"], pytest.approx(small_config().min_lr))
    state = load_checkpoint(tmp_path / "last").trainer_state
    assert state["planned_steps"] == metrics["step"]
    resumed, again = train(tmp_path, slow, resume=True, **fitted)
    assert resumed.config.max_steps == metrics["step"] and again["step"] == metrics["step"]


def test_fit_to_time_times_an_eighth_of_an_evaluation_and_writes_last_for_its_plan(tmp_path, monkeypatch, capsys):
    model = fresh_model()
    evaluated, saved = [], []
    model.register_forward_hook(lambda module, args, out: evaluated.append(not module.training))
    save = Trainer._save

    def recorded_save(self, name, **kwargs):
        saved.append((name, self.step))
        save(self, name, **kwargs)

    monkeypatch.setattr(Trainer, "_save", recorded_save)
    fitted = dict(max_steps=40, max_time=60.0, fit_to_time=True, warmup_steps=10, eval_interval=0, eval_batches=16)
    _, metrics = train(tmp_path, model=model, **fitted)
    # The plan (at step 11): one untimed batch, then 2 of the 16 timed, and last/ written; at the end the
    # evaluation's 16 batches, best/ and last/.
    assert sum(evaluated) == 1 + 2 + 16
    assert saved == [("last", 11), ("best", metrics["step"]), ("last", metrics["step"])]
    assert read_metrics(tmp_path, "val_loss") == [(metrics["step"], pytest.approx(metrics["val_loss"]))]
    plan = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("max_steps:"))
    assert float(plan.split(" s per step and ")[1].split()[0]) > 0  # e


class SlowStart(CountingTokens):
    """Training batches take slow_s each for the first `slow_batches`, then fast_s: a machine warming up."""

    def __init__(self, slow_batches: int, slow_s: float, fast_s: float):
        super().__init__()
        self.slow_batches, self.slow_s, self.fast_s, self.served = slow_batches, slow_s, fast_s, 0

    def get_batch(self, split, index, batch_size):
        if split == "train":
            self.delay_s = self.slow_s if self.served < self.slow_batches else self.fast_s
            self.served += 1
        return super().get_batch(split, index, batch_size)


def test_fit_to_time_plans_again_halfway_from_warm_steps(tmp_path, capsys):
    # 11 slow steps (two 30 ms micro-batches each) are all the first plan sees; the second plan, from
    # the steps after it (two 5 ms micro-batches), raises max_steps, and the run goes on past the first.
    fitted = dict(max_steps=100_000, max_time=6.0, fit_to_time=True, warmup_steps=10, eval_interval=0)
    _, metrics = train(tmp_path, SlowStart(slow_batches=22, slow_s=0.03, fast_s=0.005), **fitted)
    plans = [line for line in capsys.readouterr().err.splitlines() if line.startswith("max_steps:")]
    first, second = (int(line.split()[1].rstrip(",")) for line in plans)
    assert len(plans) == 2 and "(planned again)" in plans[1] and second > 2 * first
    assert metrics["step"] > first + 10
    state = load_checkpoint(tmp_path / "last").trainer_state
    assert state["planned_steps"] == second


def test_fit_learns_and_writes_metrics_png_last_and_best(tmp_path):
    _, metrics = train(tmp_path, max_steps=40, eval_interval=10, log_interval=5, lr=3e-2, save_interval=20)
    val = read_metrics(tmp_path, "val_loss")
    assert [step for step, _ in val] == [10, 20, 30, 40]
    assert metrics["val_loss"] < 0.5 * math.log(VOCAB)
    assert metrics["best_val_loss"] == min(loss for _, loss in val)
    assert [step for step, _ in read_metrics(tmp_path, "train_loss")] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert metrics["tokens_per_s"] > 0 and metrics["elapsed_s"] > 0
    seconds = metrics["seconds"]  # the session's wall time by phase, every phase of this run present
    assert set(seconds) == {"steps", "evaluation", "checkpoints", "logging", "plots", "other"}
    assert min(seconds.values()) >= 0 and seconds["steps"] > 0 and seconds["evaluation"] > 0
    assert sum(seconds.values()) == pytest.approx(metrics["elapsed_s"], abs=0.05)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last, best = load_checkpoint(tmp_path / "last"), load_checkpoint(tmp_path / "best")
    assert last.trainer_state["step"] == 40 and last.has_optimizer_state
    assert best.trainer_state["val_loss"] == metrics["best_val_loss"] and not best.has_optimizer_state
    assert last.family == "tiny-lm" and last.model_config == TinyConfig().to_dict()
    assert last.train_config == small_config(max_steps=40, eval_interval=10, log_interval=5, lr=3e-2,
                                             save_interval=20).to_dict()


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_a_selection_keeps_in_best_the_weights_of_its_best_value_not_the_lowest_loss(tmp_path, higher_is_better):
    scores = iter([2.0, 5.0, 1.0, 3.0])  # what the metric reads at steps 10, 20, 30, 40
    seen = []

    def score(model):
        seen.append(model.training or torch.is_grad_enabled())
        return {"metric": next(scores), "other": 0.5}

    selection = Selection(score, "metric", higher_is_better=higher_is_better)
    trainer = Trainer(fresh_model(), CountingTokens(), small_config(max_steps=40, eval_interval=10), tmp_path,
                      progress=False, selection=selection)
    metrics = trainer.fit()
    best_step, best_value = (20, 5.0) if higher_is_better else (30, 1.0)
    assert seen == [False] * 4  # scored in eval mode without autograd
    assert read_metrics(tmp_path, "val_metric") == [(10, 2.0), (20, 5.0), (30, 1.0), (40, 3.0)]
    assert read_metrics(tmp_path, "val_other") == [(step, 0.5) for step in (10, 20, 30, 40)]
    best = load_checkpoint(tmp_path / "best").trainer_state
    assert (best["step"], best["best_score"]) == (best_step, best_value)
    assert metrics["best_val_metric"] == best_value and metrics["val_metric"] == 3.0
    assert metrics["best_val_loss"] == min(loss for _, loss in read_metrics(tmp_path, "val_loss"))


def test_a_resumed_run_keeps_the_selections_best_value(tmp_path):
    values = {10: 5.0, 20: 1.0, 30: 4.0, 40: 2.0}

    def run(max_steps, resume):
        trainer = Trainer(fresh_model(), CountingTokens(), small_config(max_steps=max_steps, eval_interval=10,
                                                                       decay_steps=40), tmp_path,
                          progress=False, resume=resume,
                          selection=Selection(lambda model: {"m": values[trainer.step]}, "m"))
        return trainer.fit()

    run(20, False)
    metrics = run(40, True)
    assert metrics["best_val_m"] == 5.0 and load_checkpoint(tmp_path / "best").trainer_state["step"] == 10


def test_keep_checkpoints_keeps_the_weights_of_the_last_saves(tmp_path):
    trainer, _ = train(tmp_path, max_steps=9, save_interval=2, keep_checkpoints=3)
    kept = kept_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step-0000006", "step-0000008", "step-0000009"]  # 9: the save at the end
    last = load_checkpoint(tmp_path / "last")
    assert torch.equal(load_checkpoint(kept[-1]).state_dict["emb.weight"], last.state_dict["emb.weight"])
    assert not load_checkpoint(kept[0]).has_optimizer_state


def test_flash_attention_with_dropout_is_refused_before_training_starts(tmp_path):
    config = pf.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layers=1, n_heads=2, d_model=8, d_ff=16,
                          backend="flash", dropout=0.1)
    with pytest.raises(ValueError, match=r"blocks\.0\.self_attn has backend='flash'.* and dropout 0\.1: train it"):
        Trainer(pf.GPT(config), CountingTokens(), small_config(), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    Trainer(pf.GPT(config.replace(dropout=0.0)), CountingTokens(), small_config(), tmp_path / "run", progress=False)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    train(tmp_path, max_steps=1)
    other = TinyLM(TinyConfig(d_ff=32))
    with pytest.raises(CheckpointError, match="same model"):
        Trainer(other, CountingTokens(), small_config(), tmp_path, resume=True, progress=False)


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Trainer(fresh_model(), CountingTokens(), small_config(), tmp_path, resume=True, progress=False)


def test_resume_from_a_loaded_checkpoint_reads_and_verifies_it_no_more_and_continues_exactly(tmp_path, monkeypatch):
    from plainformer.checkpoint import format as checkpoint
    from plainformer.training import trainer as trainer_module

    reference, _ = train(tmp_path / "a", max_steps=8)
    train(tmp_path / "b", max_steps=4, decay_steps=8)
    loaded = load_checkpoint(tmp_path / "b" / "last")
    hashed = []
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path))
    monkeypatch.setattr(trainer_module, "load_checkpoint", lambda *a, **k: pytest.fail("read the checkpoint again"))
    trainer = Trainer(fresh_model(seed=99), CountingTokens(), small_config(max_steps=8, decay_steps=8),
                      tmp_path / "b", resume=loaded, progress=False)
    assert hashed == [] and trainer.step == 4
    monkeypatch.undo()
    trainer.fit()
    assert_same_weights(trainer.model, reference.model)
    assert read_metrics(tmp_path / "b", "train_loss") == read_metrics(tmp_path / "a", "train_loss")


def test_resume_from_a_loaded_checkpoint_of_another_family_or_model_is_refused(tmp_path):
    train(tmp_path, max_steps=1)
    loaded = load_checkpoint(tmp_path / "last")
    with pytest.raises(CheckpointError, match=r"holds a 'gpt' model .* not the 'tiny-lm' model .*same model"):
        Trainer(fresh_model(), CountingTokens(), small_config(), tmp_path,
                resume=dataclasses.replace(loaded, family="gpt"), progress=False)
    with pytest.raises(CheckpointError, match="same model"):
        Trainer(TinyLM(TinyConfig(d_ff=32)), CountingTokens(), small_config(), tmp_path, resume=loaded,
                progress=False)


def test_resume_is_a_bool_or_a_loaded_checkpoint(tmp_path):
    with pytest.raises(TypeError, match="resume must be a bool or a loaded Checkpoint, got PosixPath"):
        Trainer(fresh_model(), CountingTokens(), small_config(), tmp_path, resume=tmp_path / "last",
                progress=False)


def test_the_step_clock_stops_only_before_logging_evaluating_or_saving(tmp_path, monkeypatch):
    # Each stop synchronises a CUDA device; between log lines the steps run back to back.
    from plainformer.training.bookkeeping import Stopwatch
    stopped_at, stop = [], Stopwatch.stop

    def counting_stop(watch):
        if watch._since is not None:
            stopped_at.append(current.step)
        stop(watch)

    monkeypatch.setattr(Stopwatch, "stop", counting_stop)
    current = Trainer(fresh_model(), CountingTokens(), small_config(max_steps=12, log_interval=4,
                                                                   eval_interval=6, save_interval=0),
                      tmp_path, progress=False)
    metrics = current.fit()
    assert stopped_at == [1, 4, 6, 8, 12]
    assert metrics["tokens_per_s"] > 0


# ----------------------------------------------------------------------------- hostile conditions

DETERMINISTIC = ("step", "train_loss", "val_loss", "lr", "grad_norm")  # not timings


def logged(out_dir):
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k in DETERMINISTIC} for line in lines]


class CrashingTokens(CountingTokens):
    """Dies like a killed process would: mid-step, with nothing saved since the last save_interval."""

    def __init__(self, crash_at: int):
        super().__init__()
        self.crash_at = crash_at

    def get_batch(self, split, index, batch_size):
        if split == "train" and index == self.crash_at:
            raise SystemExit("killed")
        return super().get_batch(split, index, batch_size)


@pytest.mark.parametrize("crash_at", [5, 8, 11])  # in steps 3, 5 and 6: after the saves at 2 and 4
def test_a_crashed_and_resumed_run_logs_exactly_what_an_uninterrupted_one_does(tmp_path, crash_at):
    options = dict(max_steps=8, log_interval=3, save_interval=2, eval_interval=4)
    train(tmp_path / "reference", **options)
    with pytest.raises(SystemExit):
        train(tmp_path / "run", CrashingTokens(crash_at), **options)
    train(tmp_path / "run", resume=True, **options)
    assert logged(tmp_path / "run") == logged(tmp_path / "reference")
    assert [r["step"] for r in logged(tmp_path / "run") if "train_loss" in r] == [3, 6, 8]


def test_resuming_a_finished_run_logs_nothing_more_and_reports_the_same_losses(tmp_path):
    options = dict(max_steps=5, log_interval=10, save_interval=1, eval_interval=0)
    _, first = train(tmp_path, **options)
    before = (tmp_path / "metrics.jsonl").read_text()
    _, again = train(tmp_path, resume=True, **options)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert [r["step"] for r in logged(tmp_path)] == [5, 5]
    assert {k: again[k] for k in ("step", "train_loss", "val_loss")} == \
        {k: first[k] for k in ("step", "train_loss", "val_loss")}


def test_resume_skips_metrics_lines_that_are_not_records_of_a_step(tmp_path):
    train(tmp_path, max_steps=2)
    before = logged(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"val_loss": 1.0}\n[1, 2]\n{"step": "2"}\n{"step": 1, "train_lo')  # the last: cut by a kill
    train(tmp_path, resume=True, max_steps=4)
    after = logged(tmp_path)
    assert after[:len(before)] == before and [r["step"] for r in after[len(before):]] == [3, 3, 4, 4]


def test_a_failed_metrics_rewrite_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    from plainformer.training.bookkeeping import keep_metrics_until

    train(tmp_path, max_steps=3)
    before = (tmp_path / "metrics.jsonl").read_text()
    write_text = type(tmp_path).write_text

    def failing_write(path, *args, **kwargs):
        write_text(path, "half a li", encoding="utf-8")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", failing_write)
    with pytest.raises(OSError, match=r"the disk is full: could not write the file .*metrics.jsonl"):
        keep_metrics_until(tmp_path / "metrics.jsonl", 2)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".metrics.jsonl")]


@pytest.mark.parametrize("edit, field", [
    (dict(step="3"), "step"), (dict(data_position=-1), "data_position"), (dict(val_loss="low"), "val_loss"),
    (dict(log_window=[1.0, 2]), "log_window"), (dict(evaluated_step=1.5), "evaluated_step"),
])
def test_malformed_trainer_state_is_refused_naming_the_field(tmp_path, edit, field):
    from plainformer.checkpoint import format as checkpoint

    train(tmp_path, max_steps=2)
    path = tmp_path / "last" / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    (tmp_path / "last" / "manifest.json").unlink()
    checkpoint._write_manifest(tmp_path / "last")
    with pytest.raises(CheckpointError, match=rf"trainer_state\.json: {field} malformed"):
        Trainer(fresh_model(), CountingTokens(), small_config(), tmp_path, resume=True, progress=False)


class SecondRun(CountingTokens):
    """Starts a second training on the same directory while the first is in its third micro-batch."""

    def __init__(self, out_dir):
        super().__init__()
        self.out_dir, self.refusal = out_dir, None
        self.model = fresh_model()  # built now: seeding torch mid-run would change the first run's dropout

    def get_batch(self, split, index, batch_size):
        if split == "train" and index == 2 and self.refusal is None:
            with pytest.raises(RunDirectoryBusy) as info:
                train(self.out_dir, model=self.model)
            self.refusal = str(info.value)
        return super().get_batch(split, index, batch_size)


def test_a_second_run_on_the_same_directory_is_refused_and_the_first_is_unharmed(tmp_path):
    source = SecondRun(tmp_path)
    train(tmp_path, source, max_steps=4)
    assert source.refusal.startswith(f"{tmp_path} is in use by another run (pid {os.getpid()})")
    train(tmp_path / "reference", max_steps=4)
    assert logged(tmp_path) == logged(tmp_path / "reference")
    train(tmp_path, resume=True, max_steps=6)  # released once fit returned


@pytest.mark.parametrize("field", ["lr", "eps", "min_lr", "weight_decay", "grad_clip", "max_time"])
@pytest.mark.parametrize("value", [math.inf, math.nan, -math.inf])
def test_non_finite_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be"):
        TrainConfig(**{field: value})


# ----------------------------------------------------------------------------- divergence

class InfLoss(TinyLM):
    """TinyLM whose loss is +inf on batches whose first token is -1 (see `poisoned`)."""

    def forward(self, idx, targets=None):
        poisoned = idx[0, 0] < 0
        logits, loss = super().forward(idx.clamp_min(0), targets)
        return logits, None if loss is None else torch.where(poisoned, torch.tensor(math.inf), loss)


class Poisoned(CountingTokens):
    def __init__(self, from_index: int):
        super().__init__()
        self.from_index = from_index

    def get_batch(self, split, index, batch_size):
        batch = super().get_batch(split, index, batch_size)
        if split == "train" and index >= self.from_index:
            batch["idx"] = batch["idx"].clone()
            batch["idx"][0, 0] = -1
        return batch


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_finite_checkpoint(tmp_path):
    from plainformer.training.trainer import TrainingDiverged

    torch.manual_seed(0)
    trainer = Trainer(InfLoss(), Poisoned(from_index=10), small_config(max_steps=12, save_interval=4), tmp_path,
                      progress=False)
    with pytest.raises(TrainingDiverged, match=r"training diverged at step 6: .*last/ holds step 4"):
        trainer.fit()  # micro-batches 10, 11 are step 6's (2 per step)
    assert load_checkpoint(tmp_path / "last").trainer_state["step"] == 4
    best = load_checkpoint(tmp_path / "best").trainer_state
    assert math.isfinite(best["best_val_loss"]) and best["step"] <= 4


def test_resuming_from_non_finite_weights_is_refused(tmp_path):
    from plainformer.checkpoint.format import save_checkpoint

    train(tmp_path, max_steps=2, save_interval=2)
    saved = load_checkpoint(tmp_path / "last")
    trainer = Trainer(fresh_model(), CountingTokens(), small_config(), tmp_path / "other", progress=False)
    weights = {**saved.state_dict, "fc1.weight": saved.state_dict["fc1.weight"].clone().fill_(math.nan)}
    save_checkpoint(tmp_path / "last", model=weights, family=saved.family, model_config=saved.model_config,
                    train_config=saved.train_config, optimizer=saved.optimizer_state_dict(trainer.optimizer),
                    trainer_state={k: v for k, v in saved.trainer_state.items() if k != "rng"})
    with pytest.raises(CheckpointError, match=r"last holds NaN or infinite weights \(fc1\.weight\)"):
        Trainer(fresh_model(), CountingTokens(), small_config(max_steps=4), tmp_path, resume=True, progress=False)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_run_says_once_what_its_first_step_cost(tmp_path, monkeypatch, capsys, compiled):
    monkeypatch.setattr(torch, "compile", lambda module: module)  # the line, not inductor, is under test
    train(tmp_path, max_steps=3, compile=compiled)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compile: the first step took")]
    assert len(lines) == (1 if compiled else 0)


# ----------------------------------------------------------------------------- best/ by a selection's score

def test_a_selections_loss_is_the_runs_and_replaces_the_trainers_pass(tmp_path):
    model = fresh_model()
    evaluated = []
    model.register_forward_hook(lambda module, args, out: evaluated.append(not module.training))
    trainer = Trainer(model, CountingTokens(), small_config(max_steps=20, eval_interval=10), tmp_path,
                      progress=False, selection=Selection(lambda m: {"loss": 1.5, "score": 0.5}, "score"))
    metrics = trainer.fit()
    assert metrics["val_loss"] == metrics["best_val_loss"] == 1.5 and not any(evaluated)
    assert read_metrics(tmp_path, "val_loss") == [(10, 1.5), (20, 1.5)]


def test_fit_to_time_keeps_the_evaluation_it_times_for_a_selection(tmp_path):
    scores = iter([0.9, 0.1])
    fitted = small_config(max_steps=40, max_time=60.0, fit_to_time=True, warmup_steps=10, eval_interval=0)
    trainer = Trainer(fresh_model(), CountingTokens(), fitted, tmp_path, progress=False,
                      selection=Selection(lambda m: {"score": next(scores)}, "score"))
    metrics = trainer.fit()
    assert read_metrics(tmp_path, "val_score") == [(11, 0.9), (metrics["step"], 0.1)]
    assert load_checkpoint(tmp_path / "best").trainer_state["step"] == 11


def test_a_nan_score_never_improves_on_nothing_or_on_a_number():
    selection = Selection(lambda m: {}, "score")
    assert not selection.improves(math.nan, None) and not selection.improves(math.nan, 0.5)
    assert selection.improves(0.1, None) and not Selection(lambda m: {}, "s", higher_is_better=False).improves(2, 1)
