"""TrainConfig: each field's declared constraint, the rules across fields, presets."""

from __future__ import annotations

import dataclasses

import pytest

from plainformer.training.config import TrainConfig


@pytest.mark.parametrize("field, value, error, message", [
    ("max_steps", 0, ValueError, "max_steps must be a positive integer, got 0"),
    ("warmup_steps", -1, ValueError, "warmup_steps must be an int >= 0, got -1"),
    ("seed", -3, ValueError, "seed must be an int >= 0, got -3"),
    ("eval_batch_size", 0, ValueError, "eval_batch_size must be a positive integer, got 0"),
    ("lr", 0.0, ValueError, "lr must be a positive finite number, got 0.0"),
    ("weight_decay", -0.1, ValueError, r"weight_decay must be a finite number >= 0, got -0\.1"),
    ("beta1", 1.0, ValueError, r"beta1 must be in \[0, 1\), got 1\.0"),
    ("schedule", "step", ValueError,
     "schedule must be one of 'cosine', 'linear', 'constant', 'inverse_sqrt'; got 'step'"),
    ("parallel", "tp", ValueError, "parallel must be one of"),
    ("max_time", -1.0, ValueError, "max_time must be a positive finite number"),
    ("compile", 1, TypeError, "compile must be a bool, got int 1"),
    ("batch_size", 2.0, TypeError, r"batch_size must be an int, got float 2\.0"),
])
def test_each_field_is_refused_by_its_declared_constraint(field, value, error, message):
    with pytest.raises(error, match=message):
        TrainConfig(**{field: value})


def test_optional_fields_accept_none():
    config = TrainConfig(decay_steps=None, schedule_d_model=None, eval_batch_size=None, max_time=None)
    assert (config.decay_steps, config.max_time) == (None, None)


@pytest.mark.parametrize("values, message", [
    (dict(fit_to_time=True), "fit_to_time needs max_time"),
    (dict(decay_steps=100, warmup_steps=100), r"decay_steps \(100\) must exceed warmup_steps \(100\)"),
    (dict(lr=1e-4, min_lr=1e-3), "min_lr"),
    (dict(schedule="inverse_sqrt"), "schedule_d_model"),
])
def test_rules_across_fields_are_checked_after_the_fields(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values)


def test_every_field_keeps_its_default_and_presets_validate():
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    assert TrainConfig().to_dict() == defaults
    assert TrainConfig.from_preset("transformer-paper").schedule == "inverse_sqrt"
