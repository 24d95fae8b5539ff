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
