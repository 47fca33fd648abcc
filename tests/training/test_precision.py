"""Tests for plainformer.training.precision: dtype "auto" resolves by what the hardware multiplies fast and
how wide the model is, and the trainer records the resolved dtype in its log, checkpoint and metrics."""

from __future__ import annotations

import json

import pytest
import torch

from plainformer.checkpoint.format import load_checkpoint
from plainformer.models.bert import BertConfig, BertForMaskedLM
from plainformer.models.gpt import GPT, GPTConfig
from plainformer.training import precision
from plainformer.training.config import TrainConfig
from plainformer.training.precision import MIN_BF16_SPEEDUP, MIN_BF16_WIDTH, model_width, resolve_dtype
from plainformer.training.trainer import Trainer
from tests.training.test_trainer import CountingTokens, TinyConfig, TinyLM, small_config

NO_AMX_SLOW_BF16 = "no AMX on this CPU; bf16 matmuls measured 0.50x fp32's"


@pytest.fixture
def amx(monkeypatch):
    """Set what the CPU probes report: amx(True) or amx(False), and without AMX the measured bf16 / fp32
    matmul speedup (default 0.5: a Xeon's AVX-512-BF16, issue 12)."""
    def set_probes(present: bool, bf16_speedup: float = 0.5) -> None:
        monkeypatch.setattr(precision, "cpu_has_amx", lambda: present)
        monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: bf16_speedup)
    return set_probes


def test_auto_is_float32_on_a_cpu_without_amx_whose_bf16_is_slow(amx):
    amx(False)
    assert resolve_dtype("auto", torch.device("cpu")) == ("float32", NO_AMX_SLOW_BF16)


@pytest.mark.parametrize("speedup, expected", [
    (MIN_BF16_SPEEDUP, ("bfloat16", "no AMX, but bf16 matmuls measured 1.5x fp32's on this CPU")),
    (1.9, ("bfloat16", "no AMX, but bf16 matmuls measured 1.9x fp32's on this CPU")),
    (1.49, ("float32", "no AMX on this CPU; bf16 matmuls measured 1.49x fp32's")),
    (0.01, ("float32", "no AMX on this CPU; bf16 matmuls measured 0.01x fp32's")),
])
def test_auto_without_amx_takes_bfloat16_where_its_matmuls_measure_fast_enough(amx, speedup, expected):
    amx(False, speedup)
    assert resolve_dtype("auto", "cpu") == expected


def test_the_bf16_speedup_is_the_ratio_of_the_measured_rates_taken_once(monkeypatch):
    calls = []

    def rate(dtype, device="cpu", size=1024, seconds=0.1):
        calls.append((dtype, size))
        return {torch.bfloat16: 360e9, torch.float32: 180e9}[dtype]

    monkeypatch.setattr(precision, "matmul_rate", rate)
    precision.cpu_bf16_speedup.cache_clear()
    try:
        assert precision.cpu_bf16_speedup() == 2.0
        assert precision.cpu_bf16_speedup() == 2.0
    finally:
        precision.cpu_bf16_speedup.cache_clear()
    assert calls == [(torch.bfloat16, 256), (torch.float32, 256)]


def test_a_distributed_launch_does_not_measure_and_trains_in_float32_without_amx(amx, monkeypatch):
    amx(False, 1.9)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    why = "no AMX on this CPU; bf16 is not measured in a distributed launch"
    assert resolve_dtype("auto", "cpu") == ("float32", why)
    amx(True)
    assert resolve_dtype("auto", "cpu") == ("bfloat16", "AMX on this CPU")


@pytest.mark.parametrize("shared, expected", [
    (1.9, ("bfloat16", "no AMX, but bf16 matmuls measured 1.9x fp32's on this CPU by rank 0")),
    (0.5, ("float32", "no AMX on this CPU; bf16 matmuls measured 0.50x fp32's by rank 0"))])
def test_a_distributed_launch_takes_rank_zeros_measurement_where_it_is_shared(amx, monkeypatch, shared, expected):
    amx(False, 1.0)  # what this process would measure itself
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    with precision.shared_bf16_speedup(shared):
        assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cpu")[1] == "no AMX on this CPU; bf16 is not measured in a distributed launch"


def test_auto_is_bfloat16_on_a_cpu_with_amx(amx):
    amx(True)
    assert resolve_dtype("auto", "cpu") == ("bfloat16", "AMX on this CPU")


