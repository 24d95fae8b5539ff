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


def run_trap(config: WCSConfig, policy: str = "wcs", steps: int = 64, batch: int = 4, seed: int = 0) -> list[int]:
    """Verified drafts per step of a controller whose estimator believes 0.05 while drafts are accepted at 0.8."""
    estimator = ConstantEstimator(K, prior=0.05, prior_weight=1e6)  # its own updates cannot move it
    ctl = StepController(config.model_copy(update={"policy": policy}), K, estimator, cost=TRAP_COST)
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(batch)]
    verified = np.zeros(batch, np.int64)
    accepted = np.zeros(batch, np.int64)
    out = []
    for _ in range(steps):
        ctl.observe(ids, verified, accepted)
        features = None if ctl.holds_no_drafts() else np.zeros((batch, 8))
        draft = ctl.plan(ids, features, np.full(batch, K))
        verified = ctl.verify(np.full((batch, K), 0.9)) if draft.any() else np.zeros(batch, np.int64)
        accepted = np.minimum(np.cumprod(rng.random((batch, K)) < 0.8, axis=1).sum(axis=1), verified)
        out.append(int(verified.sum()))
    return out


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
    never_pays = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=100.0, per_target_ms=0.05)
    ctl = StepController(WCSConfig(explore_every=4, replan_every=64, replan_max=64), K, ConstantEstimator(K, 0.5), cost=never_pays)
    ids, zero = ["old", "new"], np.zeros(2, np.int64)
    drafts = []
    for n in range(6):
        ctl.observe(ids if n else ids[:1], zero if n else zero[:1], zero if n else zero[:1])
        batch = ids if n else ids[:1]
        features = None if ctl.holds_no_drafts() else np.zeros((len(batch), 8))
        drafts.append(ctl.plan(batch, features, np.full(len(batch), K)).tolist())
    # "old" has gone 4 of its steps without a verdict at step 3 (its probe is planned at once), "new" only 3.
    assert drafts[:3] == [[0], [0, 0], [0, 0]] and drafts[3] == [1, 0]
