"""Tests for plainformer.nn.modes: eval_mode switches dropout off for its block and restores the mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plainformer.nn.modes import eval_mode


@pytest.mark.parametrize("training", [True, False])
def test_the_block_runs_in_eval_mode_and_the_mode_is_restored(training):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train(training)
    x = torch.ones(2, 4)
    with eval_mode(model):
        assert not model.training and not model[1].training
        assert torch.equal(model(x), model(x))  # no dropout
    assert model.training == training and model[1].training == training


def test_the_mode_is_restored_after_an_exception():
    model = nn.Dropout(0.5).train()
    with pytest.raises(RuntimeError, match="boom"), eval_mode(model):
        raise RuntimeError("boom")
    assert model.training
