"""The TPOT slack cap: per-request step budgets, and the controller drafting less for a request behind its SLO."""

import numpy as np
import pytest

from replicas.wcs.config import WCSConfig
from replicas.wcs.controller import StepController
from scheduling.cost_model import StepCostModel
from scheduling.estimators import ConstantEstimator
from scheduling.tpot_slack import TPOTSlack

K = 4
# Two requests: a plain step takes 5.4 ms, one more drafted and verified slot 1.1 ms, every slot 14.2 ms in all;
# at 90% acceptance drafting pays.
COST = StepCostModel.linear(intercept_ms=5.0, per_request_ms=0.1, per_draft_ms=1.0, per_target_ms=0.1)


def test_budgets_are_the_slo_plus_each_requests_slack_spread_over_its_remaining_tokens():
    slack = TPOTSlack(slo_ms=20.0)
    ids = ["on-track", "ahead", "behind", "lost"]
    # First seen at t=0 after 1, 1, 1, 1 tokens: no history yet, every budget is the SLO.
    assert slack.step_cap_ms(ids, np.array([1, 1, 1, 1]), np.array([50, 50, 50, 50]), 0.0, 5.0) == pytest.approx(20.0)
    # 100 ms later: 5, 10, 3 and 1 tokens since. Budgets 20 + (20 m - 100) / r:
    # on-track (5, r=46): 20; ahead (10, r=41): 20 + 100/41; behind (3, r=48): 20 - 40/48; lost (1, r=2): 20 - 80/2 < 5.
    cap = slack.step_cap_ms(ids, np.array([6, 11, 4, 2]), np.array([46, 41, 48, 2]), 100.0, 5.0)
    assert cap == pytest.approx(20.0 - 40.0 / 48)  # the behind request binds; the lost one does not hold it back
    # Without the behind request the on-track one binds at exactly the SLO.
    assert slack.step_cap_ms(ids[:2], np.array([6, 11]), np.array([46, 41]), 100.0, 5.0) == pytest.approx(20.0)
    # Nothing saveable: no cap.
    assert slack.step_cap_ms(["lost"], np.array([2]), np.array([2]), 100.0, 5.0) is None


def test_forgotten_requests_start_afresh():
    slack = TPOTSlack(slo_ms=10.0)
    slack.step_cap_ms(["a"], np.array([1]), np.array([10]), 0.0, 1.0)
    assert slack.step_cap_ms(["a"], np.array([2]), np.array([9]), 50.0, 1.0) == pytest.approx(10.0 - 40.0 / 9)
    slack.forget(["a"])
    assert slack.step_cap_ms(["a"], np.array([2]), np.array([9]), 50.0, 1.0) == pytest.approx(10.0)


def controller(tpot_slo_ms: float | None) -> StepController:
    config = WCSConfig(policy="wcs", estimator="constant", tpot_slo_ms=tpot_slo_ms, online_cost=False)
    ctl = StepController(config, K, ConstantEstimator(K, prior=0.9, prior_weight=1000.0), cost=COST)
    ctl.clock = lambda: ctl.now_s
    return ctl


def drafts_after_falling_behind(ctl: StepController) -> int:
    """Two requests planned at t=0, then 850 ms later with 2 tokens each since, 58 to go: behind a 20 ms TPOT,
    and their step budget 20 + (2 * 20 - 850) / 58 = 6.03 ms leaves no room for a drafted slot."""
    ids, features, width = ["a", "b"], np.zeros((2, 1)), np.full(2, K)
    ctl.now_s = 0.0
    first = ctl.plan(ids, features, width, generated=np.array([1, 1]), left=np.array([60, 60]))
    assert first.sum() > 0  # on track: drafting pays and fits the SLO
    ctl.now_s = 0.85
    return int(ctl.plan(ids, features, width, generated=np.array([3, 3]), left=np.array([58, 58])).sum())


def test_a_request_behind_its_tpot_slo_caps_drafting():
    capped = controller(tpot_slo_ms=20.0)
    assert drafts_after_falling_behind(capped) == 0
    assert capped.stats.slo_capped_steps == 2


def test_without_a_tpot_slo_the_same_requests_draft():
    """Negative control: the same steps without the SLO draft as before."""
    assert drafts_after_falling_behind(controller(tpot_slo_ms=None)) > 0


def test_a_replica_hands_its_tpot_slo_to_wcs_unless_told_not_to():
    from replicas.deployment import ReplicaConfig
    from replicas.engine import EngineConfig

    assert ReplicaConfig(tpot_slo_ms=30.0).replica_engine().wcs.tpot_slo_ms == 30.0
    off = EngineConfig(wcs=WCSConfig(slo_step_cap=False))
    assert ReplicaConfig(tpot_slo_ms=30.0, engine=off).replica_engine().wcs.tpot_slo_ms is None
    own = EngineConfig(wcs=WCSConfig(tpot_slo_ms=50.0))
    assert ReplicaConfig(tpot_slo_ms=30.0, engine=own).replica_engine().wcs.tpot_slo_ms == 50.0


def test_a_request_still_prefilling_neither_binds_nor_starts_its_clock():
    slack = TPOTSlack(slo_ms=10.0)
    assert slack.step_cap_ms(["p"], np.array([0]), np.array([10]), 0.0, 1.0) is None
    # Its first token comes 300 ms later: its TPOT clock starts there, not at the prefill.
    assert slack.step_cap_ms(["p"], np.array([1]), np.array([9]), 300.0, 1.0) == pytest.approx(10.0)
