"""Tests for plainformer.checkpoint.average: the mean of checkpoints' weights, and the checkpoints a run keeps."""

from __future__ import annotations

import pytest
import torch

import plainformer as pf
from plainformer.checkpoint.average import (
    average_checkpoints,
    keep_last,
    kept_checkpoint,
    kept_checkpoints,
    replace_checkpoint,
)
from plainformer.checkpoint.format import CheckpointError, load_checkpoint, save_checkpoint
from plainformer.cli import main

CONFIG = pf.TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, n_layers=1, d_model=8, n_heads=2, d_ff=16,
                              max_len=16)


def saved_models(tmp_path, count: int, config: pf.TransformerConfig = CONFIG) -> tuple[list, list[pf.Transformer]]:
    paths, models = [], []
    for seed in range(count):
        torch.manual_seed(seed)
        model = pf.Transformer(config)
        paths.append(save_checkpoint(tmp_path / f"ckpt{seed}", model=model, family="transformer",
                                     model_config=config.to_dict()))
        models.append(model)
    return paths, models


def test_the_average_is_the_mean_of_every_weight_computed_in_float64(tmp_path):
    paths, models = saved_models(tmp_path, 3)
    averaged = pf.Transformer.from_checkpoint(average_checkpoints(paths, tmp_path / "mean"))
    for name, tensor in averaged.state_dict().items():
        expected = sum(m.state_dict()[name].double() for m in models) / 3
        torch.testing.assert_close(tensor.double(), expected, rtol=0, atol=1e-7)  # float32 rounding of the mean
    assert averaged.output.weight is averaged.encoder.embedding.weight  # tied weights stay one tensor


def test_checkpoints_of_another_model_are_refused(tmp_path):
    paths, _ = saved_models(tmp_path, 1)
    other, _ = saved_models(tmp_path / "other", 1, CONFIG.replace(d_ff=32))
    with pytest.raises(CheckpointError, match="holds another model"):
        average_checkpoints([paths[0], other[0]], tmp_path / "mean")
    with pytest.raises(ValueError, match="at least one"):
        average_checkpoints([], tmp_path / "mean")


def test_a_run_keeps_its_newest_checkpoints_and_replace_copies_one_over_another(tmp_path):
    paths, models = saved_models(tmp_path, 1)
    for step in (5, 10, 15, 20):
        replace_checkpoint(paths[0], kept_checkpoint(tmp_path / "run", step))
    keep_last(tmp_path / "run", 2)
    assert [p.name for p in kept_checkpoints(tmp_path / "run")] == ["step-0000015", "step-0000020"]
    assert load_checkpoint(kept_checkpoints(tmp_path / "run")[0]).model_config == CONFIG.to_dict()


def test_the_average_verb_averages_a_runs_last_kept_checkpoints(tmp_path, capsys):
    paths, models = saved_models(tmp_path, 3)
    for step, path in zip((10, 20, 30), paths, strict=True):
        replace_checkpoint(path, kept_checkpoint(tmp_path / "run", step))
    assert main(["average", str(tmp_path / "run"), "--last", "2", "--out", str(tmp_path / "run" / "averaged")]) == 0
    averaged = pf.Transformer.from_checkpoint(tmp_path / "run" / "averaged")
    expected = (models[1].output.weight.double() + models[2].output.weight.double()) / 2
    torch.testing.assert_close(averaged.output.weight.double(), expected, rtol=0, atol=1e-7)
    assert '"averaged": 2' in capsys.readouterr().out
    assert main(["average", str(paths[0]), "--out", str(tmp_path / "x")]) == 2
    assert main(["average", str(paths[0]), str(paths[1]), "--out", str(paths[0] / "inside")]) == 2
    assert "one of the checkpoints averaged" in capsys.readouterr().err
