"""The online step-cost correction (scheduling/online_cost.py) and how the runner feeds it."""

import numpy as np
import pytest

from replicas.wcs.runner import StepSample, WCSRunnerMixin
from scheduling.cost_model import StepCostModel
from scheduling.online_cost import OnlineCostModel
from scheduling.planner import plan_step

PROFILE = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.5, per_draft_ms=0.3, per_target_ms=0.4, draft_launch_ms=4.0)


def feed(online: OnlineCostModel, steps: int, extra_ms, seed: int = 0) -> None:
    """Steps of random shape whose periods are the profile's prediction plus `extra_ms(rng)`."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        r = int(rng.integers(1, 16))
        d = int(rng.integers(0, 8 * r + 1))
        n = r + int(rng.integers(0, d + 1))
        online.observe(r, d, n, PROFILE.step_ms(r, d, n) + extra_ms(rng))


def test_steps_longer_than_profiled_move_the_intercept_by_their_mean_excess():
    online = OnlineCostModel(PROFILE)
    feed(online, 256, lambda rng: 25.0 + rng.normal(0.0, 5.0))
    assert online.offset_ms == pytest.approx(25.0, abs=1.5)
    served = online.model
    assert served.intercept_ms == pytest.approx(PROFILE.intercept_ms + online.offset_ms)
    # Only the intercept moves: every slope and the drafter's launch cost stay the profile's.
    assert served.step_ms(8, 40, 30) - served.step_ms(4, 0, 4) == pytest.approx(PROFILE.step_ms(8, 40, 30) - PROFILE.step_ms(4, 0, 4))


def test_steps_as_profiled_leave_the_profile_in_place():
    """Negative control: nothing to correct, nothing corrected."""
    online = OnlineCostModel(PROFILE)
    feed(online, 256, lambda rng: rng.normal(0.0, 0.1))
    assert online.model is PROFILE and online.offset_ms == 0.0


def test_the_window_forgets_older_steps():
    online = OnlineCostModel(PROFILE, window=64, refresh_every=16)
    feed(online, 64, lambda rng: 40.0)
    assert online.offset_ms == pytest.approx(40.0)
    feed(online, 64, lambda rng: 5.0, seed=1)
    assert online.offset_ms == pytest.approx(5.0)


def test_faster_steps_than_profiled_never_take_the_intercept_below_zero():
    online = OnlineCostModel(PROFILE)
    feed(online, 64, lambda rng: -50.0)
    assert online.model.intercept_ms == 0.0 and online.offset_ms == -PROFILE.intercept_ms


def test_a_longer_fixed_step_cost_makes_the_planner_draft_more():
    """Why the correction matters: with the same survival curves, a step made longer by work the
    planner cannot change makes drafted tokens cheaper relative to it."""
    rng = np.random.default_rng(0)
    survival = np.cumprod(rng.uniform(0.3, 0.8, size=(12, 8)), axis=1)
    online = OnlineCostModel(PROFILE)
    idle = plan_step(survival, online.model).draft.sum()
    feed(online, 128, lambda rng: 60.0)
    loaded = plan_step(survival, online.model).draft.sum()
    assert loaded > idle
    control = OnlineCostModel(PROFILE)
    feed(control, 128, lambda rng: 0.0)
    assert plan_step(survival, control.model).draft.sum() == idle


class RecordingController:
    """Stand-in for the step controller: records what the runner hands it."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def observe_step(self, *args) -> None:
        self.steps.append(args)


def last_step(planned: tuple[str, ...], start: float) -> StepSample:
    return StepSample(
        start=start, requests=len(planned), target_tokens=9, verified_tokens=5, drafted_tokens=12,
        drafter_rows=0, prefill=False, runner_ms=20.0, draft_ms=5.0, planner_ms=1.0, planned=planned,
    )


def test_the_runner_times_a_step_only_when_the_next_follows_it_directly():
    runner = WCSRunnerMixin.__new__(WCSRunnerMixin)
    runner.wcs = RecordingController()
    runner._wcs_last = last_step(("a", "b", "c", "d"), start=1.0)
    runner._wcs_time_last_step(1.05, {"b": 3, "e": 40})
    assert runner.wcs.steps == [(4, 12, 4 + 5, pytest.approx(50.0))]
    # Negative control: the engine idled in between (none of the step's requests runs on).
    runner._wcs_last = last_step(("a", "b"), start=2.0)
    runner._wcs_time_last_step(9.0, {"x": 1})
    assert len(runner.wcs.steps) == 1 and runner._wcs_last is None
