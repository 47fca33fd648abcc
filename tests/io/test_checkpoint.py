"""Tests for plainformer.io.checkpoint: round trips, tied weights, corruption, atomic replacement."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from plainformer.data.tokenizers import CharTokenizer
from plainformer.io import checkpoint
from plainformer.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


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
    for (name, p), q in zip(net.state_dict().items(), other.state_dict().values()):
        assert torch.equal(p, q), name


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
    for p, q in zip(net.parameters(), net2.parameters()):
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
    for mine, theirs in zip(restored_optimizer.state.values(), optimizer.state.values()):
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
    (lambda d: (d / "config.json").write_text('{"model": {}}'), False, r"config\.json lacks 'format_version', 'family'"),
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

    monkeypatch.setattr(checkpoint, "_fsync_tree", crash)
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

    monkeypatch.setattr(checkpoint.os, "rename", rename_then_crash)
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
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: None)  # the deletion never happens
    save(tmp_path / "last", new)
    monkeypatch.undo()
    assert (tmp_path / ".last.old").is_dir()
    assert torch.equal(_weights(tmp_path / "last"), new.proj.weight)
    save(tmp_path / "last", old)
    assert [p.name for p in tmp_path.iterdir()] == ["last"]
