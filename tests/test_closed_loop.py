"""Closed-loop control without an engine: online recalibration, probes, and the trap they get requests out of.

The trap: an estimator that predicts 0.05 everywhere while drafts are accepted at 0.8. The planner then
drafts nothing, so no verdict ever corrects the belief (the negative control). With probes and
recalibration the controller must reach most of `static`'s verified drafts per step within 64 steps.
The engine-level trap test is in tests/test_wcs_engine.py.
"""

import numpy as np
import pytest

from replicas.wcs.config import WCSConfig
from replicas.wcs.controller import StepController
from scheduling.cost_model import StepCostModel
from scheduling.estimators import ConstantEstimator
from scheduling.exploration import ProbeSchedule
from scheduling.recalibration import OnlineRecalibrator
from scheduling.survival import hazards_from_survival, survival_from_hazards

K = 8
# Drafting pays at the true acceptance, not at the believed one (launching the drafter costs 1 ms of 10).
TRAP_COST = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=0.01, per_target_ms=0.05).model_copy(
    update={"draft_launch_ms": 1.0}
)


def test_recalibration_moves_every_position_from_first_position_probes():
    recal = OnlineRecalibrator(K)
    wrong = survival_from_hazards(np.full((4, K), 0.05))
    rng = np.random.default_rng(0)
    for _ in range(20):  # one-token probes, accepted at 0.8
        recal.update(np.full((4, K), 0.05), np.ones(4, np.int64), (rng.random(4) < 0.8).astype(np.int64))
    hazards = hazards_from_survival(recal.apply(wrong))
    assert np.all(hazards > 0.6) and np.all(hazards < 0.95)


def test_recalibration_leaves_a_calibrated_estimator_alone_and_does_nothing_without_verdicts():
    recal = OnlineRecalibrator(K)
    curve = survival_from_hazards(np.full((64, K), 0.6))
    assert recal.apply(curve) is curve  # nothing observed: no change
    rng = np.random.default_rng(1)
    for _ in range(200):
        drafted = np.full(64, K)
        accepted = np.cumprod(rng.random((64, K)) < 0.6, axis=1).sum(axis=1)
        recal.update(np.full((64, K), 0.6), drafted, accepted)
    assert np.abs(hazards_from_survival(recal.apply(curve)) - 0.6).max() < 0.07  # sampling noise, not a bias


def test_probes_fall_due_back_off_on_rejection_and_reset_on_acceptance():
    probes = ProbeSchedule(interval=4, max_backoff=4)
    ids, none = ["a", "b"], np.zeros(2, np.int64)
    assert [probes.observe(ids, none, none) for _ in range(4)] == [False, False, False, True]
    assert probes.due(ids).tolist() == [1, 1]
    probes.observe(ids, np.array([1, 1]), np.array([0, 1]))  # a's probe rejected, b's accepted
    for _ in range(4):
        probes.observe(ids, none, none)
    assert probes.due(ids).tolist() == [0, 1]  # a waits 8 steps now
    for _ in range(4):
        probes.observe(ids, none, none)
    assert probes.due(ids).tolist() == [1, 1]
    probes.forget(["a"])
    assert probes.due(["a"]).tolist() == [0]


