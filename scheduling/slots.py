"""The one mechanism under every policy: a global sort of (request, position) slots by gain,
and the objective (R + admitted gain) / T(R, drafted, target tokens) along its prefixes.

Slot (i, j) (0-based j) gains s_i(j+1), the probability that it yields a
token. Slots below a request's lower bound are forced (sorted first), slots at
or above its upper bound are not admissible. Survival is non-increasing along
j and the sort is stable over row-major order, so a later position never comes
before an earlier one of the same request: every prefix of the order gives
each request a prefix of its positions.

Hot-path choices (the planner runs every engine step): gains are sorted as
16-bit levels (numpy's stable sort is a radix sort there; resolution 1.5e-5)
and summed as those integer levels (integer prefix sums vectorise, float ones
do not); step times come from the cost model's per-token tables.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from scheduling.cost_model import StepCostModel

_LEVELS = 65533  # gain levels 0..65533; with forced slots, keys 0 = forced, 65535 = not admissible


@dataclass(slots=True)
class SlotRanking:
    """Admissible slots in admission order and the objective along its prefixes k = 0..M."""

    slots: np.ndarray  # (M,) flat slot index i * k + j, in admission order
    k: int  # row length of the flat index
    n_forced: int  # the first n_forced slots are forced
    batch_size: int
    expected_tokens: np.ndarray  # (M+1,) R + gain of the first k slots
    step_ms: np.ndarray  # (M+1,) predicted step time with the first k slots
    feasible_upto: int  # largest k meeting the token budget and time cap (0 when none does)

    @property
    def ratio(self) -> np.ndarray:
        return self.expected_tokens / self.step_ms

    def widths(self, n_admitted: int) -> np.ndarray:
        """Per-request count of slots among the first `n_admitted` (a prefix of positions by construction)."""
        return np.bincount(self.slots[:n_admitted] // self.k, minlength=self.batch_size)


def gain_floor(cost: StepCostModel, num_requests: int, drafted_tokens: int | None) -> float:
    """No slot with a smaller gain is ever admitted when there are no forced slots.

    If slot k is admitted, ratio_k > ratio_{k-1} (the argmax takes the first
    maximum, the early stop needs a strict rise), and ratio_k is the mediant of
    ratio_{k-1} and g_k / dT_k, so g_k > ratio_k * dT_k >= ratio_0 * min dT.
    Leaving such slots out of the sort changes no decision and shrinks it.
    """
    t0 = cost.step_ms(num_requests, drafted_tokens or 0, num_requests)
    return num_requests / t0 * cost.min_slot_ms(drafted=drafted_tokens is None)


@functools.cache
def _prefix_masks(k: int) -> np.ndarray:
    return np.arange(k)[None, :] < np.arange(k + 1)[:, None]


def prefix_mask(widths: np.ndarray, k: int) -> np.ndarray:
    """(B, k) booleans, row i true on its first widths[i] positions (a table lookup: broadcasting
    a comparison over short rows is several times slower)."""
    return _prefix_masks(k)[widths]


def check_survival(survival: np.ndarray) -> None:
    """Survival curves must lie in [0, 1] and be non-increasing along positions: the sort's
    prefix property, and with it losslessness, rests on that."""
    if survival.size == 0:
        return
    if survival.min() < 0.0 or survival.max() > 1.0:
        raise ValueError("survival probabilities must lie in [0, 1]")
    if np.any(survival[:, 1:] > survival[:, :-1]):
        raise ValueError("survival curves must be non-increasing along positions")


def rank_slots(
    survival: np.ndarray,
    cost: StepCostModel,
    *,
    lo: np.ndarray | None,
    hi: np.ndarray | None,
    drafted_tokens: int | None,
    token_budget: int | None,
    time_cap_ms: float | None,
) -> SlotRanking:
    """Sort admissible slots and score every prefix.

    Slot (i, j) is forced when j < lo_i and admissible when j < hi_i (`None`:
    no forced slots / every position admissible). `drafted_tokens=None`: each
    admitted slot is also drafted (pre-draft); an int fixes D (post-draft).
    Without forced slots, slots under `gain_floor` or with gain level 0 never
    enter the sort. The caller has checked `survival` (see `check_survival`).
    """
    b, k = survival.shape
    if hi is not None:
        k = min(k, int(np.maximum.reduce(hi, initial=0)))
    n_forced = 0 if lo is None else int(np.add.reduce(lo))
    levels = (survival[:, :k] * _LEVELS).astype(np.uint16)
    if n_forced:
        key = (_LEVELS + 1) - levels
        key[prefix_mask(lo, k)] = 0
        if hi is not None:
            key[~prefix_mask(hi, k)] = 65535
        slots = key.ravel().argsort(kind="stable")[: b * k if hi is None else int(np.add.reduce(hi))]
    else:
        if hi is not None:
            np.multiply(levels, prefix_mask(hi, k), out=levels)
        floor = max(1, math.ceil(gain_floor(cost, b, drafted_tokens) * _LEVELS * (1.0 - 1e-9)))
        flat = levels.ravel()
        kept = (flat >= floor).nonzero()[0]
        slots = kept[(~flat[kept]).argsort(kind="stable")]  # ~level = 65535 - level: descending gain
    m = len(slots)
    cum = np.zeros(m + 1, dtype=np.int64)
    levels.ravel()[slots].cumsum(dtype=np.int64, out=cum[1:])
    step_ms = cost.prefix_curve(b, m, drafted_tokens)
    # Both constraints are monotone in k, so the feasible set is a prefix.
    upto = m
    if token_budget is not None:
        upto = min(upto, token_budget - b)
    if time_cap_ms is not None:
        upto = min(upto, int(step_ms.searchsorted(time_cap_ms, side="right")) - 1)
    return SlotRanking(
        slots=slots,
        k=max(k, 1),
        n_forced=n_forced,
        batch_size=b,
        expected_tokens=b + cum / _LEVELS,
        step_ms=step_ms,
        feasible_upto=max(upto, 0),
    )
