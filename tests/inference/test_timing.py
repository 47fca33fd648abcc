"""Tests for plainformer.inference.timing: the fastest of several candidates, measured."""

from __future__ import annotations

import time

import pytest
import torch

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


def test_candidates_run_in_inference_mode_unless_they_time_a_backward():
    grad_enabled = []

    def records():
        grad_enabled.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    fastest({"records": records}, rounds=1)
    fastest({"records": records}, rounds=1, autograd=True)
    assert grad_enabled == [(False, True)] * 2 + [(True, False)] * 2
    weight = torch.ones(3, requires_grad=True)
    _, seconds = fastest({"backward": lambda: torch.autograd.grad((weight * 2).sum(), weight)}, autograd=True)
    assert seconds["backward"] < float("inf")
