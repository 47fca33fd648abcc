"""Tests for plainformer.training.distributed: 2 processes (gloo, loopback) against 1 process.

The reference is one process with batch 2b, the same global batch as 2 processes x batch b; losses
and weights must agree for DDP, DDP with gradient accumulation and FSDP2, after an exact resume at world
size 2 and after a resume of a 2-process checkpoint in 1 process. The two sides differ only in the order
sums are taken (an all-reduce of two halves against one sum), which in fp32 depends on the CPU's kernels
(1.7e-5 apart on an AVX2-only AMD), so every model here is float64 (gloo all-reduces float64 as it is) and
the tolerance is float64's 1e-10.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from safetensors.torch import load_file, save_file

from plainformer.checkpoint.format import load_checkpoint
from plainformer.data.lm import LMBatchSource
from plainformer.models.gpt import GPT, GPTConfig
from plainformer.nn.moe import MoEFeedForward
from plainformer.training import distributed, precision
from plainformer.training.config import TrainConfig
from plainformer.training.distributed import (
    Distributed,
    process_group,
    resolve_parallel,
    torchrun_command,
)
from plainformer.training.precision import resolve_dtype
from plainformer.training.trainer import Trainer

WORLD, B, STEPS, VOCAB, BLOCK = 2, 3, 4, 23, 8
TOL = 1e-10
ROOT = Path(__file__).resolve().parents[2]


def _tiny_gpt(moe: bool = False) -> GPT:
    """With moe: 4 experts, top-1, and a router bias that keeps expert 3 from ever being chosen, so
    that DDP meets an expert without tokens in every step. L_aux is off: it is computed from each
    process's own batch (f_i · P_i is not linear in the rows), so it alone would differ from one
    process's; the z-loss is a mean over tokens and stays exact."""
    torch.manual_seed(0)
    experts = dict(n_experts=4, top_k=1, aux_loss_coef=0.0) if moe else {}
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=2, n_heads=2, d_model=32, d_ff=64,
                          **experts)).double()
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.expert_bias[3] = -1e4
    return model


def _source() -> LMBatchSource:
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4000)
    return LMBatchSource(tokens[:3000], tokens[3000:], BLOCK, seed=0)


def _config(**overrides) -> TrainConfig:
    settings = dict(max_steps=STEPS, batch_size=B, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=STEPS,
                    eval_interval=2, eval_batches=2, log_interval=1, save_interval=0, seed=0,
                    dtype="float32")  # no autocast: the float64 model runs in float64
    return TrainConfig(**{**settings, **overrides})


def _train(out: Path, *, resume: bool = False, moe: bool = False, **overrides) -> Trainer:
    trainer = Trainer(_tiny_gpt(moe), _source(), _config(**overrides), out, progress=False, resume=resume)
    trainer.fit()
    return trainer


# (name, TrainConfig overrides); "_split" runs stop at step 2, are copied, then resume to STEPS.
JOBS = [("ddp", dict(parallel="ddp")), ("ddp_accum", dict(parallel="ddp", grad_accum_steps=2)),
        ("fsdp", dict(parallel="fsdp")), ("fsdp_accum", dict(parallel="fsdp", grad_accum_steps=2)),
        ("ddp_split", dict(parallel="ddp")), ("fsdp_split", dict(parallel="fsdp")),
        ("ddp_moe", dict(parallel="ddp", moe=True)),
        ("ddp_muon", dict(parallel="ddp", optimizer="muon")), ("fsdp_muon", dict(parallel="fsdp", optimizer="muon"))]


