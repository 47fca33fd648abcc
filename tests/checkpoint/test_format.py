"""Tests for plainformer.checkpoint.format: round trips, tied weights, corruption, atomic replacement."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from plainformer.checkpoint import format as checkpoint
from plainformer.checkpoint.format import CheckpointError, load_checkpoint, save_checkpoint
from plainformer.data.tokenizers import CharTokenizer
from plainformer.files import atomic
from plainformer.files.atomic import DiskFullError


class TiedNet(nn.Module):
    """Embedding tied to the output projection, a norm, and a bias: every kind of parameter."""

    def __init__(self, vocab: int = 7, d: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("counter", torch.tensor(3))

    def forward(self, idx):
        return self.head(self.proj(self.norm(self.emb(idx))))


MODEL_CONFIG = {"vocab": 7, "d": 4, "sizes": [1, 2]}


def trained_net(seed: int = 0) -> tuple[TiedNet, torch.optim.AdamW]:
    torch.manual_seed(seed)
    net = TiedNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.98))
    for _ in range(2):
        net(torch.tensor([[1, 2, 3]])).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer


def save(directory, net, optimizer=None, **kwargs):
    return save_checkpoint(directory, model=net, family="tied", model_config=MODEL_CONFIG,
                           train_config={"lr": 1e-2}, optimizer=optimizer, **kwargs)


class ClashingTokenizer:
    def save(self, directory):
        (directory / "config.json").write_text("{}")


# ----------------------------------------------------------------------------- round trips

def test_round_trip_restores_weights_configs_and_trainer_state(tmp_path):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net, trainer_state={"step": 5, "data_position": 10, "best_val_loss": 1.5})
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert (ckpt.family, ckpt.model_config, ckpt.train_config) == ("tied", MODEL_CONFIG, {"lr": 1e-2})
    assert {k: ckpt.trainer_state[k] for k in ("step", "data_position", "best_val_loss")} == \
        {"step": 5, "data_position": 10, "best_val_loss": 1.5}
    other = ckpt.restore_model(TiedNet())
    for (name, p), q in zip(net.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_an_adapter_checkpoint_holds_part_of_a_model_and_loads_only_with_its_names(tmp_path):
    net, _ = trained_net()
    part = {"proj.weight": net.proj.weight, "counter": net.counter}
    adapter = {"lora": {"r": 2}, "base": {"init": "x", "path": "/x", "sha256": "0" * 64}}
    save_checkpoint(tmp_path / "ckpt", model=part, family="tied", model_config=MODEL_CONFIG, adapter=adapter)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.adapter == adapter
    with pytest.raises(CheckpointError, match="holds only the LoRA adapter of a model"):
        loaded.restore_model(TiedNet())
    with pytest.raises(CheckpointError, match=r"missing proj\.bias"):
        loaded.restore_model(TiedNet(), names=["proj.weight", "proj.bias", "counter"])
    fresh = TiedNet()
    loaded.restore_model(fresh, names=["proj.weight", "counter"])
    assert torch.equal(fresh.proj.weight, net.proj.weight)
    assert load_checkpoint(save(tmp_path / "whole", net)).adapter is None


def test_tied_weights_are_stored_once_and_tied_again_after_load(tmp_path):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net)
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(set(net.state_dict()) - {"head.weight"})
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.state_dict["head.weight"] is ckpt.state_dict["emb.weight"]
    other = ckpt.restore_model(TiedNet())
    assert other.head.weight is other.emb.weight
    assert torch.equal(other.head.weight, net.head.weight)


def test_optimizer_state_round_trips_and_continues_identically(tmp_path):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer)
    ckpt = load_checkpoint(tmp_path / "ckpt")
    net2 = ckpt.restore_model(TiedNet())
    optimizer2 = torch.optim.AdamW(net2.parameters(), lr=5.0)
    ckpt.restore_optimizer(optimizer2)
    assert optimizer2.param_groups[0]["betas"] == (0.9, 0.98) and optimizer2.param_groups[0]["lr"] == 1e-2
    for a, b in ((net, optimizer), (net2, optimizer2)):
        a(torch.tensor([[4, 5]])).sum().backward()
        b.step()
    for p, q in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_optimizer_over_other_parameters_is_refused(tmp_path):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer)
    other = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    with pytest.raises(CheckpointError, match="param groups"):
        load_checkpoint(tmp_path / "ckpt").restore_optimizer(other)


def test_rng_states_are_restored_for_torch_python_and_numpy(tmp_path):
    net, _ = trained_net()
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.randn(3), random.random(), np.random.randn(), random.gauss(0, 1)  # mid-stream, gauss cached
    save(tmp_path / "ckpt", net, trainer_state={"step": 0})

    def draw():
        return torch.randn(4).tolist(), [random.random(), random.gauss(0, 1)], np.random.randn(4).tolist()

    expected = draw()
    load_checkpoint(tmp_path / "ckpt").restore_rng_state()
    assert draw() == expected



def test_every_ranks_rng_state_is_restored_by_rank(tmp_path):
    net, optimizer = trained_net()
    states, expected = [], []
    for seed in (5, 6):  # two ranks' streams
        torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
        states.append(checkpoint.capture_rng_state())
        expected.append((torch.randn(3).tolist(), random.random(), np.random.randn()))
    save_checkpoint(tmp_path / "ckpt", model=net.state_dict(), family="tied-net", model_config={},
                    optimizer=optimizer.state_dict(), trainer_state={"step": 0}, rng_states=states)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.rng_ranks == 2
    for rank in (1, 0):
        loaded.restore_rng_state(rank)
        assert (torch.randn(3).tolist(), random.random(), np.random.randn()) == expected[rank]
    with pytest.raises(CheckpointError, match="RNG states of 2 ranks, not of rank 2"):
        loaded.restore_rng_state(2)
    restored = TiedNet()
    loaded.restore_model(restored)  # state dicts saved in place of the modules load the same way
    for name, tensor in net.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2, betas=(0.9, 0.98))
    loaded.restore_optimizer(restored_optimizer)
    for mine, theirs in zip(restored_optimizer.state.values(), optimizer.state.values(), strict=True):
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])

def test_tokenizer_travels_with_the_checkpoint(tmp_path):
    net, _ = trained_net()
    tokenizer = CharTokenizer("to be or not to be")
    save(tmp_path / "ckpt", net, tokenizer=tokenizer)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert "tokenizer.json" in manifest["files"]
    restored = load_checkpoint(tmp_path / "ckpt").load_tokenizer()
    assert restored.encode("not to be") == tokenizer.encode("not to be")
    save(tmp_path / "bare", net)
    with pytest.raises(CheckpointError, match="holds no tokenizer"):
        load_checkpoint(tmp_path / "bare").load_tokenizer()


def test_tokenizer_overwriting_a_checkpoint_file_is_refused(tmp_path):
    net, _ = trained_net()
    with pytest.raises(ValueError, match="config.json"):
        save(tmp_path / "ckpt", net, tokenizer=ClashingTokenizer())
    assert not any(tmp_path.iterdir())


def test_loading_never_unpickles(tmp_path, monkeypatch):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer, trainer_state={"step": 1})

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    ckpt = load_checkpoint(tmp_path / "ckpt")
    ckpt.restore_optimizer(torch.optim.AdamW(ckpt.restore_model(TiedNet()).parameters()))
    ckpt.restore_rng_state()


# ----------------------------------------------------------------------------- damaged checkpoints

def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, verify, message", [
    (lambda d: _truncate(d / "model.safetensors"), True, r"model\.safetensors is truncated"),
    (lambda d: _truncate(d / "model.safetensors"), False, r"model\.safetensors could not be read"),
    (lambda d: _flip_last_byte(d / "model.safetensors"), True, r"model\.safetensors is corrupted"),
    (lambda d: (d / "config.json").write_text("{not json"), True, r"config\.json is (truncated|corrupted)"),
    (lambda d: (d / "config.json").write_text("{not json"), False, r"config\.json is not valid JSON"),
    (lambda d: (d / "config.json").write_text('{"model": {}}'), False,
     r"config\.json lacks 'format_version', 'family'"),
    (lambda d: (d / "model.safetensors").unlink(), True, r"model\.safetensors is missing"),
    (lambda d: (d / "manifest.json").write_text("[1, 2"), True, r"manifest\.json is not valid JSON"),
    (lambda d: (d / "manifest.json").unlink(), True, r"not a plainformer checkpoint: manifest\.json is missing"),
])
def test_damaged_checkpoint_gives_a_clear_error_naming_the_file(tmp_path, damage, verify, message):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer)
    damage(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ckpt", verify=verify)


def test_truncated_optimizer_state_is_a_clear_error_when_restored(tmp_path):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer)
    _truncate(tmp_path / "ckpt" / "optimizer.safetensors")
    ckpt = load_checkpoint(tmp_path / "ckpt", verify=False)
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors could not be read"):
        ckpt.restore_optimizer(optimizer)


def test_missing_path_a_file_and_an_unrelated_directory_are_not_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        load_checkpoint(tmp_path / "file")
    with pytest.raises(CheckpointError, match="not a plainformer checkpoint"):
        load_checkpoint(tmp_path)
    assert issubclass(CheckpointError, ValueError)


def test_checkpoint_from_a_newer_format_is_refused(tmp_path):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net)
    config = tmp_path / "ckpt" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "format_version": 99}))
    with pytest.raises(CheckpointError, match="format_version 99"):
        load_checkpoint(tmp_path / "ckpt", verify=False)


def test_weights_of_another_shape_are_refused(tmp_path):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net)
    with pytest.raises(CheckpointError, match="does not fit TiedNet"):
        load_checkpoint(tmp_path / "ckpt").restore_model(TiedNet(d=6))


# ----------------------------------------------------------------------------- atomicity

def _weights(directory):
    return load_checkpoint(directory).state_dict["proj.weight"]


def saved_old_and_new(tmp_path) -> tuple[TiedNet, TiedNet]:
    """Two nets with different weights; the old one is already saved to tmp_path / "last"."""
    old, _ = trained_net(seed=0)
    new, _ = trained_net(seed=1)
    save(tmp_path / "last", old)
    return old, new


def test_crash_after_writing_the_temp_dir_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    old, new = saved_old_and_new(tmp_path)

    def crash(*args):
        raise RuntimeError("power cut")

    monkeypatch.setattr(atomic, "_fsync_tree", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        save(tmp_path / "last", new)
    assert torch.equal(_weights(tmp_path / "last"), old.proj.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


def test_crash_between_the_renames_is_recovered_from_the_renamed_away_copy(tmp_path, monkeypatch):
    old, new = saved_old_and_new(tmp_path)
    real_rename = os.rename
    calls = []

    def rename_then_crash(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise RuntimeError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename_then_crash)
    with pytest.raises(RuntimeError, match="power cut"):
        save(tmp_path / "last", new)
    monkeypatch.undo()
    assert not (tmp_path / "last").exists()
    with pytest.warns(UserWarning, match="interrupted"):
        assert torch.equal(_weights(tmp_path / "last"), old.proj.weight)

    save(tmp_path / "last", new)
    assert torch.equal(_weights(tmp_path / "last"), new.proj.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


def test_crash_before_deleting_the_old_copy_keeps_the_new_checkpoint(tmp_path, monkeypatch):
    old, new = saved_old_and_new(tmp_path)
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *a, **k: None)  # the deletion never happens
    save(tmp_path / "last", new)
    monkeypatch.undo()
    assert (tmp_path / ".last.old").is_dir()
    assert torch.equal(_weights(tmp_path / "last"), new.proj.weight)
    save(tmp_path / "last", old)
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


# ----------------------------------------------------------------------------- crafted checkpoints

def _rewrite_manifest(directory):
    """What anyone editing a checkpoint can do: make the manifest match the edited files."""
    (directory / "manifest.json").unlink()
    checkpoint._write_manifest(directory)


def _edit_tensors(directory, name, edit, metadata=None):
    path = directory / name
    tensors = checkpoint.load_file(path)
    checkpoint.save_file(edit(dict(tensors)), path, metadata=metadata)
    _rewrite_manifest(directory)


def _edit_json(directory, name, edit):
    path = directory / name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    if name != "manifest.json":
        _rewrite_manifest(directory)


def _renamed(tensors, old, new):
    return {k.replace(old, new, 1) if k.startswith(old) else k: v for k, v in tensors.items()}


def _fused_optimizer(net):
    return torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)


@pytest.mark.parametrize("edit, message", [
    # The crash of issue 14: torch's fused AdamW reads a wrong-shaped exp_avg out of bounds (SIGSEGV).
    (lambda t: {**t, "state.1.exp_avg": torch.zeros(3)}, r"state\.1\.exp_avg has shape \(3,\), expected \(4,\)"),
    (lambda t: {**t, "state.0.exp_avg": t["state.0.exp_avg"].repeat(2, 1)}, r"state\.0\.exp_avg has shape \(14, 4\)"),
    (lambda t: {**t, "state.0.exp_avg": t["state.0.exp_avg"].int()}, r"state\.0\.exp_avg has dtype torch\.int32"),
    (lambda t: {**t, "state.0.exp_avg": t["state.0.exp_avg"].half()}, r"state\.0\.exp_avg has dtype torch\.float16"),
    (lambda t: {**t, "state.2.step": torch.zeros(3)}, r"state\.2\.step must be a float scalar"),
    (lambda t: {**t, "state.2.step": torch.tensor(2)}, r"state\.2\.step must be a float scalar"),
    (lambda t: _renamed(t, "state.0.", "state.9."), r"holds 'state\.9\.exp_avg'.*5 parameters"),
    (lambda t: {**t, "junk": torch.zeros(1)}, r"holds 'junk', which is not 'state\.\{i\}\.\{name\}'"),
    (lambda t: {k: v for k, v in t.items() if k != "state.3.exp_avg_sq"}, r"parameter 3 holds \['exp_avg', 'step'\]"),
    (lambda t: {**t, "state.3.extra": torch.zeros(4, 4)}, r"parameter 3 holds .*'extra'"),
])
def test_crafted_optimizer_state_is_refused_before_torch_sees_it(tmp_path, edit, message):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer)
    _edit_tensors(tmp_path / "ckpt", "optimizer.safetensors", edit)
    fresh = _fused_optimizer(TiedNet())
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ckpt").restore_optimizer(fresh)
    assert not fresh.state  # nothing was loaded


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "param_groups": [{**m["param_groups"][0], "lr": "fast"}]}, r"param group 0, 'lr' is 'fast'"),
    (lambda m: {**m, "param_groups": [{**m["param_groups"][0], "betas": [0.9]}]}, r"'betas' is \[0\.9\]"),
    (lambda m: {**m, "param_groups": [{**m["param_groups"][0], "amsgrad": 1}]}, r"'amsgrad' is 1"),
    (lambda m: {**m, "param_groups": [{**m["param_groups"][0], "params": [0, 0, 1, 2, 3]}]}, "distinct integers"),
    (lambda m: {**m, "param_groups": [{"lr": 1.0}]}, r"param groups of sizes \[None\]"),
    (lambda m: {**m, "scalar_state": {"0": {"step": "x"}}}, r"'scalar_state' entry '0'"),
    (lambda m: {**m, "scalar_state": []}, r"'scalar_state' must be an object"),
])
def test_crafted_optimizer_hyperparameters_are_refused(tmp_path, edit, message):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net, optimizer)
    _edit_json(tmp_path / "ckpt", "optimizer.json", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ckpt").restore_optimizer(_fused_optimizer(TiedNet()))


def test_optimizer_state_restored_into_the_fused_kernel_continues_identically(tmp_path):
    net, _ = trained_net()
    optimizer = _fused_optimizer(net)
    net(torch.tensor([[1, 2]])).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    save(tmp_path / "ckpt", net, optimizer)
    ckpt = load_checkpoint(tmp_path / "ckpt")
    net2 = ckpt.restore_model(TiedNet())
    optimizer2 = _fused_optimizer(net2)
    ckpt.restore_optimizer(optimizer2)
    for a, b in ((net, optimizer), (net2, optimizer2)):
        a(torch.tensor([[4, 5]])).sum().backward()
        b.step()
    for p, q in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("edit, message", [
    (lambda t: {**t, "proj.weight": t["proj.weight"].int()},
     r"proj\.weight has dtype torch\.int32, expected torch\.float32"),
    (lambda t: {**t, "counter": t["counter"].float()}, r"counter has dtype torch\.float32, expected torch\.int64"),
    (lambda t: {**t, "norm.bias": torch.zeros(5)}, r"norm\.bias has shape \(5,\), expected \(4,\)"),
    (lambda t: {k: v for k, v in t.items() if k != "proj.bias"}, r"missing proj\.bias; unexpected none"),
    (lambda t: {**t, "extra": torch.zeros(1)}, r"missing none; unexpected extra"),
])
def test_weights_that_do_not_fit_the_model_are_refused_naming_the_tensor(tmp_path, edit, message):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net)
    aliases = {"plainformer.aliases": json.dumps({"head.weight": "emb.weight"}), "format": "pt"}
    _edit_tensors(tmp_path / "ckpt", "model.safetensors", edit, metadata=aliases)
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not fit TiedNet: " + message):
        load_checkpoint(tmp_path / "ckpt").restore_model(TiedNet())


def test_half_precision_weights_load_into_a_float_model(tmp_path):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net.half())
    restored = load_checkpoint(tmp_path / "ckpt").restore_model(TiedNet())
    assert restored.proj.weight.dtype == torch.float32
    assert torch.equal(restored.proj.weight, net.proj.weight.float())


def _manifest_entry(directory, name, entry):
    _edit_json(directory, "manifest.json", lambda m: {**m, "files": {**m["files"], name: entry}})


@pytest.mark.parametrize("damage, message", [
    (lambda d: _edit_json(d, "manifest.json", lambda m: {**m, "files": {
        k: {"size": v["size"]} for k, v in m["files"].items()}}),
     r"entry of 'config\.json' must be an object .* 'sha256'"),
    (lambda d: _manifest_entry(d, "model.safetensors", "big"), r"entry of 'model\.safetensors' must be"),
    (lambda d: _manifest_entry(d, "../../etc/hostname", {"size": 1, "sha256": "0"}),
     r"lists '\.\./\.\./etc/hostname', which is not a file name inside the checkpoint"),
    (lambda d: ((d / "vocab.txt").symlink_to("/etc/hostname"),
                _manifest_entry(d, "vocab.txt", {"size": 1, "sha256": "0"})), r"vocab\.txt is a link"),
    (lambda d: _edit_json(d, "config.json", lambda c: {**c, "format_version": "1"}),
     r"config\.json: 'format_version' has the wrong type \(str\)"),
    (lambda d: _edit_json(d, "config.json", lambda c: {**c, "model": "gpt"}), r"'model' has the wrong type"),
    (lambda d: _edit_json(d, "trainer_state.json", lambda s: [s]), r"trainer_state\.json must hold a JSON object"),
    (lambda d: _edit_tensors(d, "model.safetensors", lambda t: t, metadata={"plainformer.aliases": "[1, 2]"}),
     r"'plainformer\.aliases' must map names to names"),
])
def test_malformed_fields_give_a_checkpoint_error_naming_file_and_field(tmp_path, damage, message):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net, trainer_state={"step": 1})
    damage(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ckpt")


# ----------------------------------------------------------------------------- leftovers, full disk

def _dead_pid() -> int:
    import subprocess
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_save_removes_the_temp_dirs_of_killed_saves_but_not_of_running_ones(tmp_path):
    net, _ = trained_net()
    stale = [tmp_path / ".last.tmp-0123456789ab", tmp_path / f".best.tmp-{_dead_pid()}-0123456789ab",
             tmp_path / ".last.tmp-012345678901234567890"]  # old style, all digits: no pid that big
    running = tmp_path / f".best.tmp-{os.getppid()}-0123456789ab"
    unrelated = tmp_path / ".best.tmp-0123456789ab"  # old-style name of another checkpoint: not ours to judge
    for directory in (*stale, running, unrelated):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x" * 100)
    save(tmp_path / "last", net)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last", running.name, unrelated.name])


FULL_DISK = checkpoint.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_is_one_line_naming_the_checkpoint_and_the_previous_one_survives(tmp_path, monkeypatch):
    old, new = saved_old_and_new(tmp_path)

    def full(*args, **kwargs):
        raise FULL_DISK

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(DiskFullError) as info:
        save(tmp_path / "last", new)
    assert str(info.value) == (f"the disk is full: could not write checkpoint {tmp_path / 'last'}; "
                               f"free space on the file system of {tmp_path} and retry")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    monkeypatch.undo()
    assert torch.equal(_weights(tmp_path / "last"), old.proj.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


def test_other_write_errors_are_not_called_a_full_disk(tmp_path, monkeypatch):
    net, _ = trained_net()

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(checkpoint, "save_file", denied)
    with pytest.raises(PermissionError):
        save(tmp_path / "last", net)


def test_a_really_full_disk_keeps_the_previous_checkpoint(small_tmpfs):
    old, _ = trained_net()
    save(small_tmpfs / "last", old)
    big = nn.Linear(256, 256)  # 257 KiB of float32: more than the disk
    with pytest.raises(DiskFullError, match=f"could not write checkpoint {small_tmpfs / 'last'}"):
        save_checkpoint(small_tmpfs / "last", model=big, family="tied", model_config=MODEL_CONFIG)
    assert torch.equal(_weights(small_tmpfs / "last"), old.proj.weight)
    assert [p.name for p in small_tmpfs.iterdir()] == ["last"]


@pytest.mark.parametrize("name", ["tokenizer.json", "optimizer.safetensors"])
def test_a_file_left_out_of_the_manifest_is_refused_not_read(tmp_path, name):
    net, optimizer = trained_net()
    save(tmp_path / "ckpt", net)
    (tmp_path / "ckpt" / name).write_text("{}")  # beside the verified files, unverified
    with pytest.raises(CheckpointError, match=rf"{name} is not listed in manifest\.json"):
        load_checkpoint(tmp_path / "ckpt", verify=False)


def test_a_listed_file_that_is_a_link_is_refused_even_inside_the_directory(tmp_path):
    net, _ = trained_net()
    save(tmp_path / "ckpt", net)
    config = tmp_path / "ckpt" / "config.json"
    (tmp_path / "ckpt" / ".real.json").write_bytes(config.read_bytes())
    config.unlink()
    config.symlink_to(".real.json")
    with pytest.raises(CheckpointError, match=r"config\.json is a link"):
        load_checkpoint(tmp_path / "ckpt")


def test_an_alias_in_the_metadata_cannot_overwrite_a_stored_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    net, _ = trained_net()
    save(tmp_path / "ckpt", net)
    path = tmp_path / "ckpt" / "model.safetensors"
    save_file(load_file(path), path, metadata={"format": "pt", "plainformer.aliases": '{"proj.weight": "norm.weight"}'})
    with pytest.raises(CheckpointError, match="ties 'proj.weight', which the file holds itself"):
        load_checkpoint(tmp_path / "ckpt", verify=False)
