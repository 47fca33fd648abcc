"""Tests for plainformer.training.planner: fit_to_time's two plans, on a fake clock, without a model.

The times are binary fractions (0.125 s per step, 0.5 s per evaluation), so every expected max_steps
is worked out by hand from max_steps = step + (max_time - elapsed - 2e - 2s) / (s + e / eval_interval).
"""

from __future__ import annotations

import pytest

from plainformer.training.config import TrainConfig
from plainformer.training.planner import STEPS_TO_TIME, StepPlanner


class FakeClock:
    """The trainer's clock, advanced by hand: (seconds of the run, of them evaluating)."""

    def __init__(self, elapsed: float = 0.0):
        self.elapsed, self.evaluating, self.evaluations = elapsed, 0.0, 0

    def __call__(self) -> tuple[float, float]:
        return self.elapsed, self.evaluating

    def evaluate(self, seconds: float = 0.5) -> None:
        self.elapsed += seconds
        self.evaluating += seconds
        self.evaluations += 1

    def time_evaluation(self) -> float:
        """The trainer's timing of an evaluation: 0.25 s counted as evaluating, which finds e = 0.5 s."""
        self.evaluate(0.25)
        return 0.5


def planner(clock: FakeClock, **overrides) -> StepPlanner:
    values = dict(max_time=100.125, max_steps=100_000, warmup_steps=2, eval_interval=4)
    return StepPlanner(clock, **{**values, **overrides})


def steps_until_a_plan(plan: StepPlanner, clock: FakeClock, first: int, last: int, seconds: float) -> int | None:
    """Take steps first .. last of `seconds` each; the first step at which the planner wants to plan."""
    for step in range(first, last + 1):
        clock.elapsed += seconds
        if plan.step_taken(step):
            return step
    return None


def first_plan(clock: FakeClock, **overrides):
    """Eleven steps of 0.125 s from step 1, then the first plan, with one evaluation of 0.5 s."""
    plan = planner(clock, **overrides)
    at = steps_until_a_plan(plan, clock, 1, 11, 0.125)
    assert at == 11
    return plan, plan.plan(at, clock.time_evaluation)


def first_plan_at(warmup_steps: int, first_step: int) -> int | None:
    clock = FakeClock()
    return steps_until_a_plan(planner(clock, warmup_steps=warmup_steps), clock, first_step, 1000, 0.125)


def test_the_first_plan_waits_for_warmup_and_ten_steps_of_the_session_timed():
    assert first_plan_at(warmup_steps=2, first_step=1) == 1 + STEPS_TO_TIME
    assert first_plan_at(warmup_steps=30, first_step=1) == 30
    # A session resumed at step 50 without a plan times its own steps: from 51, its first.
    assert first_plan_at(warmup_steps=30, first_step=51) == 51 + STEPS_TO_TIME


def test_the_first_plan_fills_the_time_left_at_the_measured_step_and_evaluation_times():
    clock = FakeClock()
    plan, made = first_plan(clock)
    # From step 1 (elapsed 0.125) to 11 (1.375): s = 0.125; e = 0.5, timed in 0.25 s: elapsed 1.625;
    # 11 + (100.125 - 1.625 - 2 * 0.5 - 2 * 0.125) / (0.125 + 0.5 / 4) = 11 + 389 = 400.
    assert (made.max_steps, made.per_step, made.per_eval, made.again) == (400, 0.125, 0.5, False)
    assert plan.planned == 400 and clock.evaluations == 1
    assert str(made) == ("max_steps: 400, to end by max_time 100.125 s at 0.125 s per step "
                         "and 0.50 s per evaluation")


def test_the_second_plan_halfway_times_only_the_steps_since_the_first_and_may_raise_max_steps():
    clock = FakeClock()
    plan, _ = first_plan(clock)
    assert steps_until_a_plan(plan, clock, 12, 99, 0.0625) is None
    clock.evaluate(0.5)  # a periodic evaluation between the plans: left out of s
    at = steps_until_a_plan(plan, clock, 100, 400, 0.0625)
    assert at == 11 + (400 - 11) // 2 == 205
    made = plan.plan(at, clock.time_evaluation)
    # Since step 11 (elapsed 1.625): 194 steps of 0.0625 s and one evaluation, elapsed 14.25; the same e;
    # 205 + (100.125 - 14.25 - 2 * 0.5 - 2 * 0.0625) / (0.0625 + 0.5 / 4) = 205 + 452 = 657.
    assert (made.max_steps, made.per_step, made.per_eval, made.again) == (657, 0.0625, 0.5, True)
    assert clock.evaluations == 2  # the first plan's timing and the periodic one: the second times none
    assert str(made).startswith("max_steps: 657 (planned again), ")
    assert steps_until_a_plan(plan, clock, 206, 657, 0.0625) is None  # no third plan


def test_the_plan_stays_within_the_step_taken_and_the_max_steps_configured():
    _, capped = first_plan(FakeClock(), max_steps=50)
    assert capped.max_steps == 50
    _, out_of_time = first_plan(FakeClock(), max_time=1.0)
    assert out_of_time.max_steps == 11


def test_no_second_plan_when_halfway_is_fewer_than_ten_steps_on():
    clock = FakeClock()
    # 11 + (7.125 - 1.625 - 1 - 0.25) / 0.25 = 28: halfway is step 19, 8 steps on.
    plan, made = first_plan(clock, max_time=7.125)
    assert made.max_steps == 28
    assert steps_until_a_plan(plan, clock, 12, 28, 0.125) is None


def test_without_periodic_evaluations_only_the_final_one_and_the_slack_are_kept_out_of_the_time():
    # eval_interval 0: 11 + (100.125 - 1.625 - 2 * 0.5 - 2 * 0.125) / 0.125 = 11 + 778 = 789.
    _, made = first_plan(FakeClock(), eval_interval=0)
    assert made.max_steps == 789


def test_the_ranks_agree_on_the_mean_they_are_given_rounded():
    clock = FakeClock()
    plan = planner(clock)
    steps_until_a_plan(plan, clock, 1, 11, 0.125)
    wanted = []
    made = plan.plan(11, clock.time_evaluation, agree=lambda steps: wanted.append(steps) or steps + 10.4)
    assert wanted == [400.0] and made.max_steps == 410


def test_a_session_resumed_with_a_plan_keeps_it_and_plans_no_more():
    clock = FakeClock(elapsed=60.0)
    plan = planner(clock)
    plan.planned = 300  # as a resume sets it
    assert steps_until_a_plan(plan, clock, 151, 300, 0.125) is None
    assert plan.planned == 300 and clock.evaluations == 0


def test_a_planner_not_enabled_never_plans_nor_reads_the_clock():
    def clock():
        raise AssertionError("read the clock")

    plan = StepPlanner(clock, max_time=None, max_steps=100, warmup_steps=0, enabled=False)
    assert not any(plan.step_taken(step) for step in range(1, 101))


def test_fit_to_time_without_max_time_is_refused():
    with pytest.raises(ValueError, match="fit_to_time needs max_time"):
        StepPlanner(FakeClock(), max_time=None, max_steps=100)


def test_from_config_takes_the_train_configs_fit_to_time_fields():
    config = TrainConfig(max_steps=500, warmup_steps=7, eval_interval=9, max_time=60.0, fit_to_time=True)
    plan = StepPlanner.from_config(config, FakeClock())
    assert (plan.max_time, plan.cap, plan.warmup_steps, plan.eval_interval, plan.enabled) == (60.0, 500, 7, 9, True)
    assert not StepPlanner.from_config(config.replace(fit_to_time=False), FakeClock()).enabled
