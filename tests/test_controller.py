"""The step controller's plan hold: a plan that drafts nothing holds for `replan_every - 1` steps."""

import time

import numpy as np
import pytest

from replicas.wcs.config import WCSConfig
from replicas.wcs.controller import StepController
from scheduling.cost_model import StepCostModel
from scheduling.estimators import ConstantEstimator

K = 4
CHEAP = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.1, per_draft_ms=0.01, per_target_ms=0.1)
DEAR = CHEAP.model_copy(update={"draft_launch_ms": 1e4})  # drafting never pays


def controller(cost: StepCostModel, replan_every: int, replan_max: int | None = None) -> StepController:
    estimator = ConstantEstimator(K, prior=0.8, prior_weight=100.0)
    # No probes: this file tests the hold alone (probes end holds: tests/test_closed_loop.py).
    config = WCSConfig(replan_every=replan_every, replan_max=replan_max or replan_every, explore_every=None)
    return StepController(config, K, estimator, cost=cost)


def step(ctl: StepController, batch: int = 3) -> np.ndarray:
    """One step as the runner drives it: features only when the controller plans; last step's drafts were
    all verified and accepted."""
    ids = [f"r{i}" for i in range(batch)]
    last = ctl._draft if len(ctl._draft) == batch else np.zeros(batch, np.int64)
    ctl.observe(ids, last.copy(), last.copy())
    features = None if ctl.holds_no_drafts() else np.zeros((batch, 8))
    draft = ctl.plan(ids, features, np.full(batch, K))
    if draft.any():
        ctl.verify(np.full((batch, K), 0.9))
    return draft


def test_plans_without_drafts_in_a_row_double_the_hold_up_to_replan_max():
    ctl = controller(DEAR, replan_every=2, replan_max=8)
    planned = []
    for _ in range(30):
        planned.append(not ctl.holds_no_drafts())
        assert not step(ctl).any()
    starts = [n for n, p in enumerate(planned) if p]
    assert starts == [0, 2, 6, 14, 22]  # holds of 2, 4, 8, 8 steps


def test_a_plan_without_drafts_holds_for_the_next_steps():
    ctl = controller(DEAR, replan_every=4)
    held = []
    for _ in range(12):
        held.append(ctl.holds_no_drafts())
        assert not step(ctl).any()
    assert held == [False, True, True, True] * 3
    assert ctl.stats.held_steps == 9 and ctl.stats.steps == 12
    # A planning step must have its features.
    with pytest.raises(ValueError, match="features"):
        ctl.plan(["r0"], None, np.full(1, K))


@pytest.mark.parametrize(("cost", "replan_every"), [(CHEAP, 4), (DEAR, 1)])
def test_no_hold_after_plans_that_draft_or_with_replan_every_one(cost, replan_every):
    """Negative controls: a plan that drafts never holds, and `replan_every=1` plans every step."""
    ctl = controller(cost, replan_every)
    drafts = [step(ctl).any() for _ in range(8)]
    assert all(drafts) == (cost is CHEAP)
    assert ctl.stats.held_steps == 0


def test_a_plan_where_no_request_could_draft_does_not_hold():
    """All requests prefilling (widths capped at 0): the next step must plan."""
    ctl = controller(CHEAP, replan_every=4)
    ids = ["r0", "r1"]
    assert not ctl.plan(ids, np.zeros((2, 8)), np.zeros(2, np.int64)).any()
    assert not ctl.holds_no_drafts()


def test_a_new_policy_plans_at_once():
    ctl = controller(DEAR, replan_every=4)
    step(ctl)
    assert ctl.holds_no_drafts()
    ctl.set_policy("wcs")
    assert not ctl.holds_no_drafts()


