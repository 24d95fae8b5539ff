"""The online step-cost correction (scheduling/online_cost.py) and how the runner feeds it."""

import numpy as np
import pytest

from replicas.wcs.runner import StepSample, WCSRunnerMixin
from scheduling.cost_model import StepCostModel
from scheduling.online_cost import OnlineCostModel
from scheduling.planner import plan_step

PROFILE = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.5, per_draft_ms=0.3, per_target_ms=0.4, draft_launch_ms=4.0)


def feed(online: OnlineCostModel, steps: int, extra_ms, seed: int = 0, draft_share: float = 0.5, prefill_share: float = 0.0) -> None:
    """Steps of random shape (some drafting, some with prefill chunks) whose periods are the profile's
    prediction plus `extra_ms(rng, drafted, prefill)`."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        r = int(rng.integers(1, 16))
        d = int(rng.integers(1, 8 * r + 1)) if rng.random() < draft_share else 0
        n = r + int(rng.integers(0, d + 1))
        p = int(rng.integers(1, 200)) if rng.random() < prefill_share else 0
        online.observe(r, d, n, PROFILE.step_ms(r, d, n) + extra_ms(rng, d, p), p)


def test_steps_longer_than_profiled_move_the_intercept_by_their_mean_excess():
    online = OnlineCostModel(PROFILE)
    feed(online, 256, lambda rng, d, p: 25.0 + rng.normal(0.0, 5.0))
    assert online.offset_ms == pytest.approx(25.0, abs=1.5)
    served = online.model
    assert served.intercept_ms == pytest.approx(PROFILE.intercept_ms + online.offset_ms)
    # A cost every step pays is not the drafter's: its launch cost and drafted-token slopes stay the
    # profile's (within noise).
    assert abs(online.launch_offset_ms) < 1.5
    assert type(online.offset_ms) is float and type(online.launch_offset_ms) is float  # they travel in the engine's stats
    assert served.step_ms(8, 40, 30) - served.step_ms(4, 1, 4) == pytest.approx(
        PROFILE.step_ms(8, 40, 30) - PROFILE.step_ms(4, 1, 4), abs=1.5
    )
    assert online.draft_scale == pytest.approx(1.0, abs=0.1) and online.context_ms_per_row == 0.0


def test_drafting_steps_longer_than_profiled_move_the_launch_cost_not_the_intercept():
    """What the drafter costs beyond its profile (e.g. storing the context of steps that did not draft)
    lands on its launch cost, so the planner runs it less often, not more."""
    online = OnlineCostModel(PROFILE)
    feed(online, 256, lambda rng, d, p: (12.0 if d else 0.0) + rng.normal(0.0, 3.0), draft_share=0.3)
    # Shrunk towards the profile by the ridge prior (`test_few_drafting_steps_...`), never past the truth.
    assert 0.6 * 12.0 < online.launch_offset_ms < 12.5
    assert abs(online.offset_ms) < 2.0
    # Near break-even the planner then stops drafting (a larger launch cost must be earned by a whole step's
    # gain). Negative control: the same excess spread over every step, as a mean residual, would make it draft more.
    rng = np.random.default_rng(0)
    survival = np.cumprod(rng.uniform(0.5, 0.8, size=(12, 8)), axis=1)
    profiled = plan_step(survival, PROFILE).draft.sum()
    assert profiled > 0 and plan_step(survival, online.model).draft.sum() == 0
    mean_excess = PROFILE.model_copy(update={"intercept_ms": PROFILE.intercept_ms + 0.3 * 12.0})
    assert plan_step(survival, mean_excess).draft.sum() > profiled


def test_drafted_tokens_dearer_than_profiled_scale_the_drafting_slopes():
    """At a large batch the drafter's per-token cost ran 1.8x its profile: a constant launch offset cannot
    price a wide plan, a slope can. The planner then drafts less; negative control: the same steps at the
    profile's price leave the slopes alone."""
    online = OnlineCostModel(PROFILE)
    feed(online, 256, lambda rng, d, p: 0.8 * 0.3 * d + rng.normal(0.0, 1.0), draft_share=0.5)
    assert online.draft_scale == pytest.approx(1.8, abs=0.25)  # (shrunk a little: rows at other loads weigh less)
    assert abs(online.launch_offset_ms) < 2.0 and abs(online.offset_ms) < 1.5
    rng = np.random.default_rng(0)
    survival = np.cumprod(rng.uniform(0.5, 0.8, size=(12, 8)), axis=1)
    assert plan_step(survival, online.model).draft.sum() < plan_step(survival, PROFILE).draft.sum()
    control = OnlineCostModel(PROFILE)
    feed(control, 256, lambda rng, d, p: rng.normal(0.0, 1.0), draft_share=0.5)
    assert control.draft_scale == pytest.approx(1.0, abs=0.1)


