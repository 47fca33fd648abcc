"""Tests for plainformer.inference.timing: the fastest of several candidates, measured."""

from __future__ import annotations

import time

import pytest

from plainformer.inference.timing import fastest


def test_the_candidate_that_takes_less_time_is_chosen():
    calls = {"slow": 0, "quick": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.02)

    def quick():
        calls["quick"] += 1

    choice, seconds = fastest({"slow": slow, "quick": quick}, rounds=2)
    assert choice == "quick"
    assert seconds["slow"] >= 0.02 > seconds["quick"]
    assert calls == {"slow": 3, "quick": 3}  # a warm-up call, then one a round


def test_a_candidate_that_cannot_run_here_is_never_chosen():
    def missing():
        raise RuntimeError("could not create a primitive descriptor")

    choice, seconds = fastest({"missing": missing, "sleeps": lambda: time.sleep(0.001)}, rounds=1)
    assert choice == "sleeps" and seconds["missing"] == float("inf")


def test_no_runnable_candidate_and_no_candidate_are_refused():
    def missing():
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="none of the kernels missing runs here"):
        fastest({"missing": missing})
    with pytest.raises(ValueError, match="at least one candidate"):
        fastest({})