def drive(ctl: StepController, steps: int, batch: int, accept: float, seed: int = 0) -> tuple[list[int], int]:
    """Steps as the runner drives them, drafts accepted at `accept` per position: verified drafts per step,
    and how many steps drafted."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(batch)]
    verified = accepted = np.zeros(batch, np.int64)
    out, drafting = [], 0
    for _ in range(steps):
        ctl.observe(ids, verified, accepted)
        features = None if ctl.holds_no_drafts() else np.zeros((batch, 8))
        draft = ctl.plan(ids, features, np.full(batch, K))
        verified = ctl.verify(np.full((batch, K), 0.9)) if draft.any() else np.zeros(batch, np.int64)
        accepted = np.minimum(np.cumprod(rng.random((batch, K)) < accept, axis=1).sum(axis=1), verified)
        out.append(int(verified.sum()))
        drafting += bool(draft.any())
    return out, drafting


def run_trap(config: WCSConfig, policy: str = "wcs", steps: int = 64, batch: int = 4, seed: int = 0) -> list[int]:
    """Verified drafts per step of a controller whose estimator believes 0.05 while drafts are accepted at 0.8."""
    estimator = ConstantEstimator(K, prior=0.05, prior_weight=1e6)  # its own updates cannot move it
    ctl = StepController(config.model_copy(update={"policy": policy}), K, estimator, cost=TRAP_COST)
    return drive(ctl, steps, batch, accept=0.8, seed=seed)[0]


def test_probes_and_recalibration_get_requests_out_of_a_wrong_belief():
    static = np.mean(run_trap(WCSConfig(), policy="static"))
    wcs = run_trap(WCSConfig())
    assert np.mean(wcs[48:]) >= 0.8 * static, (wcs, static)


@pytest.mark.parametrize(
    "config", [WCSConfig(explore_every=None, recalibrate=False), WCSConfig(explore_every=None), WCSConfig(recalibrate=False)]
)
def test_without_probes_or_recalibration_the_wrong_belief_is_never_corrected(config):
    """Negative controls: without probes no verdict arrives; without recalibration the verdicts of probes
    cannot move an estimator this sure of itself."""
    static = np.mean(run_trap(WCSConfig(), policy="static"))
    assert np.mean(run_trap(config)[48:]) < 0.2 * static


def test_a_due_probe_ends_a_hold_and_drafts_one_token_for_that_request_only():
    # A drafted token at 0.5 earns 0.1 tokens per ms, half what a step without drafts does; a probe round
    # costs half a step, which a budget of half the step time affords at once.
    never_pays = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=5.0, per_target_ms=0.05)
    config = WCSConfig(explore_every=4, explore_budget=0.5, replan_every=64, replan_max=64)
    ctl = StepController(config, K, ConstantEstimator(K, 0.5), cost=never_pays)
    ids, zero = ["old", "new"], np.zeros(2, np.int64)
    drafts = []
    for n in range(6):
        ctl.observe(ids if n else ids[:1], zero if n else zero[:1], zero if n else zero[:1])
        batch = ids if n else ids[:1]
        features = None if ctl.holds_no_drafts() else np.zeros((len(batch), 8))
        drafts.append(ctl.plan(batch, features, np.full(len(batch), K)).tolist())
    # "old" has gone 4 of its steps without a verdict at step 3 (its probe is planned at once), "new" only 3.
    assert drafts[:3] == [[0], [0, 0], [0, 0]] and drafts[3] == [1, 0]


def test_probe_rounds_are_paid_from_a_budget_of_step_time():
    probes = ProbeSchedule(interval=4, budget=0.1)
    assert probes.affordable(0.0) and not probes.affordable(1.0)
    for _ in range(5):
        probes.earn(10.0)
    assert probes.credit_ms == pytest.approx(5.0) and probes.affordable(5.0)
    probes.probed(5.0)
    assert not probes.affordable(1.0)
    probes.round_ms = 2.0  # credit is capped at two rounds' worth
    for _ in range(100):
        probes.earn(10.0)
    assert probes.credit_ms == pytest.approx(4.0)


def test_a_probe_round_is_paid_at_its_measured_cost_and_later_rounds_are_priced_up():
    probes = ProbeSchedule(interval=4, budget=0.1)
    for _ in range(10):
        probes.earn(10.0)
    probes.probed(2.0)
    probes.settle(6.0)  # the round cost three times its prediction
    assert probes.credit_ms == pytest.approx(10.0 - 6.0)
    assert probes.overrun == pytest.approx(2.0)  # half way from 1 to 3
    assert not probes.affordable(2.5) and probes.affordable(2.0)  # 5 and 4 ms of credit needed
    probes.settle(100.0)  # no round running: nothing to pay
    assert probes.credit_ms == pytest.approx(4.0)
    probes.probed(0.001)
    probes.settle(1e3)  # a prediction in other units than the measurement cannot price rounds out of reach
    assert probes.overrun == 4.0
    # Control: a round that cost what was predicted leaves the pricing alone.
    fair = ProbeSchedule(interval=4, budget=0.1)
    fair.earn(100.0)
    fair.probed(2.0)
    fair.settle(2.0)
    assert fair.overrun == pytest.approx(1.0) and fair.credit_ms == pytest.approx(8.0)


def probing_steps(cost: StepCostModel, steps: int = 512, batch: int = 16) -> int:
    """Steps that draft, in an engine whose estimator is right that drafts are accepted at 0.5."""
    ctl = StepController(WCSConfig(explore_every=4), K, ConstantEstimator(K, prior=0.5, prior_weight=1e6), cost=cost)
    return drive(ctl, steps, batch, accept=0.5)[1]


def test_an_engine_where_drafting_does_not_pay_probes_within_its_budget(monkeypatch):
    """Every request falls due every few of its steps, but they are probed together in rounds paid from 2% of
    step time: rounds twice as dear run about half as often, and nothing is trapped (rounds keep coming).
    Control: where drafting pays, every step drafts. (The budget is held whole here; the next test halves it.)"""
    from scheduling import exploration

    monkeypatch.setattr(exploration, "MIN_BUDGET_SCALE", 1.0)
    base_ms = TRAP_COST.step_ms(16, 0, 16)
    rounds = {launch: probing_steps(TRAP_COST.model_copy(update={"draft_launch_ms": launch})) for launch in (20.0, 40.0)}
    for launch, n in rounds.items():
        affordable = 0.02 * 512 * base_ms / launch
        assert 0.5 * affordable <= n <= affordable + 2, rounds
    assert rounds[20.0] > rounds[40.0]
    assert probing_steps(TRAP_COST) == 512


def test_rounds_after_which_nothing_drafts_halve_the_probe_budget_and_a_plan_that_drafts_restores_it(monkeypatch):
    """Where drafting is priced out and the estimator is right, a round's verdicts change no plan: each such round
    halves the budget, down to an eighth, so rounds run several times less often than on the whole budget, and
    still run. Controls: the budget held whole (no halving) probes more; where drafting pays it stays whole."""
    from scheduling import exploration

    dear = TRAP_COST.model_copy(update={"draft_launch_ms": 20.0})

    def rounds(steps: int = 2048) -> tuple[int, float]:
        ctl = StepController(WCSConfig(explore_every=4), K, ConstantEstimator(K, prior=0.5, prior_weight=1e6), cost=dear)
        return drive(ctl, steps, 16, accept=0.5)[1], ctl.probes.scale

    halving, scale = rounds()
    assert scale == exploration.MIN_BUDGET_SCALE and halving >= 2
    with monkeypatch.context() as m:
        m.setattr(exploration, "MIN_BUDGET_SCALE", 1.0)
        whole, _ = rounds()
    assert halving <= whole / 3, (halving, whole)
    ctl = StepController(WCSConfig(explore_every=4), K, ConstantEstimator(K, prior=0.5, prior_weight=1e6), cost=TRAP_COST)
    drive(ctl, 256, 16, accept=0.5)
    assert ctl.probes.scale == 1.0


def test_realised_gain_counts_drafts_the_allocator_cut_as_lost():
    """Half of every request's drafted positions are never verified: the planner is told it realises about
    half of what it was promised there. Control: drafts verified and accepted as predicted leave plans alone."""
    from scheduling.recalibration import RealisedGain

    rng = np.random.default_rng(0)
    cut, kept = RealisedGain(K), RealisedGain(K)
    survival = np.tile(0.9 ** np.arange(1, K + 1), (32, 1))
    for _ in range(200):
        drafted = np.full(32, K)
        accepted = np.cumprod(rng.random((32, K)) < 0.9, axis=1).sum(axis=1)
        cut.update(survival, drafted, accepted, verified=np.full(32, K // 2))
        kept.update(survival, drafted, accepted, verified=drafted)
    assert np.all(kept.ratio > 0.9) and np.allclose(kept.apply(survival), survival, atol=0.1)
    assert cut.ratio[0] > 0.9 and np.all(cut.ratio[K // 2 :] < 0.75)
    assert np.all(np.diff(cut.apply(survival), axis=1) <= 0)  # still a survival curve


def test_wcs_drafts_only_for_a_gain_above_its_margin():
    from scheduling.policies import Policy, StepLimits

    cost = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.0, per_draft_ms=0.1, per_target_ms=0.1, draft_launch_ms=6.0)
    survival = np.tile(0.5 ** np.arange(1, K + 1), (4, 1))  # the best plan gains about 4%
    plans = {m: Policy(name="wcs", k=K, margin=m).plan(survival, cost, StepLimits(), np.full(4, K)) for m in (0.0, 0.05)}
    gain = plans[0.0].tokens_per_ms / (4 / cost.step_ms(4, 0, 4))
    assert 1.0 < gain < 1.05 and plans[0.0].draft.any()
    assert not plans[0.05].draft.any()


BLIND = WCSConfig(advantage_feedback=False, mode_gate=False)  # nothing corrects what a plan promises


def realised_rate(config: WCSConfig, accept: float, steps: int = 600, batch: int = 16, seed: int = 0) -> tuple[float, float]:
    """Tokens per ms over the second half of a run where the estimator is sure drafts are accepted at 0.8 and
    nothing corrects it (no recalibration, no probes), while they are accepted at `accept`; step times are as
    modelled. Also the share of those steps that drafted."""
    cost = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=0.1, per_target_ms=0.05, draft_launch_ms=1.0)
    sure = ConstantEstimator(K, prior=0.8, prior_weight=1e6)
    ctl = StepController(config.model_copy(update={"recalibrate": False, "explore_every": None}), K, sure, cost=cost)
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(batch)]
    verified = accepted = np.zeros(batch, np.int64)
    tokens = ms = drafting = 0.0
    for t in range(steps):
        ctl.observe(ids, verified, accepted)
        emitted = batch + int(accepted.sum())
        target = batch + int(verified.sum())
        features = None if ctl.holds_no_drafts() else np.zeros((batch, 8))
        draft = ctl.plan(ids, features, np.full(batch, K))
        d = int(draft.sum())
        verified = ctl.verify(np.full((batch, K), 0.9)) if d else np.zeros(batch, np.int64)
        accepted = np.minimum(np.cumprod(rng.random((batch, K)) < accept, axis=1).sum(axis=1), verified)
        period = cost.step_ms(batch, d, target)
        ctl.observe_step(batch, d, target, period)
        if t >= steps // 2:
            tokens, ms, drafting = tokens + emitted, ms + period, drafting + bool(d)
    return tokens / ms, drafting / (steps - steps // 2)


def test_drafting_that_realises_less_than_it_was_promised_stops_where_it_loses():
    """Drafts are accepted at 0.25 where the estimator is sure of 0.8: drafting promises ~1.6x the tokens per ms
    of a plain step and realises about half. Fed back, the margin stops it (at least 0.95x of never drafting);
    control: without the feedback it drafts at a loss. And where drafts are accepted as believed, the feedback
    leaves drafting on."""
    plain, _ = realised_rate(WCSConfig(policy="ar"), accept=0.25)
    fed, fed_share = realised_rate(WCSConfig(advantage_feedback=True, mode_gate=False), accept=0.25)
    blind, blind_share = realised_rate(BLIND, accept=0.25)
    assert blind < 0.8 * plain and blind_share > 0.9, (blind, plain, blind_share)
    assert fed >= 0.95 * plain and fed_share < 0.2, (fed, plain, fed_share)
    paying, paying_share = realised_rate(WCSConfig(advantage_feedback=True, mode_gate=False), accept=0.8)
    paying_blind, _ = realised_rate(BLIND, accept=0.8)
    assert paying >= 0.98 * paying_blind and paying > 1.2 * plain and paying_share > 0.9, (paying, paying_blind, plain)


def test_the_mode_gate_holds_where_speculating_realises_less_and_speculates_where_it_pays():
    """The same wrong belief, with only the mode gate to correct it: blocks of speculation
    realise less than blocks of holding, so the engine holds but for a block now and then (at least 0.93x of
    never drafting over the run's second half; control: the blind controller, at most 0.8x). Where drafts are
    accepted as believed, speculating realises more: the gate keeps it (at least 0.95x of the blind controller,
    which drafts in every step and is right to)."""
    plain, _ = realised_rate(WCSConfig(policy="ar"), accept=0.25)
    gated, gated_share = realised_rate(WCSConfig(mode_gate=True), accept=0.25)
    blind, _ = realised_rate(BLIND, accept=0.25)
    assert gated >= 0.93 * plain and gated_share < 0.3, (gated, plain, gated_share)
    assert blind < 0.8 * plain
    paying, paying_share = realised_rate(WCSConfig(mode_gate=True), accept=0.8)
    paying_blind, _ = realised_rate(BLIND, accept=0.8)
    assert paying >= 0.95 * paying_blind and paying > 1.2 * plain and paying_share > 0.8, (paying, paying_blind, plain)