def feed_context(online: OnlineCostModel, ms_per_row: float, steps: int = 256) -> None:
    """Steps of which half draft, each drafting step first storing 0..399 deferred context rows, timed."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        r = int(rng.integers(1, 16))
        d = int(rng.integers(1, 8 * r + 1)) if rng.random() < 0.5 else 0
        rows = int(rng.integers(0, 400)) if d else 0
        n = r + d // 2
        store = ms_per_row * rows * rng.uniform(0.8, 1.2)
        online.observe(r, d, n, PROFILE.step_ms(r, d, n) + store + rng.normal(0.0, 0.5), 0, rows, store)


def stretch(online: OnlineCostModel, r: int, scale: float, steps: int, seed: int) -> None:
    """Steps at `r` requests, half of them drafting, whose drafting costs `scale` times its profile."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        d = int(rng.integers(1, 4 * r + 1)) if rng.random() < 0.5 else 0
        n = r + d // 2
        extra = (scale - 1.0) * float(PROFILE.drafted(float(d)))
        online.observe(r, d, n, PROFILE.step_ms(r, d, n) + extra + rng.normal(0.0, 0.3))


def test_the_correction_is_local_to_the_load_it_was_measured_at(monkeypatch):
    """Drafting as profiled at 4 requests and at 1.8x its profile at 64: back at 4 the engine prices it as
    profiled, and back at 64 its old rows count again at once. Negative control: judged without regard to
    load, the two loads blend."""
    online = OnlineCostModel(PROFILE)
    stretch(online, 64, 1.8, 128, seed=0)
    stretch(online, 4, 1.0, 128, seed=1)
    assert online.draft_scale == pytest.approx(1.0, abs=0.1)
    stretch(online, 64, 1.8, 32, seed=2)
    assert online.draft_scale > 1.5
    import scheduling.online_cost as online_cost

    monkeypatch.setattr(online_cost, "LOAD_WIDTH", 1e9)
    blind = OnlineCostModel(PROFILE)
    stretch(blind, 64, 1.8, 128, seed=0)
    stretch(blind, 4, 1.0, 128, seed=1)
    assert blind.draft_scale > 1.2


