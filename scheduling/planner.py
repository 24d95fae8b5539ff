"""Pre-draft joint draft-verify planner (DESIGN.md section 1.2).

Before drafting, choose per-request draft widths d_i (each admitted slot is
drafted and, unless the post-draft stage drops it, verified) maximising
expected tokens per millisecond. For a fixed number of admitted slots the best
choice is the top gains, and T depends only on the totals, so taking the best
prefix of the global sort is exact. Pre-draft inputs never see a draft token,
so this argmax is safe for losslessness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduling.cost_model import StepCostModel
from scheduling.slots import check_survival, prefix_mask, rank_slots


@dataclass(slots=True)
class DraftPlan:
    draft: np.ndarray  # (B,) draft width per request
    slots: np.ndarray  # flat indices i * K + j of the drafted slots, each request's positions ascending
    verify_cap: int  # verify tokens the post-draft stage may spend in total
    expected_tokens: float  # R + sum of admitted gains
    step_ms: float  # predicted step time

    @property
    def tokens_per_ms(self) -> float:
        return self.expected_tokens / self.step_ms


def bounds(
    batch: int, k: int, lo: np.ndarray | None, hi: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Per-request (lo, hi) as int64 with 0 <= lo <= hi <= k; None where trivial (no forced slots, width k)."""
    if hi is not None:
        hi = np.minimum(np.maximum(np.asarray(hi, np.int64), 0), k)
    if lo is not None:
        lo = np.minimum(np.maximum(np.asarray(lo, np.int64), 0), k if hi is None else hi)
    return lo, hi


def plan_step(
    survival: np.ndarray,
    cost: StepCostModel,
    *,
    lo: np.ndarray | None = None,
    hi: np.ndarray | None = None,
    token_budget: int | None = None,
    time_cap_ms: float | None = None,
    slack_ms: np.ndarray | None = None,
    tpot_ms: float | None = None,
    validate: bool = True,
) -> DraftPlan:
    """Draft widths with lo_i <= d_i <= hi_i maximising (R + sum gains) / T(R, sum d, R + sum d).

    `token_budget` caps target tokens per step (R + verified); `time_cap_ms`
    caps predicted step time (an inter-token latency bound). Both may cut
    forced slots: the system's limits win over a policy's fixed width.
    `validate=False` skips `check_survival` for curves built by
    `survival_from_hazards`.

    The batch's mean time per output token is T * R / (R + sum gains), R over
    the objective, so the argmax is also the plan with the lowest mean TPOT.
    Not every request's, though: one that accepts little gets about one token
    from a step made long by the others' drafts. With `tpot_ms` and
    `slack_ms` (B,) (how far each request is ahead of `tpot_ms` per token so
    far), the argmax is taken only over prefixes whose T keeps on that pace
    every request that the step can keep on it, counting the tokens each
    expects (`SlotRanking.pace_bound_ms`). A plain cap of T at the SLO would
    instead forbid long steps that give each request several tokens.
    """
    survival = np.asarray(survival)
    if validate:
        check_survival(survival)
    b, k = survival.shape
    lo_, hi_ = bounds(b, k, lo, hi)
    if cost.launch_ms(b) > 0 and (lo_ is None or not lo_.any()):
        # Exact early exit: even every allowed slot, at no cost beyond launching the drafter, would not
        # beat drafting nothing (the common case where drafting does not pay, at a fraction of the sort).
        base_ms = cost.step_ms(b, 0, b)
        best_gain = float(survival.sum() if hi_ is None else survival[prefix_mask(hi_, k)].sum())
        if (b + best_gain) * base_ms <= b * (base_ms + cost.launch_ms(b)):
            return DraftPlan(
                draft=np.zeros(b, dtype=np.int64),
                slots=np.zeros(0, dtype=np.int64),
                verify_cap=0,
                expected_tokens=float(b),
                step_ms=base_ms,
            )
    ranking = rank_slots(
        survival, cost, lo=lo_, hi=hi_, drafted_tokens=None, token_budget=token_budget, time_cap_ms=time_cap_ms,
    )
    upto = ranking.feasible_upto
    first = min(ranking.n_forced, upto)
    ratio = ranking.scaled_ratio(upto)[first:]
    if tpot_ms is not None and slack_ms is not None:
        on_pace = ranking.step_ms[first : upto + 1] <= ranking.pace_bound_ms(slack_ms, tpot_ms)[first : upto + 1]
        if on_pace.any():  # (forced slots may leave no prefix on pace: the policy's width then wins)
            ratio = np.where(on_pace, ratio, -np.inf)
    best = first + int(ratio.argmax())
    return DraftPlan(
        draft=ranking.widths(best),
        slots=ranking.admitted(best, k),
        verify_cap=best,
        expected_tokens=ranking.expected_tokens(best),
        step_ms=float(ranking.step_ms[best]),
    )