def test_each_policy_learns_only_from_its_own_steps():
    """Steps served under static move static's online step cost and estimator; wcs starts from the profile and
    the fitted estimator, and static gets back what it had learned."""
    ctl = StepController(WCSConfig(), K, ConstantEstimator(K, prior=0.8, prior_weight=1.0), cost=CHEAP)
    ctl.set_policy("static")
    fitted = ctl.estimator.hazards.copy()
    for _ in range(64):  # steps that take twice their profile, and drafts never accepted
        ctl.observe_step(4, 0, 4, 2 * CHEAP.step_ms(4, 0, 4))
        ctl.estimator.update(None, np.full(8, K), np.zeros(8, np.int64))
    static_cost, static_belief = ctl.cost_model.step_ms(4, 0, 4), ctl.estimator.hazards.copy()
    assert static_cost > 1.5 * CHEAP.step_ms(4, 0, 4) and static_belief[0] < 0.5 * fitted[0]  # static learned
    ctl.set_policy("wcs")
    assert ctl.cost_model.step_ms(4, 0, 4) == CHEAP.step_ms(4, 0, 4)
    assert ctl.estimator.hazards == pytest.approx(fitted)
    ctl.set_policy("static")
    assert ctl.cost_model.step_ms(4, 0, 4) == static_cost
    assert ctl.estimator.hazards == pytest.approx(static_belief)


def test_the_tpot_pace_counts_each_requests_slack_from_its_first_token():
    ctl = StepController(WCSConfig(pace_tpot_ms=10.0), K, ConstantEstimator(K, prior=0.8, prior_weight=100.0), cost=CHEAP)
    assert ctl.slack_ms(["a", "b"], np.array([1, 0]), now=100.0).tolist() == [0.0, np.inf]  # b is still prefilling
    # 50 ms later a has 4 more tokens (40 ms of pace): 10 ms behind; b's pace starts at its first token.
    assert ctl.slack_ms(["a", "b"], np.array([5, 1]), now=100.05) == pytest.approx([-10.0, 0.0])
    assert ctl.slack_ms(["a", "b"], np.array([12, 3]), now=100.08) == pytest.approx([30.0, -10.0])
    ctl.finish(["a"])  # finished or preempted: a request that comes back starts a new pace
    assert ctl.slack_ms(["a"], np.array([12]), now=100.2).tolist() == [0.0]


def test_a_request_short_of_slack_shortens_the_step_and_one_ahead_or_far_behind_does_not():
    """The same batch and estimates, at a pace of 2 ms per token where every verified token costs 1.5 ms:
    a request with 14 ms of slack bounds the step the argmax wants (21.2 ms, 3 drafts each); with 90 ms it
    does not, nor when it is so far behind that even the shortest step (12.2 ms) cannot keep it on pace."""
    dear = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.1, per_draft_ms=0.5, per_target_ms=1.0)
    estimator = ConstantEstimator(K, prior=0.8, prior_weight=100.0)
    ids, features, width = ["a", "b"], np.zeros((2, 8)), np.full(2, K)
    free = StepController(WCSConfig(), K, estimator, cost=dear).plan(ids, features, width, generated=np.array([1, 1]))
    assert free.sum() > 0
    plans = {}
    for a_tokens in (13, 51, 1):  # a's tokens 10 ms after its first: 14 ms ahead, 90 ms ahead, 10 ms behind
        ctl = StepController(WCSConfig(pace_tpot_ms=2.0), K, estimator, cost=dear)
        ctl.slack_ms(ids, np.array([1, 1]), now=time.perf_counter() - 0.010)
        plans[a_tokens] = ctl.plan(ids, features, width, generated=np.array([a_tokens, 51])).tolist()
    assert free.tolist() == [3, 3] and sum(plans[13]) < free.sum()
    assert plans[51] == plans[1] == free.tolist()


def test_wcs_asks_a_plan_for_more_than_its_margin_where_drafting_steps_were_mispredicted():
    ctl = StepController(WCSConfig(draft_margin=0.05), K, ConstantEstimator(K, prior=0.8, prior_weight=100.0), cost=CHEAP)
    assert ctl.margin(16) == 0.05  # nothing measured: the configured margin
    for _ in range(12):
        ctl.observe_step(16, 20, 30, 1.5 * CHEAP.step_ms(16, 20, 30))
    assert ctl.margin(16) > 0.3 and ctl.margin(1) == 0.05
    # Control: without the online correction the configured margin alone.
    ctl.config.online_cost = False
    assert ctl.margin(16) == 0.05