def test_stored_context_is_priced_per_row_into_the_next_drafting_step():
    """Staying ready to draft has a price: a drafting step first stores the context the steps without drafts
    deferred. The store is timed; its cost per row prices the probe rounds that would store them,
    and kept out of the regression (it would otherwise land on the launch or the slopes)."""
    online = OnlineCostModel(PROFILE)
    feed_context(online, 0.02)
    assert online.context_ms_per_row == pytest.approx(0.02, rel=0.05)
    assert abs(online.launch_offset_ms) < 0.6 and online.draft_scale == pytest.approx(1.0, abs=0.05)
    # Negative control: the same stores, not timed apart, land on the drafting terms.
    blind = OnlineCostModel(PROFILE)
    rng = np.random.default_rng(0)
    for _ in range(256):
        r = int(rng.integers(1, 16))
        d = int(rng.integers(1, 8 * r + 1)) if rng.random() < 0.5 else 0
        rows = int(rng.integers(0, 400)) if d else 0
        blind.observe(r, d, r + d // 2, PROFILE.step_ms(r, d, r + d // 2) + 0.02 * rows + rng.normal(0.0, 0.5))
    assert blind.context_ms_per_row == 0.0 and blind.launch_offset_ms > 1.5


def test_prefill_chunks_are_kept_out_of_the_intercept():
    """Prefill is work per request, not per step: it neither moves the intercept nor hides a real offset."""
    online = OnlineCostModel(PROFILE)
    # Half the steps carry 1..199 prefill tokens (mean 100) at 0.1 ms each: 5 ms per step on average.
    feed(online, 256, lambda rng, d, p: 0.1 * p + rng.normal(0.0, 2.0), prefill_share=0.5)
    assert abs(online.offset_ms) < 1.0
    assert abs(online.launch_offset_ms) < 1.5
    # Negative control: the same 5 ms on every step, prefill or not, is the step's and moves the intercept.
    shifted = OnlineCostModel(PROFILE)
    feed(shifted, 256, lambda rng, d, p: 0.1 * p + 5.0 + rng.normal(0.0, 2.0), prefill_share=0.5)
    assert shifted.offset_ms == pytest.approx(5.0, abs=1.0)


def test_few_drafting_steps_move_the_launch_cost_little_and_only_drafting_steps_revise_it(monkeypatch):
    """The ridge prior: an estimate from a handful of drafting steps is shrunk towards the profile. Drafting
    steps have a window of their own: a long stretch without drafts keeps what drafting was seen to cost (a
    controller holding would otherwise return to drafting at a loss every window), and the next drafting
    steps revise it."""
    import scheduling.online_cost as online_cost

    monkeypatch.setattr(online_cost, "LOAD_WIDTH", 1e9)  # the steps' loads vary at random here (locality: below)
    many = OnlineCostModel(PROFILE, window=64, half_life_steps=10**9)  # (fading: test_rows_fade_...)
    feed(many, 128, lambda rng, d, p: 10.0 if d else 0.0, draft_share=0.5)
    # What a regression with a ridge prior gives: the evidence on [drafted] from n1 drafting and n0 other
    # steps is n1 n0 / (n1 + n0), about 64 * 64 / 128 = 32 steps here.
    assert many.launch_offset_ms == pytest.approx(10.0 * 32 / (32 + many.prior_weight), abs=1.5)
    few = OnlineCostModel(PROFILE, window=64, half_life_steps=10**9)
    feed(few, 128, lambda rng, d, p: 10.0 if d else 0.0, draft_share=0.05)
    assert 0.0 < few.launch_offset_ms < 0.6 * many.launch_offset_ms
    before = many.launch_offset_ms
    feed(many, 256, lambda rng, d, p: 0.0, seed=1, draft_share=0.0)
    assert many.launch_offset_ms == pytest.approx(before, abs=1.0)
    feed(many, 256, lambda rng, d, p: 0.0, seed=2, draft_share=0.5)
    assert abs(many.launch_offset_ms) < 0.6 and many.draft_scale == pytest.approx(1.0, abs=0.05)


def test_steps_as_profiled_leave_the_profile_in_place():
    """Negative control: nothing to correct, nothing corrected."""
    online = OnlineCostModel(PROFILE)
    feed(online, 256, lambda rng, d, p: rng.normal(0.0, 0.1))
    assert online.model is PROFILE and online.offset_ms == 0.0


def test_rows_fade_and_outliers_are_clipped_so_a_warm_up_cannot_price_drafting_out():
    """A handful of drafting steps hundreds of ms long (first calls) move the launch cost by at most about
    twice those steps' prediction, and a long hold afterwards returns it towards the profile. Control: the
    same handful at a plausible excess is learnt."""
    warm = OnlineCostModel(PROFILE, window=64)
    feed(warm, 8, lambda rng, d, p: 500.0 if d else 0.0, draft_share=0.5)
    feed(warm, 120, lambda rng, d, p: 0.0, seed=1, draft_share=0.0)
    assert 0.0 < warm.launch_offset_ms < 40.0
    early = warm.launch_offset_ms
    feed(warm, 1024, lambda rng, d, p: 0.0, seed=2, draft_share=0.0)
    assert warm.launch_offset_ms < 0.4 * early
    plausible = OnlineCostModel(PROFILE, window=64)
    feed(plausible, 8, lambda rng, d, p: 20.0 if d else 0.0, draft_share=0.5)
    feed(plausible, 120, lambda rng, d, p: 0.0, seed=1, draft_share=0.0)
    assert plausible.launch_offset_ms > 2.0


def test_the_window_forgets_older_steps():
    online = OnlineCostModel(PROFILE, window=64, refresh_every=16)
    feed(online, 64, lambda rng, d, p: 15.0, draft_share=0.0)
    assert online.offset_ms == pytest.approx(15.0)
    feed(online, 64, lambda rng, d, p: 5.0, seed=1, draft_share=0.0)
    assert online.offset_ms == pytest.approx(5.0, abs=0.1)


def test_faster_steps_than_profiled_never_make_a_step_free():
    """A profile taken on a loaded machine is corrected down by nearly all of its intercept, never to a step
    that costs nothing (every tokens-per-ms ratio would divide by zero)."""
    from scheduling.online_cost import MIN_INTERCEPT_MS

    online = OnlineCostModel(PROFILE)
    feed(online, 64, lambda rng, d, p: -50.0)
    assert online.model.intercept_ms == MIN_INTERCEPT_MS
    assert online.offset_ms == pytest.approx(MIN_INTERCEPT_MS - PROFILE.intercept_ms)


def test_a_longer_fixed_step_cost_makes_the_planner_draft_more():
    """Why the correction matters: with the same survival curves, a step made longer by work the
    planner cannot change makes drafted tokens cheaper relative to it."""
    rng = np.random.default_rng(0)
    survival = np.cumprod(rng.uniform(0.3, 0.8, size=(12, 8)), axis=1)
    online = OnlineCostModel(PROFILE)
    idle = plan_step(survival, online.model).draft.sum()
    feed(online, 128, lambda rng, d, p: 60.0)
    loaded = plan_step(survival, online.model).draft.sum()
    assert loaded > idle
    control = OnlineCostModel(PROFILE)
    feed(control, 128, lambda rng, d, p: 0.0)
    assert plan_step(survival, control.model).draft.sum() == idle


class RecordingController:
    """Stand-in for the step controller: records what the runner hands it."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def observe_step(self, *args) -> None:
        self.steps.append(args)


def last_step(planned: tuple[str, ...], start: float, target_tokens: int = 9) -> StepSample:
    return StepSample(
        start=start, requests=len(planned), target_tokens=target_tokens, verified_tokens=5, drafted_tokens=12,
        drafter_rows=0, prefill=False, runner_ms=20.0, draft_ms=5.0, planner_ms=1.0, planned=planned,
    )


def test_the_runner_times_a_step_only_when_the_next_follows_it_directly():
    runner = WCSRunnerMixin.__new__(WCSRunnerMixin)
    runner.wcs = RecordingController()
    runner._wcs_last = last_step(("a", "b", "c", "d"), start=1.0)
    runner._wcs_time_last_step(1.05, {"b": 3, "e": 40})
    assert runner.wcs.steps == [(4, 12, 4 + 5, pytest.approx(50.0), 0, 0, 0.0)]
    # Target tokens beyond the requests and their verified drafts are prefill chunks.
    runner._wcs_last = last_step(("a", "b"), start=1.05, target_tokens=40)
    runner._wcs_time_last_step(1.08, {"a": 1})
    assert runner.wcs.steps[-1] == (2, 12, 2 + 5, pytest.approx(30.0), 40 - 7, 0, 0.0)
    # Negative control: the engine idled in between (none of the step's requests runs on).
    runner._wcs_last = last_step(("a", "b"), start=2.0)
    runner._wcs_time_last_step(9.0, {"x": 1})
    assert len(runner.wcs.steps) == 2 and runner._wcs_last is None



def test_the_drafting_error_is_what_drafting_steps_near_this_load_were_missed_by():
    """Twelve drafting steps at 64 requests that each took 1.3x their prediction: the error there is 0.3 shrunk
    by the prior (12/16 of it), at 2 requests about nothing. Controls: steps as predicted, or alternately 20%
    shorter and longer (noise, not bias), leave it near zero."""
    off, exact, noisy = OnlineCostModel(PROFILE), OnlineCostModel(PROFILE), OnlineCostModel(PROFILE)
    for online, factors in ((off, [1.3]), (exact, [1.0]), (noisy, [0.8, 1.2])):
        for i in range(12):
            online.observe(64, 100, 100, factors[i % len(factors)] * PROFILE.step_ms(64, 100, 100))
    assert off.drafting_error(64) == pytest.approx(0.3 * 12 / 16, rel=0.02)
    assert off.drafting_error(2) < 0.01
    assert exact.drafting_error(64) < 0.005 and noisy.drafting_error(64) < 0.02
    # Steps without drafts, or with prefill chunks in them, are not drafting steps to be judged.
    for _ in range(50):
        exact.observe(64, 0, 64, 3 * PROFILE.step_ms(64, 0, 64))
        exact.observe(64, 100, 100, 3 * PROFILE.step_ms(64, 100, 100), prefill=200)
    assert exact.drafting_error(64) < 0.005
