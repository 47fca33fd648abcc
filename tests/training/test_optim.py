"""Tests for plainformer.training.optim with optimizer "muon": which tensors Muon trains, the rates
the schedule gives each optimizer, and a Muon run that resumes bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import plainformer as pf
from plainformer.checkpoint.format import load_checkpoint
from plainformer.training import precision
from plainformer.training.config import TrainConfig
from plainformer.training.optim import BatchedMuon, MuonWithAdamW, make_optimizer, newton_schulz, set_lr
from plainformer.training.trainer import Trainer
from tests.training.test_trainer import fresh_model

# The matrices of the tiny GPT's two blocks, written out: attention W_q, W_k, W_v, W_o, feed-forward W_1, W_2.
BLOCK_MATRICES = {f"blocks.{i}.{name}.weight" for i in (0, 1)
                  for name in ("self_attn.W_q", "self_attn.W_k", "self_attn.W_v", "self_attn.W_o",
                               "ff.W_1", "ff.W_2")}


def tiny_gpt(tie_weights: bool, seed: int = 0) -> pf.GPT:
    torch.manual_seed(seed)
    return pf.GPT(pf.GPTConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=2, d_model=8, d_ff=16,
                               bias=True, tie_weights=tie_weights))


def muon_config(**overrides) -> TrainConfig:
    return TrainConfig(**{**dict(optimizer="muon", lr=2e-3, muon_lr=0.02, weight_decay=0.1), **overrides})


def owners(model: torch.nn.Module, optimizer: MuonWithAdamW) -> dict[str, str]:
    """Parameter name -> "muon", "adamw decay" or "adamw no decay"."""
    adamw, muon = optimizer.optimizers
    label = {id(p): "muon" for g in muon.param_groups for p in g["params"]}
    for group in adamw.param_groups:
        kind = "adamw decay" if group["weight_decay"] > 0 else "adamw no decay"
        label.update({id(p): kind for p in group["params"]})
    return {name: label[id(p)] for name, p in model.named_parameters()}


def test_muon_takes_the_block_matrices_and_adamw_the_head_embeddings_norms_and_biases():
    model = tiny_gpt(tie_weights=False)
    got = owners(model, make_optimizer(model, muon_config()))
    expected = {name: "adamw no decay" for name, _ in model.named_parameters()}
    expected.update(dict.fromkeys(BLOCK_MATRICES, "muon"))
    expected["lm_head.weight"] = "adamw decay"
    assert got == expected
    assert len(got) == 37  # 2 embeddings, 2 x 16 block tensors, final norm weight and bias, head


def test_a_head_tied_to_the_embedding_stays_with_adamw_undecayed():
    model = tiny_gpt(tie_weights=True)
    optimizer = make_optimizer(model, muon_config())
    got = owners(model, optimizer)
    assert {name for name, kind in got.items() if kind == "muon"} == BLOCK_MATRICES
    assert got["token_embedding.weight"] == "adamw no decay"
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(got) - 12, 12]


def test_with_zero_gradients_each_tensor_only_decays_by_its_own_optimizers_rate():
    # Zero gradients leave only decoupled weight decay: Muon's matrices shrink by 1 - muon_lr·wd,
    # AdamW's decayed head by 1 - lr·wd, everything else stays put.
    model = tiny_gpt(tie_weights=False)
    optimizer = make_optimizer(model, muon_config(lr=0.5, muon_lr=2.0))
    set_lr(optimizer, 0.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 2.0 * 0.1 if name in BLOCK_MATRICES else 1 - 0.5 * 0.1 if name == "lm_head.weight" else 1
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("nesterov, adjust_lr_fn", [(True, None), (False, "match_rms_adamw")])
def test_batched_muon_steps_exactly_like_torchs_muon(nesterov, adjust_lr_fn):
    """Same-shaped matrices orthogonalised together (square, wide, tall, one alone) give torch's
    per-matrix update bit for bit, momentum buffers included, over several steps."""
    torch.manual_seed(0)
    shapes = [(32, 32)] * 3 + [(48, 16)] * 2 + [(16, 48), (8, 4)]
    ours = [torch.nn.Parameter(0.02 * torch.randn(shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    batched, reference = BatchedMuon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        batched.step()
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(batched.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"])


def _newton_schulz_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """NewtonSchulz5 of one matrix by hand in float64, with torch's Muon coefficients."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double().T if g.shape[0] > g.shape[1] else g.double()
    x = x / x.norm()
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(3, 32, 32), (2, 48, 16), (2, 16, 48)])
def test_newton_schulz_in_float32_matches_float64_by_hand(shape):
    torch.manual_seed(0)
    updates = torch.randn(shape)
    ours = newton_schulz(updates, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    assert ours.dtype == torch.float32
    for matrix, update in zip(ours, updates, strict=True):
        torch.testing.assert_close(matrix.double(), _newton_schulz_float64(update), rtol=0, atol=1e-5)


@pytest.mark.parametrize("amx, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_newton_schulz_runs_in_bf16_only_where_bf16_matmuls_are_native(monkeypatch, amx, expected):
    monkeypatch.setattr(precision, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.5)  # without AMX: a Xeon's slow bf16
    _, muon = make_optimizer(tiny_gpt(tie_weights=True), muon_config()).optimizers
    assert muon.ns_dtype == expected


@pytest.mark.parametrize("amx", [True, False])
def test_newton_schulz_of_a_float64_model_runs_in_float64(monkeypatch, amx):
    monkeypatch.setattr(precision, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.5)  # without AMX: a Xeon's slow bf16
    _, muon = make_optimizer(tiny_gpt(tie_weights=True).double(), muon_config()).optimizers
    assert muon.ns_dtype == torch.float64


def test_the_schedule_scales_muons_rate_by_muon_lr_over_lr():
    model = tiny_gpt(tie_weights=True)
    optimizer = make_optimizer(model, muon_config(lr=2e-3, muon_lr=0.02))
    set_lr(optimizer, 1e-3)  # half the peak
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 1e-2])


