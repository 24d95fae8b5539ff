"""Whether to speculate at all at this load, chosen by what each mode realised: tokens emitted per ms of whole steps.

Every other loop of closed-loop WCS corrects one part of a plan's prediction (step time, acceptance, realised
gain), and a plan can still lose through what none of them sees or through how their errors combine. So the
controller also runs as a two-armed bandit over blocks of steps, per load (requests in the batch, in bins of a
factor of two around powers of two):

- **speculate**: the planner decides each step as usual (it may still draft nothing, or probe);
- **hold**: every step drafts nothing without planning, as `ar` does but for the drafter context deferred for
  a return (`StepController.holds_no_drafts`).

Each block's tokens and milliseconds go to its arm at its load, whole steps with whatever they carried
(prefill chunks, context stores, features, planning), so the comparison is between the two ways of serving
this load, with nothing left out. A block closes after `block_steps` steps or when the load moves to another
bin (counting then for the share of a block it ran). The next block serves the arm with more tokens per ms;
an arm with less than `min_blocks` blocks of evidence (two, faded a little) is served first (the lighter one),
and the losing arm is served again once its evidence has faded below one block (weights halve every
`half_life_blocks` blocks at that load), so neither arm is trusted on a belief nobody checks. Re-serving the
loser costs about 1 / (half_life_blocks + 1) of the time at the gap between the arms; a block of speculation
that follows holding also pays the context store of the hold, the real price of switching.

Fed only with step periods and counts of emitted tokens: decisions stay lossless (DESIGN.md section 1).
"""

from __future__ import annotations

import math

import numpy as np

SPECULATE, HOLD = 0, 1
BINS = 16  # loads up to 2^15 requests; larger ones share the last bin


def load_bin(requests: int) -> int:
    """The bin of a batch of `requests`: the nearest power of two (46-90 requests share 64's)."""
    return min(int(round(math.log2(max(requests, 1)))), BINS - 1)


class ModeGate:
    def __init__(self, block_steps: int = 64, half_life_blocks: float = 16.0, min_blocks: float = 1.5) -> None:
        if block_steps < 1 or half_life_blocks <= 0 or min_blocks < 1:
            raise ValueError("need block_steps >= 1, half_life_blocks > 0 and min_blocks >= 1")
        self.block_steps, self.min_blocks = block_steps, min_blocks
        self._decay = 0.5 ** (1.0 / half_life_blocks)  # per block served at the load
        self._arms = np.zeros((BINS, 2, 3))  # per load bin and arm: decayed tokens, ms and blocks' weight
        self.mode = SPECULATE  # the arm serving the current block
        self._bin: int | None = None  # the current block's load bin
        self._steps = 0  # steps planned in the current block
        self._block = np.zeros(2)  # its tokens and ms so far
        self._pending: tuple | None = None  # (tokens, load bin, arm, block) of the step last emitted, until its period
        self._closed = 0  # blocks closed so far: which block a pending step belongs to
        self.blocks = np.zeros(2, dtype=np.int64)  # blocks served per arm (for diagnostics)

    @property
    def holding(self) -> bool:
        return self.mode == HOLD

    def emitted(self, tokens: int) -> None:
        """What this step emitted (its requests' sampled tokens, accepted drafts included)."""
        self._pending = (tokens, self._bin, self.mode, self._closed)

    def ran(self, period_ms: float) -> None:
        """The period of the step that last emitted (from its start to the next step's): a step whose period is
        not known (the engine idled after it) is not counted."""
        pending, self._pending = self._pending, None
        if pending is None or period_ms <= 0 or pending[1] is None:
            return
        tokens, load, arm, block = pending
        if block == self._closed:
            self._block += (tokens, period_ms)
        else:  # its block closed when the step was planned: the step still counts for the arm it served
            self._arms[load, arm, :2] += (tokens, period_ms)

    def planned(self, requests: int) -> bool:
        """A step with `requests` requests was planned under `mode`. True when that closed a block and `mode` now
        holds the next block's arm, from the next step on (tensor-parallel ranks then take the first rank's)."""
        load = load_bin(requests)
        changed = False
        if load != self._bin:  # (the open block counts for the share of a block it ran)
            if self._bin is not None:
                self._close()
                changed = True
            self._bin = load
            self.mode = self._choose(load)
        self._steps += 1
        if self._steps < self.block_steps:
            return changed
        self._close()
        self.mode = self._choose(load)
        return True

    def interrupt(self) -> None:
        """The engine served something else meanwhile (another policy): the open block is dropped."""
        self._bin, self._steps, self._block[:], self._pending = None, 0, 0.0, None

    def rates(self, requests: int) -> np.ndarray:
        """Tokens per ms each arm realised at this load (nan where it has none)."""
        tokens, ms, _ = self._arms[load_bin(requests)].T
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(ms > 0, tokens / ms, np.nan)

    def _close(self) -> None:
        share = self._steps / self.block_steps
        if share > 0 and self._block[1] > 0:
            arms = self._arms[self._bin]
            arms *= self._decay**share
            arms[self.mode] += (*self._block, share)
            self.blocks[self.mode] += 1
        self._steps, self._block[:] = 0, 0.0
        self._closed += 1

    def _choose(self, load: int) -> int:
        tokens, ms, weight = self._arms[load].T
        if weight.min() < self.min_blocks:
            return int(np.argmin(weight))  # (ties: speculate first)
        best = int(np.argmax(tokens / ms))
        loser = 1 - best
        return loser if weight[loser] < 1.0 else best
