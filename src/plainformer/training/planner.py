"""fit_to_time's step planner: the max_steps that end by max_time, from step and evaluation times measured.

With s seconds per training step, e seconds per evaluation (one every eval_interval steps; none when it
is 0), and the final evaluation and saves (about 2e) and two steps' slack (for steps that run slower than
timed; max_time is a hard stop, which would end the run before its schedule does) kept out of the time that
remains,

    max_steps = step + (max_time - elapsed - 2e - 2s) / (s + e / eval_interval),

averaged over ranks, rounded, and kept within [step, the max_steps configured]. A session that starts
without a plan plans twice:

1. at step max(warmup_steps, the session's first step + 10), with s timed over the steps since the
   session's first (which paid for warm-up) and e timed by the trainer on an eighth of an evaluation
   (a whole one for the purpose took 1-1.7 s of the default's 200, 0.5-0.8%, and its loss at the end
   of warmup told little);
2. halfway from there to the first plan, if that is at least 10 steps on, with s timed over the steps
   since the first plan (evaluations left out) and the same e. Early steps run slower (memory first
   touched, kernels first built: 0.36 against 0.30 s per step for the default preset on the machine it
   was measured on), and machines drift, so this plan is the better one; it may raise max_steps, up
   to the cap.

A session resumed with a plan keeps it and plans no more. The planner knows steps and seconds only:
the trainer gives it a clock, a way to time one evaluation and a way for the ranks to agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .config import TrainConfig

# The planner times at least this many steps after a session's first before it plans.
STEPS_TO_TIME = 10

# () -> (seconds of the run so far, seconds of them spent evaluating); only differences are used.
Clock = Callable[[], tuple[float, float]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One plan: `max_steps`, from `per_step` seconds per step and `per_eval` seconds per evaluation."""

    max_steps: int
    per_step: float
    per_eval: float
    max_time: float
    again: bool  # the session's second plan

    def __str__(self) -> str:
        return (f"max_steps: {self.max_steps}{' (planned again)' if self.again else ''}, to end by max_time "
                f"{self.max_time:g} s at {self.per_step:.3f} s per step and {self.per_eval:.2f} s per evaluation")


class StepPlanner:
    """Plans max_steps as the module docstring says. After every step the trainer calls `step_taken`;
    when it answers True, `plan`. `planned` is the max_steps planned (None before the first plan; a
    resumed session sets the one it saved). With `enabled` False it never plans."""

    def __init__(self, clock: Clock, *, max_time: float | None, max_steps: int, warmup_steps: int = 0,
                 eval_interval: int = 0, enabled: bool = True):
        if enabled and max_time is None:
            raise ValueError("fit_to_time needs max_time (the seconds to fit the steps into), got None")
        self.clock, self.max_time, self.cap = clock, max_time, max_steps
        self.warmup_steps, self.eval_interval, self.enabled = warmup_steps, eval_interval, enabled
        self.planned: int | None = None
        self._replan_at: int | None = None
        self._since: tuple[int, float, float] | None = None  # (step, *clock()) where the timing starts
        self._per_eval = 0.0

    @classmethod
    def from_config(cls, config: TrainConfig, clock: Clock) -> StepPlanner:
        """The planner of a TrainConfig: enabled by its fit_to_time, capped at its max_steps."""
        return cls(clock, max_time=config.max_time, max_steps=config.max_steps, warmup_steps=config.warmup_steps,
                   eval_interval=config.eval_interval, enabled=config.fit_to_time)

    def step_taken(self, step: int) -> bool:
        """Note that `step` was just taken (the session's first starts the timing); whether to plan now."""
        if not self.enabled:
            return False
        if self._since is None:
            self._since = (step, *self.clock())
        if self.planned is None:
            return step >= max(self.warmup_steps, self._since[0] + STEPS_TO_TIME)
        return step == self._replan_at

    def plan(self, step: int, time_evaluation: Callable[[], float],
             agree: Callable[[float], float] = lambda steps: steps) -> Plan:
        """Set `planned` from the steps timed since the timing started; the first plan first asks
        `time_evaluation` for e, the seconds of one evaluation (the clock counts its own time as evaluating).
        `agree` maps this rank's max_steps to the ranks' mean."""
        assert self.max_time is not None and self._since is not None  # enabled, and a step was taken
        since_step, since_elapsed, since_evaluating = self._since
        elapsed, evaluating = self.clock()
        per_step = (elapsed - since_elapsed - (evaluating - since_evaluating)) / (step - since_step)
        first = self.planned is None
        if first:
            self._per_eval = time_evaluation()
        per_step_with_evals = per_step + (self._per_eval / self.eval_interval if self.eval_interval else 0.0)
        reserve = 2 * self._per_eval + 2 * per_step  # the final evaluation and saves, and two steps' slack
        steps_left = max(0.0, (self.max_time - self.clock()[0] - reserve) / per_step_with_evals)
        self.planned = min(self.cap, max(step, round(agree(step + steps_left))))
        halfway = step + (self.planned - step) // 2
        self._replan_at = halfway if first and halfway >= step + STEPS_TO_TIME else None
        self._since = (step, *self.clock())
        return Plan(self.planned, per_step, self._per_eval, self.max_time, again=not first)