@pytest.mark.parametrize("width, expected", [
    (None, ("bfloat16", "AMX on this CPU")),
    (MIN_BF16_WIDTH, ("bfloat16", "AMX on this CPU")),
    (MIN_BF16_WIDTH - 1, ("float32", f"d_model {MIN_BF16_WIDTH - 1} too narrow for bf16 to pay on a CPU")),
])
def test_auto_keeps_a_narrow_model_in_float32_even_with_amx(amx, width, expected):
    amx(True)
    assert resolve_dtype("auto", "cpu", width) == expected
    assert resolve_dtype("bfloat16", "cpu", width) == ("bfloat16", "as configured")


def test_the_width_is_the_models_d_model():
    assert model_width(GPT(GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=64))) == 64
    assert model_width(BertForMaskedLM(BertConfig(vocab_size=11, n_layers=1, n_heads=2, d_model=32, d_ff=64))) == 32
    assert model_width(torch.nn.Linear(512, 512)) is None


@pytest.mark.parametrize("present", [True, False])
@pytest.mark.parametrize("forced", ["float32", "bfloat16"])
def test_an_explicit_dtype_wins_over_the_probe(amx, present, forced):
    amx(present)
    assert resolve_dtype(forced, "cpu") == (forced, "as configured")


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_cuda_follows_native_bf16_support(monkeypatch, native, expected):
    monkeypatch.setattr(precision, "cuda_has_bf16", lambda device: native)
    assert resolve_dtype("auto", "cuda:0")[0] == expected


def test_auto_is_the_default_dtype():
    assert TrainConfig().dtype == "auto"


@pytest.mark.parametrize("present, d_model, expected, reason", [
    (False, MIN_BF16_WIDTH, "float32", NO_AMX_SLOW_BF16),
    (True, MIN_BF16_WIDTH, "bfloat16", "AMX on this CPU"),
    (True, 8, "float32", "d_model 8 too narrow for bf16 to pay on a CPU"),
])
def test_trainer_logs_checkpoints_and_reports_the_resolved_dtype(tmp_path, amx, capsys, present, d_model, expected,
                                                                 reason):
    amx(present)
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(d_model=d_model))
    seen = []
    model.fc1.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trainer = Trainer(model, CountingTokens(), small_config(dtype="auto", max_steps=2), tmp_path,
                      progress=False)
    metrics = trainer.fit()

    assert set(seen) == {getattr(torch, expected)}
    assert metrics["dtype"] == expected
    assert capsys.readouterr().err.count(f"dtype: {expected} ({reason})") == 1
    for name in ("last", "best"):
        assert load_checkpoint(tmp_path / name).train_config["dtype"] == expected
    assert json.loads((tmp_path / "last" / "config.json").read_text())["train"]["dtype"] == expected


@pytest.fixture
def matmul_rates(monkeypatch):
    """The probe's measured rates, GFLOP/s by dtype, as an AVX2-only AMD measured them."""
    rates = {torch.bfloat16: 1.0e9, torch.float32: 147e9}
    monkeypatch.setattr(precision, "matmul_rate", lambda dtype, device="cpu", size=1024: rates[dtype])


@pytest.mark.parametrize("present, warned", [(False, True), (True, False)])
def test_forced_bfloat16_where_it_is_not_native_warns_once_with_the_measured_slowdown(
        tmp_path, amx, capsys, matmul_rates, present, warned):
    amx(present)
    torch.manual_seed(0)
    trainer = Trainer(TinyLM(TinyConfig(d_model=MIN_BF16_WIDTH)), CountingTokens(),
                      small_config(dtype="bfloat16", max_steps=2), tmp_path, progress=False)
    metrics = trainer.fit()

    assert metrics["dtype"] == "bfloat16" and metrics["step"] == 2  # the run goes on
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: bfloat16")]
    expected = [f"warning: bfloat16 is not native here ({NO_AMX_SLOW_BF16}): its matmuls ran at 1.0 GFLOP/s "
                "against 147 in float32 (147.0x slower); training goes on (--dtype float32 or auto trains in "
                "float32)"]
    assert warnings == (expected if warned else [])


def test_auto_never_warns_about_bfloat16(tmp_path, amx, capsys, matmul_rates):
    amx(False)
    Trainer(TinyLM(TinyConfig(d_model=MIN_BF16_WIDTH)), CountingTokens(), small_config(dtype="auto", max_steps=1),
            tmp_path, progress=False).fit()
    assert "warning" not in capsys.readouterr().err


def test_the_matmul_probe_measures_a_positive_rate_in_each_dtype():
    assert precision.matmul_rate(torch.float32, size=64, seconds=0.01) > 1e6
    assert precision.matmul_rate(torch.float64, size=64, seconds=0.01) > 1e6
