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
    gain_levels: np.ndarray  # (M+1,) int64: sum of the first k slots' gains, in units of 1/_LEVELS
    step_ms: np.ndarray  # (M+1,) predicted step time with the first k slots
    feasible_upto: int  # largest k meeting the token budget and time cap (0 when none does)

    def expected_tokens(self, n_admitted: int) -> float:
        return self.batch_size + float(self.gain_levels[n_admitted]) / _LEVELS

    def scaled_ratio(self, upto: int) -> np.ndarray:
        """Expected tokens per ms for k = 0..upto, times _LEVELS: argmax and rises are all we need."""
        return (self.gain_levels[: upto + 1] + self.batch_size * _LEVELS) / self.step_ms[: upto + 1]

    def admitted(self, n_admitted: int, row_length: int) -> np.ndarray:
        """Flat indices i * row_length + j of the first `n_admitted` slots."""
        slots = self.slots[:n_admitted]
        return slots if row_length == self.k else (slots // self.k) * row_length + slots % self.k

    def pace_bound_ms(self, slack_ms: np.ndarray, tpot_ms: float) -> np.ndarray:
        """(M+1,) the longest step each prefix keeps every request on its TPOT pace that can be kept on it:
        the minimum over requests of slack_i + tpot_ms * tau_i(k), where tau_i(k) = 1 + request i's gains
        among the first k slots is the tokens it expects from the step and slack_i how far ahead of its pace
        it already is (negative: behind). A request that even the shortest step leaves behind is left out
        (it catches up only through tokens, which the argmax serves), and so is one that no prefix can put
        behind: the empty prefix always stays within the bound."""
        m = len(self.slots)
        slack_ms = np.asarray(slack_ms, dtype=float)
        binding = np.flatnonzero((slack_ms + tpot_ms >= self.step_ms[0]) & (slack_ms + tpot_ms < self.step_ms[-1]))
        if not len(binding):
            return np.full(m + 1, np.inf)
        rows = self.slots >> (self.k.bit_length() - 1) if self.k & (self.k - 1) == 0 else self.slots // self.k
        mine = np.isin(rows, binding).nonzero()[0]
        gains = np.zeros((m + 1, len(binding)))
        gains[mine + 1, np.searchsorted(binding, rows[mine])] = np.diff(self.gain_levels)[mine] / _LEVELS
        tau = 1.0 + gains.cumsum(axis=0)
        return (slack_ms[binding] + tpot_ms * tau).min(axis=1)

    def widths(self, n_admitted: int) -> np.ndarray:
        """Per-request count of slots among the first `n_admitted` (a prefix of positions by construction)."""
        admitted = self.slots[:n_admitted]
        k = self.k
        rows = admitted >> (k.bit_length() - 1) if k & (k - 1) == 0 else admitted // k  # shifts are cheaper
        return np.bincount(rows, minlength=self.batch_size)


def _level_at_least(gain: float) -> int:
    """Smallest gain level that can be >= gain (a hair low, so float rounding never prunes a candidate)."""
    return max(1, math.ceil(gain * _LEVELS * (1.0 - 1e-9)))


@functools.cache
def _prefix_tables(k: int) -> tuple[np.ndarray, np.ndarray]:
    mask = np.arange(k)[None, :] < np.arange(k + 1)[:, None]
    return mask, mask * float(_LEVELS)


def prefix_mask(widths: np.ndarray, k: int) -> np.ndarray:
    """(B, k) booleans, row i true on its first widths[i] positions (a table lookup:
    broadcasting a comparison over short rows is several times slower)."""
    return _prefix_tables(k)[0][widths]


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
    candidates: np.ndarray | None = None,
) -> SlotRanking:
    """Sort admissible slots and score every prefix.

    Slot (i, j) is forced when j < lo_i and admissible when j < hi_i (`None`:
    no forced slots / every position admissible). `candidates` may instead
    name the admissible slots directly (flat indices i * K + j in an order
    where each request's positions ascend, e.g. a plan's drafted slots).
    `drafted_tokens=None`: each admitted slot is also drafted (pre-draft); an
    int fixes D (post-draft). Without forced slots, slots that neither the
    best-prefix argmax nor the early stop can admit never enter the sort.
    The caller has checked `survival` (see `check_survival`).
    """
    b, k = survival.shape
    n_forced = 0 if lo is None else int(np.add.reduce(lo))
    if candidates is not None:
        base, base_levels = candidates, (survival.ravel()[candidates] * _LEVELS).astype(np.uint16)
    else:
        if hi is not None:
            k = min(k, int(np.maximum.reduce(hi, initial=0)))
        if n_forced:
            levels = (survival[:, :k] * _LEVELS).astype(np.uint16)
            key = (_LEVELS + 1) - levels
            key[prefix_mask(lo, k)] = 0
            if hi is not None:
                key[~prefix_mask(hi, k)] = 65535
            slots = key.ravel().argsort(kind="stable")[: b * k if hi is None else int(np.add.reduce(hi))]
            gains = levels.ravel()[slots]
        else:
            # Positions at or past hi_i get gain level 0, which the pruning below drops.
            scale = _LEVELS if hi is None else _prefix_tables(k)[1][hi]
            flat = (survival[:, :k] * scale).astype(np.uint16).ravel()
            # Pruning (exact): the last slot k either rule admits raises the objective, and ratio_k is
            # the mediant of ratio_{k-1} and g_k / dT_k, so g_k > ratio_k * dT_k >= ratio_0 * min dT;
            # every admitted slot gains at least g_k.
            ratio_0 = b / cost.step_ms(b, drafted_tokens or 0, b)
            base = (flat >= _level_at_least(ratio_0 * cost.min_slot_ms(drafted=drafted_tokens is None))).nonzero()[0]
            base_levels = flat[base]
    if candidates is not None or not n_forced:
        order = (~base_levels).argsort(kind="stable")  # ~level = 65535 - level: descending gain, stable
        slots, gains = base[order], base_levels[order]
    m = len(slots)
    cum = np.zeros(m + 1, dtype=np.int64)
    gains.cumsum(dtype=np.int64, out=cum[1:])
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
        gain_levels=cum,
        step_ms=step_ms,
        feasible_upto=max(upto, 0),
    )