def _two_process_worker(rank: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with process_group(timeout_s=60):
        for name, overrides in JOBS:
            out = Path(root) / name
            if name.endswith("_split"):
                _train(out, **{**overrides, "max_steps": 2})
                torch.distributed.barrier()  # rank 0 has written last/
                if rank == 0:
                    shutil.copytree(out, Path(root) / f"{name}_at_2")
                trainer = _train(out, resume=True, **overrides)
            else:
                trainer = _train(out, **overrides)
            next_draw = torch.rand(3)  # what this rank's stream gives after the final save of last/
            # Each rank's own view of the weights (under FSDP: gathered from the shards).
            full = trainer.dist.model_state_dict() if trainer.dist.parallel == "fsdp" else trainer.model.state_dict()
            if full:
                save_file({**{k: v.clone() for k, v in full.items()}, "next_draw": next_draw},
                          out / f"rank{rank}.safetensors")
            torch.distributed.barrier()
        _choose_dtype_auto(rank, Path(root) / "auto")


# bf16 / fp32 matmul rates each rank would measure alone: rank 0 bf16 (at least MIN_BF16_SPEEDUP), rank 1 fp32
BF16_RATES = {0: 1.9, 1: 0.5}


def _measuring(patch: pytest.MonkeyPatch, rank: int) -> None:
    """precision's probe on a CPU without AMX that measures bf16 at BF16_RATES[rank] times fp32's rate
    (the measurement kept until `precision.cpu_bf16_speedup.cache_clear()`)."""
    patch.setattr(precision, "cpu_has_amx", lambda: False)
    patch.setattr(precision, "matmul_rate",
                  lambda dtype, *args, **kwargs: BF16_RATES[rank] if dtype == torch.bfloat16 else 1.0)
    precision.cpu_bf16_speedup.cache_clear()


def _choose_dtype_auto(rank: int, out: Path) -> None:
    """A one-step run with dtype "auto" of a model wide enough for bf16 on a CPU (d_model 128), its
    rank's probe as BF16_RATES says; writes this rank's (dtype, why) to out/dtype{rank}.json."""
    with pytest.MonkeyPatch.context() as patch:
        _measuring(patch, rank)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layers=1, n_heads=2, d_model=128, d_ff=128))
        trainer = Trainer(model, _source(), _config(dtype="auto", max_steps=1, eval_interval=0), out, progress=False)
        trainer.fit()
    precision.cpu_bf16_speedup.cache_clear()
    (out / f"dtype{rank}.json").write_text(json.dumps([trainer.config.dtype, trainer._dtype_reason]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every 2-process run of JOBS, and the 1-process references with batch 2b."""
    root = tmp_path_factory.mktemp("distributed")
    tmp.start_processes(_two_process_worker, args=(_free_port(), str(root)), nprocs=WORLD,
                        start_method="spawn")
    torch.set_num_threads(1)
    _train(root / "ref_muon", batch_size=WORLD * B, optimizer="muon")
    _train(root / "ref", batch_size=WORLD * B)
    _train(root / "ref_accum", batch_size=WORLD * B, grad_accum_steps=2)
    _train(root / "ref_moe", batch_size=WORLD * B, moe=True)
    for name in ("ddp_split", "fsdp_split"):
        _train(root / f"{name}_at_2", resume=True, batch_size=WORLD * B)
    return root


def _losses(run: Path) -> dict[str, list[float]]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {key: [line[key] for line in lines if key in line] for key in ("train_loss", "val_loss")}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "last").state_dict


def _assert_same_run(run: Path, reference: Path) -> None:
    losses, expected = _losses(run), _losses(reference)
    assert len(losses["train_loss"]) == STEPS and len(losses["val_loss"]) == STEPS // 2
    for key in expected:
        np.testing.assert_allclose(losses[key], expected[key], rtol=0, atol=TOL)
    weights, expected_weights = _weights(run), _weights(reference)
    assert weights.keys() == expected_weights.keys()
    for name in expected_weights:
        torch.testing.assert_close(weights[name], expected_weights[name], rtol=0, atol=TOL, msg=name)


def test_two_processes_with_batch_b_match_one_process_with_batch_2b(runs):
    _assert_same_run(runs / "ddp", runs / "ref")


def test_two_processes_match_one_process_with_gradient_accumulation(runs):
    _assert_same_run(runs / "ddp_accum", runs / "ref_accum")


def test_a_moe_model_with_an_expert_that_gets_no_tokens_trains_under_ddp(runs):
    # The experts' weights are stacked (E, ...) parameters, so every one takes part in the
    # reduction even when an expert is empty: no find_unused_parameters needed.
    _assert_same_run(runs / "ddp_moe", runs / "ref_moe")
    loads = [line["expert_load"] for line in map(json.loads, (runs / "ddp_moe" / "metrics.jsonl").open())
             if "expert_load" in line]
    assert loads and all(layer[3] == 0 for step in loads for layer in step)


@pytest.mark.parametrize("run", ["ddp_muon", "fsdp_muon"])
def test_muon_in_two_processes_matches_one_process(runs, run):
    # Under FSDP Newton-Schulz multiplies DTensor shards, gathered where a product needs them.
    _assert_same_run(runs / run, runs / "ref_muon")


@pytest.mark.parametrize("run", ["ddp", "ddp_accum", "ddp_moe", "ddp_muon"])
def test_ddp_ranks_hold_identical_parameters(runs, run):
    rank0, rank1 = (load_file(runs / run / f"rank{r}.safetensors") for r in range(WORLD))
    for name in rank0.keys() - {"next_draw"}:
        assert torch.equal(rank0[name], rank1[name]), name


@pytest.mark.parametrize("fsdp, ddp", [("fsdp", "ddp"), ("fsdp_accum", "ddp_accum")])
def test_fsdp2_matches_ddp(runs, fsdp, ddp):
    _assert_same_run(runs / fsdp, runs / ddp)
    gathered = load_file(runs / fsdp / "rank0.safetensors")
    for name, tensor in load_file(runs / ddp / "rank0.safetensors").items():
        if name == "next_draw":
            continue
        torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=TOL, msg=name)


def test_an_fsdp_checkpoint_stores_a_tied_head_once_as_ddp_does(runs):
    # FSDP gathers a copy per name of the shared parameter; the checkpoint must tie them again.
    stored = {run: load_file(runs / run / "last" / "model.safetensors").keys() for run in ("ddp", "fsdp")}
    assert stored["fsdp"] == stored["ddp"]
    assert "token_embedding.weight" in stored["fsdp"] and "lm_head.weight" not in stored["fsdp"]
    state = load_checkpoint(runs / "fsdp" / "last").state_dict
    assert state["lm_head.weight"] is state["token_embedding.weight"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_resume_at_world_size_two_is_exact(runs, parallel):
    _assert_same_run(runs / f"{parallel}_split", runs / parallel)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_checkpoint_resumes_in_one_process(runs, parallel):
    _assert_same_run(runs / f"{parallel}_split_at_2", runs / "ref")


def test_checkpoint_of_two_processes_holds_every_ranks_rng_state(runs):
    # _at_2 was overwritten by the 1-process resume; the world-size-2 run's last/ is in _split.
    checkpoint = load_checkpoint(runs / "ddp_split" / "last")
    assert checkpoint.trainer_state["world_size"] == WORLD and checkpoint.rng_ranks == WORLD
    draws = [load_file(runs / "ddp_split" / f"rank{r}.safetensors")["next_draw"] for r in range(WORLD)]
    assert not torch.equal(draws[0], draws[1])  # the ranks' streams are seeded apart
    for rank in range(WORLD):
        checkpoint.restore_rng_state(rank)
        assert torch.equal(torch.rand(3), draws[rank]), rank


def test_dtype_auto_is_rank_zeros_choice_on_every_rank_and_the_one_process_choice(runs, monkeypatch):
    try:
        _measuring(monkeypatch, 0)
        alone = list(resolve_dtype("auto", "cpu", 128))
        _measuring(monkeypatch, 1)
        assert resolve_dtype("auto", "cpu", 128)[0] == "float32"  # what rank 1 would choose alone
    finally:
        precision.cpu_bf16_speedup.cache_clear()
    assert alone == ["bfloat16", "no AMX, but bf16 matmuls measured 1.9x fp32's on this CPU"]
    for rank in range(WORLD):
        assert json.loads((runs / "auto" / f"dtype{rank}.json").read_text()) == [alone[0], alone[1] + " by rank 0"]
    assert load_checkpoint(runs / "auto" / "last").train_config["dtype"] == "bfloat16"


def test_only_rank_zero_writes_files(runs):
    assert sorted(p.name for p in (runs / "ddp").iterdir()) == [
        "best", "last", "loss.png", "metrics.jsonl", "rank0.safetensors", "rank1.safetensors"]


# ----------------------------------------------------------------------------- faults


class _FailingSource(LMBatchSource):
    """Rank 1 dies abruptly (no cleanup, like a killed process) or hangs when it reads training batch 2."""

    fault = "dies"

    def get_batch(self, split, index, batch_size):
        if split == "train" and index == 2 and os.environ["RANK"] == "1":
            if self.fault == "dies":
                os._exit(7)
            time.sleep(600)
        return super().get_batch(split, index, batch_size)


def _failing_worker(rank: int, port: int, root: str, fault: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PLAINFORMER_DIST_TIMEOUT="10")
    torch.set_num_threads(1)
    source = _source()
    source.__class__ = _FailingSource
    source.fault = fault
    try:
        Trainer(_tiny_gpt(), source, _config(max_steps=100), root, progress=False).fit()
    except BaseException as error:
        Path(root, f"error{rank}").write_text(f"{type(error).__name__}: {error}")
        raise


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_failed_rank_ends_the_others_with_an_error_within_the_timeout(tmp_path, fault):
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=_failing_worker, args=(r, port, str(tmp_path), fault))
             for r in range(WORLD)]
    for process in ranks:
        process.start()
    ranks[0].join(timeout=90)  # start-up, two steps, then at most the 10 s timeout
    survivor_alive = ranks[0].is_alive()
    for process in ranks:
        process.kill()
        process.join()
    assert not survivor_alive, "rank 0 still waits for the failed rank"
    assert ranks[0].exitcode not in (0, None)
    if fault == "dies":
        assert ranks[1].exitcode == 7
    assert (tmp_path / "error0").read_text() == {  # one line each, which the command prints as it is
        "dies": "RankLost: rank 1 of the 2 stopped (its process has ended), so rank 0 stopped too",
        "hangs": "CollectiveTimeout: rank 0 of the 2 waited 10 s for the others in a collective and stopped (one is "
                 "stuck, or far slower); PLAINFORMER_DIST_TIMEOUT=SECONDS waits longer"}[fault]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads a process's state in /proc")
def test_a_peer_that_closed_the_connection_is_waited_for_through_its_teardown(monkeypatch):
    """A rank that failed closes its sockets when it leaves the process group, then tears the interpreter down for
    seconds: a survivor told by gloo that the peer closed the connection waits for it to end, and names it lost."""
    monkeypatch.setattr(distributed, "LOST_RANK_PATIENCE_S", 0.2)
    here, sigterm = distributed._this_process()[0], signal.getsignal(signal.SIGTERM)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])  # a teardown of 1.5 s
    try:
        processes = [(here, os.getpid()), (here, peer.pid)]
        assert distributed._lost_ranks(processes, 0, RuntimeError("[pair.cc:553] Connection reset")) == []
        closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:28576")
        assert distributed._lost_ranks(processes, 0, closed) == [1]
    finally:
        peer.wait()
        signal.signal(signal.SIGTERM, sigterm)  # _lost_ranks ignores SIGTERM once a rank is lost


# ----------------------------------------------------------------------------- the launch

def test_parallel_resolves_to_ddp_by_default_and_to_none_in_one_process():
    assert resolve_parallel("auto", 4) == "ddp" and resolve_parallel("fsdp", 4) == "fsdp"
    assert resolve_parallel("fsdp", 1) == "none"
    with pytest.raises(ValueError, match="parallel='none' cannot train one model on 4"):
        resolve_parallel("none", 4)
    with pytest.raises(ValueError, match="parallel must be one of"):
        TrainConfig(parallel="zero3")


def test_one_process_is_the_identity():
    job = Distributed("auto")
    model = torch.nn.Linear(2, 2)
    batch = {"x": torch.arange(6).view(3, 2)}
    assert job.wrap(model) is model and job.rows(batch, 3)["x"] is batch["x"]
    assert job.mean(torch.tensor(2.5)).item() == 2.5 and job.any(True) and job.gather(1) == [1]


def test_torchrun_command_runs_plainformer_on_n_local_processes():
    assert torchrun_command(4, ["train", "--max-steps", "2"]) == [
        sys.executable, "-m", "plainformer.training.torchrun", "--standalone", "--nproc-per-node=4",
        "-m", "plainformer", "train", "--max-steps", "2"]
    with pytest.raises(ValueError, match="nproc must be a positive int"):
        torchrun_command(0, [])


def test_train_nproc_starts_torchrun_and_only_rank_zero_prints(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "PLAINFORMER_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    command = [sys.executable, "-m", "plainformer", "train", "--nproc", "2",
               "--out", str(out), "--max-steps", "2", "--batch-size", "2",
               "--block-size", "16", "--n-layers", "1", "--n-heads", "2", "--d-model", "32",
               "--d-ff", "64", "--eval-batches", "1", "--dtype", "float32", "--no-progress",
               "--parallel", "fsdp"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 2  # one JSON line: rank 0's
    assert result.stderr.count("model: GPT") == 1
    state = load_checkpoint(out / "last").trainer_state
    assert state["world_size"] == 2 and state["data_position"] == 2


def _start_training(tmp_path: Path) -> subprocess.Popen:
    """`plainformer train` of a tiny model on 2 ranks for 100,000 steps, through the launcher `--nproc` runs,
    once its first step is logged; its output in tmp_path/stdout and tmp_path/stderr, its run in tmp_path/run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "PLAINFORMER_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    corpus = tmp_path / "corpus.txt"  # small, so that preparing it is no race against the deadline
    corpus.write_text("\n\n\n".join(f"ACT {i}. To be, or not to be, that is the question.\n" * 20 for i in range(5)))
    argv = ["train", "--data", str(corpus), "--out", str(out), "--max-steps", "100000", "--batch-size", "2",
            "--block-size", "16",
            "--n-layers", "1", "--n-heads", "2", "--d-model", "32", "--d-ff", "64", "--eval-batches", "1",
            "--dtype", "float32", "--no-progress", "--log-interval", "1", "--save-interval", "0",
            "--eval-interval", "0"]
    code = f"from plainformer.training.distributed import run_torchrun; raise SystemExit(run_torchrun(2, {argv!r}))"
    # Its own process group stands for the terminal's foreground group that Ctrl-C signals. Its output goes
    # to files, not pipes: nobody reads a pipe while waiting, and a full one would stop the ranks.
    with open(tmp_path / "stdout", "w") as stdout_file, open(tmp_path / "stderr", "w") as stderr_file:
        launcher = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                                    stdout=stdout_file, stderr=stderr_file, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            if launcher.poll() is not None:
                pytest.fail(f"the launcher exited ({launcher.returncode}) before training started:\n"
                            f"{(tmp_path / 'stderr').read_text()[-3000:]}")
            assert time.monotonic() < deadline, "training did not start within 180 s"
            time.sleep(0.5)
    except BaseException:
        _stop(launcher)
        raise
    return launcher


def _stop(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def _rank_pid(tmp_path: Path, rank: int) -> int:
    """The pid of the rank `rank` of `_start_training(tmp_path)`, found by its environment."""
    marker = f"PLAINFORMER_CACHE={tmp_path / 'cache'}".encode()
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # not a process, or not ours
            continue
        if marker in environ and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no process of rank {rank}")


def test_ctrl_c_on_the_launcher_saves_last_once_and_exits_130(tmp_path):
    launcher = _start_training(tmp_path)
    try:
        os.killpg(launcher.pid, signal.SIGINT)
        launcher.wait(timeout=60)
    finally:
        _stop(launcher)
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert launcher.returncode == 130, stderr[-3000:]
    report = json.loads(stdout.splitlines()[-1])
    out = tmp_path / "run"
    assert report["interrupted"] and load_checkpoint(out / "last").trainer_state["step"] == report["step"]
    assert [p.name for p in out.iterdir() if "last" in p.name] == ["last"]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_is_named_in_one_line_by_the_survivor_which_leaves_no_lock(tmp_path):
    launcher = _start_training(tmp_path)
    try:
        os.kill(_rank_pid(tmp_path, 1), signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        _stop(launcher)
    stderr = (tmp_path / "stderr").read_text()
    assert launcher.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.splitlines()[-2:] == [
        "plainformer: error: rank 1 of the 2 stopped (its process has ended), so rank 0 stopped too",  # rank 0's
        "plainformer: error: rank 1 failed (signal SIGKILL); its own output is above"]  # the launcher's
    left = {p.name for p in (tmp_path / "run").iterdir()}  # last/ too where the kill came after a save
    assert ".lock" not in left and not [name for name in left if ".tmp-" in name], left
    assert {"metrics.jsonl", "recipe.yaml"} <= left