def test_adamw_is_still_a_plain_torch_adamw():
    model = tiny_gpt(tie_weights=True)
    assert type(make_optimizer(model, TrainConfig())) is torch.optim.AdamW


def test_muon_on_a_model_without_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="optimizer 'muon'.*TinyLM has none"):
        make_optimizer(fresh_model(), muon_config())


@pytest.mark.parametrize("bad, field", [(dict(optimizer="sgd"), "optimizer"), (dict(muon_lr=0.0), "muon_lr")])
def test_invalid_optimizer_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**bad)


def test_state_dict_round_trips_both_optimizers_with_one_numbering():
    model = tiny_gpt(tie_weights=True)
    optimizer = make_optimizer(model, muon_config())
    model(torch.randint(11, (2, 8)), torch.randint(11, (2, 8)))[1].backward()
    optimizer.step()
    saved = optimizer.state_dict()
    n = sum(1 for _ in model.parameters())
    assert sorted(i for g in saved["param_groups"] for i in g["params"]) == list(range(n))
    assert set(saved["state"][n - 1]) == {"momentum_buffer"} and "exp_avg" in saved["state"][0]

    other = make_optimizer(model, muon_config())
    other.load_state_dict(saved)
    reloaded = other.state_dict()
    for i, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(reloaded["state"][i][key], value), (i, key)


# ----------------------------------------------------------------------------- through the trainer

def train_gpt(out_dir, *, resume=False, model=None, **overrides):
    tokens = np.random.default_rng(0).integers(0, 11, size=400)
    source = pf.LMBatchSource(tokens[:300], tokens[300:], block_size=8, seed=3)
    config = muon_config(**{**dict(max_steps=6, batch_size=4, grad_accum_steps=2, warmup_steps=2,
                                   eval_interval=3, eval_batches=2, log_interval=1, save_interval=0,
                                   dtype="float32"), **overrides})
    trainer = Trainer(model or tiny_gpt(tie_weights=True), source, config, out_dir, resume=resume,
                      progress=False)
    return trainer, trainer.fit()


def test_a_muon_run_resumes_bit_exactly(tmp_path):
    reference, _ = train_gpt(tmp_path / "a")
    train_gpt(tmp_path / "b", max_steps=3, decay_steps=6)
    resumed, metrics = train_gpt(tmp_path / "b", resume=True, model=tiny_gpt(tie_weights=True, seed=9),
                                 decay_steps=6)
    assert metrics["step"] == 6
    for (name, p), q in zip(resumed.model.state_dict().items(), reference.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    a, b = resumed.optimizer.state_dict(), reference.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i]), i
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]
    assert load_checkpoint(tmp_path / "b" / "last").train_config["optimizer"] == "muon"
