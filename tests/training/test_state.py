"""Tests for plainformer.training.state: trainer_state.json, written and read back in one schema."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from torch import nn

from plainformer.checkpoint.format import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from plainformer.training.state import TrainerState

# What the trainer wrote before TrainerState existed (the "rng" keys aside): the file format it keeps.
WRITTEN = {"step": 40, "data_position": 80, "best_val_loss": 1.25, "train_loss": 1.5, "val_loss": 1.375,
           "elapsed_s": 12.5, "world_size": 2, "evaluated_step": 40,
           "log_window": {"loss_sum": 0.75, "steps": 3}, "planned_steps": 90, "best_metric": 0.875}
# A checkpoint of a plainformer from before world_size, evaluated_step, log_window, planned_steps and best_metric.
OLDEST = {k: WRITTEN[k] for k in ("step", "data_position", "best_val_loss", "train_loss", "val_loss", "elapsed_s")}


def checkpoint_holding(values, path: Path = Path("run/last")) -> Checkpoint:
    return Checkpoint(path=path, family="tiny", model_config={}, train_config={}, state_dict={},
                      trainer_state=values)


def test_the_file_written_holds_the_fields_of_before_and_reads_back_equal(tmp_path):
    state = TrainerState.from_dict(WRITTEN)
    save_checkpoint(tmp_path / "last", model=nn.Linear(2, 2), family="tiny", model_config={},
                    trainer_state=state.to_dict())
    saved = json.loads((tmp_path / "last" / "trainer_state.json").read_text())
    assert {k: v for k, v in saved.items() if k != "rng"} == WRITTEN
    assert TrainerState.from_checkpoint(load_checkpoint(tmp_path / "last")) == state


def test_a_checkpoint_of_an_older_plainformer_reads_with_the_defaults():
    state = TrainerState.from_checkpoint(checkpoint_holding(OLDEST))
    assert state.to_dict() == {**OLDEST, "world_size": None, "evaluated_step": None,
                               "log_window": {"loss_sum": 0.0, "steps": 0}, "planned_steps": None,
                               "best_metric": None}


def test_a_fresh_state_is_a_run_before_its_first_step():
    assert TrainerState.fresh().to_dict() == {
        "step": 0, "data_position": 0, "best_val_loss": None, "train_loss": None, "val_loss": None,
        "elapsed_s": 0.0, "world_size": None, "evaluated_step": None, "log_window": {"loss_sum": 0.0, "steps": 0},
        "planned_steps": None, "best_metric": None}


def test_the_rng_states_and_other_keys_are_left_to_the_checkpoint():
    values = {**WRITTEN, "rng": {"python": [3, [1, 2], None]}, "rng_other_ranks": [{}]}
    assert TrainerState.from_checkpoint(checkpoint_holding(values)) == TrainerState.from_dict(WRITTEN)


def test_a_loss_that_diverged_still_resumes():
    values = {**WRITTEN, "train_loss": math.nan, "val_loss": math.inf, "log_window": {"loss_sum": math.nan,
                                                                                        "steps": 1}}
    assert math.isnan(TrainerState.from_checkpoint(checkpoint_holding(values)).train_loss)


def test_a_field_without_a_default_missing_is_refused_naming_the_file():
    values = {k: v for k, v in WRITTEN.items() if k not in ("step", "elapsed_s")}
    with pytest.raises(CheckpointError, match=r"^run/last/trainer_state\.json lacks 'step', 'elapsed_s'$"):
        TrainerState.from_checkpoint(checkpoint_holding(values))


@pytest.mark.parametrize("edit, field", [
    (dict(step="3"), "step"), (dict(step=True), "step"), (dict(data_position=-1), "data_position"),
    (dict(val_loss="low"), "val_loss"), (dict(best_val_loss=False), "best_val_loss"),
    (dict(best_metric="0.9"), "best_metric"),
    (dict(elapsed_s=None), "elapsed_s"), (dict(world_size=1.0), "world_size"),
    (dict(evaluated_step=1.5), "evaluated_step"), (dict(planned_steps=-2), "planned_steps"),
    (dict(log_window=[1.0, 2]), "log_window"), (dict(log_window={"loss_sum": 1.0}), "log_window"),
    (dict(log_window={"loss_sum": "1", "steps": 2}), "log_window"),
    (dict(log_window={"loss_sum": 1.0, "steps": -1}), "log_window"),
])
def test_a_malformed_field_is_refused_naming_the_file_and_the_field(edit, field):
    with pytest.raises(CheckpointError, match=rf"^run/last/trainer_state\.json: {field} malformed "
                                              r"\(expected counts >= 0 and numbers\)$"):
        TrainerState.from_checkpoint(checkpoint_holding({**WRITTEN, **edit}))


def test_the_kernel_choice_a_trainer_of_before_kept_is_left_to_the_checkpoint():
    """Checkpoints of the plainformers whose Trainer chose the linear layers' kernels hold "linear_kernels"
    in this file: it reads as the state it was, the choice being the run's (`training.kernels.kept_kernels`)."""
    choice = {"forward": "onednn", "grad_input": "onednn", "grad_weight": "aten"}
    state = TrainerState.from_checkpoint(checkpoint_holding({**WRITTEN, "linear_kernels": choice}))
    assert state == TrainerState.from_dict(WRITTEN) and "linear_kernels" not in state.to_dict()


def test_every_malformed_field_is_named_at_once():
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: step, val_loss, log_window malformed"):
        TrainerState.from_checkpoint(checkpoint_holding({**WRITTEN, "step": -1, "val_loss": "x", "log_window": 0}))


def test_a_checkpoint_without_trainer_state_is_refused():
    with pytest.raises(CheckpointError, match=r"run/last holds no trainer state \(trainer_state\.json is missing\)"):
        TrainerState.from_checkpoint(checkpoint_holding(None))


def test_a_state_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match="^data_position malformed"):
        TrainerState.fresh().replace(data_position=-1)
