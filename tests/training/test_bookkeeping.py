"""Tests for plainformer.training.bookkeeping's `Phases`: the seconds a session spends outside its steps, by
phase, and the breakdown of a session's wall time that the trainer reports."""

from __future__ import annotations

import time

import pytest

from plainformer.training.bookkeeping import Phases


@pytest.fixture
def clock(monkeypatch):
    """time.perf_counter reads these instants, one per call."""
    def set_instants(*instants: float) -> None:
        readings = iter(instants)
        monkeypatch.setattr(time, "perf_counter", lambda: next(readings))
    return set_instants


def test_a_phase_adds_up_the_seconds_of_each_of_its_timings(clock):
    clock(0.0, 2.0, 10.0, 13.0, 20.0, 20.5)
    phases = Phases()
    for phase in ("evaluation", "evaluation", "checkpoints"):
        with phases.timing(phase):
            pass
    assert phases.seconds == {"evaluation": 5.0, "checkpoints": 0.5}


def test_a_phase_that_raises_still_counts_its_time(clock):
    clock(1.0, 4.0)
    phases = Phases()
    with pytest.raises(OSError), phases.timing("checkpoints"):
        raise OSError("disk full")
    assert phases.seconds == {"checkpoints": 3.0}


def test_the_breakdown_holds_the_steps_each_phase_and_the_rest_of_the_session_as_other(clock):
    clock(0.0, 5.0, 5.0, 6.5)
    phases = Phases()
    with phases.timing("evaluation"):
        pass
    with phases.timing("logging"):
        pass
    breakdown = phases.breakdown(steps=20.0, session=30.0)
    assert breakdown == {"steps": 20.0, "evaluation": 5.0, "logging": 1.5, "other": 3.5}
    assert sum(breakdown.values()) == 30.0


def test_other_is_never_negative_when_the_clocks_disagree_by_a_hair():
    assert Phases().breakdown(steps=10.0, session=9.999)["other"] == 0.0
