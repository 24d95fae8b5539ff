"""The mode gate (scheduling/mode_gate.py): blocks of speculating or holding per load, served by what each realised."""

import numpy as np
import pytest

from scheduling.mode_gate import HOLD, SPECULATE, ModeGate, load_bin


def serve(gate: ModeGate, steps: int, requests: int, rate: dict[int, float]) -> list[int]:
    """`steps` steps of 10 ms at `requests` requests, each emitting what its arm's `rate` (tokens per ms) says;
    the arm served in each step."""
    served = []
    for _ in range(steps):
        mode = gate.mode
        served.append(mode)
        gate.emitted(round(rate[mode] * 10.0))
        gate.planned(requests)
        gate.ran(10.0)
    return served


def test_each_arm_is_tried_then_the_better_one_serves_and_the_other_is_served_again_now_and_then():
    gate = ModeGate(block_steps=8, half_life_blocks=4.0)
    served = serve(gate, 8 * 40, 16, {SPECULATE: 2.0, HOLD: 3.0})
    blocks = served[::8]
    assert blocks[:4] == [SPECULATE, HOLD, SPECULATE, HOLD]  # two blocks of each to start
    later = blocks[4:]
    assert later.count(HOLD) > 0.7 * len(later)  # the better arm serves ...
    assert SPECULATE in later[-10:]  # ... and the loser is checked again
    np.testing.assert_allclose(gate.rates(16), [2.0, 3.0], rtol=0.05)
    # Control: with the rates the other way round, speculation serves.
    other = ModeGate(block_steps=8, half_life_blocks=4.0)
    later = serve(other, 8 * 40, 16, {SPECULATE: 3.0, HOLD: 2.0})[::8][4:]
    assert later.count(SPECULATE) > 0.7 * len(later)


def test_each_load_has_its_own_evidence():
    gate = ModeGate(block_steps=8, half_life_blocks=4.0)
    serve(gate, 8 * 20, 1, {SPECULATE: 3.0, HOLD: 2.0})
    serve(gate, 8 * 20, 64, {SPECULATE: 2.0, HOLD: 3.0})
    assert gate.rates(1)[SPECULATE] > gate.rates(1)[HOLD] and gate.rates(64)[SPECULATE] < gate.rates(64)[HOLD]
    assert load_bin(46) == load_bin(64) == load_bin(90) == 6 and load_bin(45) == 5 and load_bin(0) == 0
    # Back at one request, the gate goes on from the evidence there: no new round of trying both arms.
    assert serve(gate, 8 * 10, 1, {SPECULATE: 3.0, HOLD: 2.0})[8::8].count(SPECULATE) >= 7


def test_a_step_whose_period_is_not_known_counts_for_nothing():
    gate = ModeGate(block_steps=4)
    for _ in range(4):
        gate.emitted(100)  # the engine idled after each: no period
        gate.planned(4)
    gate.emitted(1)
    gate.ran(10.0)
    assert np.isnan(gate.rates(4)).all()  # the block closed with no measured step: nothing was learned
    with pytest.raises(ValueError):
        ModeGate(block_steps=0)


@pytest.mark.parametrize("policy", ["wcs", "static"])
def test_the_controller_holds_whole_blocks_where_holding_realises_more(policy):
    """Drafts are accepted at 0.25 where the estimator is sure of 0.8 and nothing else corrects it (steps take what
    the cost model says): `wcs` soon serves blocks in which every step holds (no features asked for). Control:
    `static`, which does not choose whether to draft, is never gated."""
    from replicas.wcs.config import WCSConfig
    from replicas.wcs.controller import StepController
    from scheduling.cost_model import StepCostModel
    from scheduling.estimators import ConstantEstimator

    k, batch = 4, 8
    cost = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=0.1, per_target_ms=0.05,
                                draft_launch_ms=1.0)
    config = WCSConfig(policy=policy, mode_gate=True, mode_block_steps=8, explore_every=None, recalibrate=False)
    ctl = StepController(config, k, ConstantEstimator(k, prior=0.8, prior_weight=1e6), cost=cost)
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(batch)]
    verified = accepted = np.zeros(batch, np.int64)
    held = 0
    for t in range(400):
        ctl.observe(ids, verified, accepted)
        target = batch + int(verified.sum())
        holds = ctl.holds_no_drafts()
        draft = ctl.plan(ids, None if holds else np.zeros((batch, 8)), np.full(batch, k))
        d = int(draft.sum())
        verified = ctl.verify(np.full((batch, k), 0.9)) if d else np.zeros(batch, np.int64)
        accepted = np.minimum(np.cumprod(rng.random((batch, k)) < 0.25, axis=1).sum(axis=1), verified)
        ctl.observe_step(batch, d, target, cost.step_ms(batch, d, target))
        if t >= 200:
            held += holds
    if policy == "static":
        assert held == 0
    else:
        assert held > 150, (held, ctl.gate.blocks)