def test_a_return_to_drafting_pays_its_share_of_the_deferred_context_store():
    """The same beliefs and step cost; only the context the held steps deferred differs. A store that, spread
    over `replan_max` steps, outweighs the plan's gain keeps the engine holding; none, or a small one, does not."""
    def drafts(rows: int) -> bool:
        ctl = StepController(WCSConfig(explore_every=None), K, ConstantEstimator(K, prior=0.5, prior_weight=1e6), cost=CHEAP)
        ctl._online.context_ms_per_row = 0.01  # as timed stores would have measured it
        ids = [f"r{i}" for i in range(8)]
        return bool(ctl.plan(ids, np.zeros((8, 8)), np.full(8, K), context_rows=rows).any())

    assert drafts(0) and drafts(100)
    assert not drafts(1_000_000)  # 10 s of store: 156 ms a step over 64 steps


def test_verdicts_return_each_request_the_rows_it_was_drafted_on_whichever_step_drafted_it():
    """The tracker gathers a step's verdict rows from the drafting steps' arrays: in one step's order, and row by
    row where the requests verified now drafted in different steps (a request that skipped a step)."""
    from replicas.wcs.features import AcceptanceTracker
    from scheduling.traces import PreDraftInputs

    k = 3
    tracker = AcceptanceTracker(k)

    def draft(ids: list[str], base: float) -> None:
        n = len(ids)
        inputs = PreDraftInputs(base + np.arange(n * 2, dtype=float).reshape(n, 2), base + np.arange(n, dtype=float))
        prior = np.full((n, k), base / 100)
        confidence = np.full((n, k), 0.5) + np.arange(n)[:, None] / 10
        tracker.drafted(ids, inputs, prior, confidence, np.full(n, 2))

    draft(["a", "b", "c"], 10.0)
    draft(["c", "a"], 20.0)  # b skips this step; c and a draft again
    v = tracker.verdicts(["b", "a", "c"], np.array([2, 2, 0]), np.array([1, 0, 0]))
    assert v is not None
    assert v.rows.inputs.features.tolist() == [[12.0, 13.0], [22.0, 23.0]]  # b's row of the first step, a's of the second
    assert v.rows.inputs.history.tolist() == [11.0, 21.0]
    assert v.prior[:, 0].tolist() == [0.1, 0.2]
    assert np.isnan(v.rows.confidence[:, 2]).all() and v.rows.confidence[:, :2].tolist() == [[0.6, 0.6], [0.6, 0.6]]
    v = tracker.verdicts(["c", "a"], np.array([2, 1]), np.array([2, 1]))  # both from the second step
    assert v.rows.inputs.features.tolist() == [[20.0, 21.0], [22.0, 23.0]] and v.rows.accepted.tolist() == [2, 1]


def test_tensor_parallel_ranks_whose_probe_rounds_differ_hold_the_same_steps():
    """Rank 0 decides for every rank (`replicas.wcs.sharing`): whether to hold, and the plan. Each rank prices probe
    rounds from its own timings; here rank 0 always affords one and rank 1 never does. Rank 1 must judge the shared
    plan by rank 0's probes too, or it is told to hold where its own count does not allow it (its plan() refused
    those steps: a flaky `tests/test_wcs_tp.py`)."""
    from collections import deque

    ranks = []
    for rank in (0, 1):
        ctl = StepController(WCSConfig(replan_every=2, replan_max=8), K, ConstantEstimator(K, prior=0.8, prior_weight=100.0), cost=DEAR)
        ctl.probes.affordable = lambda cost_ms, rank=rank: rank == 0
        ranks.append(ctl)
    sent: deque = deque()

    def share(rank: int):
        def f(value):
            if rank == 0:
                sent.append(value)
                return value
            return sent.popleft()
        return f

    ids = [f"r{i}" for i in range(3)]
    for _ in range(60):
        holding = ranks[0].holds_no_drafts()  # the runner shares rank 0's decision to hold
        for rank, ctl in enumerate(ranks):
            last = ctl._draft if len(ctl._draft) == len(ids) else np.zeros(len(ids), np.int64)
            ctl.observe(ids, last.copy(), last.copy())
            draft = ctl.plan(ids, None if holding else np.zeros((len(ids), 8)), np.full(len(ids), K), share=share(rank))
            if draft.any():
                ctl.verify(np.full((len(ids), K), 0.9))
        assert not sent  # every value rank 0 shared, rank 1 took
    assert ranks[0].stats.held_steps > 20
    assert ranks[0].stats.held_steps == ranks[1].stats.held_steps
    assert ranks[0].stats.drafted_per_pos == ranks[1].stats.drafted_per_pos
