"""Post-draft verify-budget distribution (DESIGN.md section 1.3 and "Losslessness").

After the draft pass, the drafter's own confidences give refined survival
curves over the drafted tokens. Slots are admitted in global-sort order while
each one strictly raises expected tokens per ms and fits the budgets; the
first that does not stops admission. Whether slot (i, j) is verified then
depends only on slots sorted before it, which never include (i, j') for
j' > j: with confidences
computed from x_<j (never from the token x_j itself) this is a stopping time
and speculative sampling stays exact. A retrospective argmax over all prefixes
would look at later slots and is not allowed here.
"""

from __future__ import annotations

import numpy as np

from scheduling.cost_model import StepCostModel
from scheduling.planner import bounds
from scheduling.slots import check_survival, rank_slots


def distribute_verify_budget(
    survival: np.ndarray,
    drafted: np.ndarray,
    cost: StepCostModel,
    *,
    verify_cap: int | None = None,
    min_verify: np.ndarray | None = None,
    token_budget: int | None = None,
    time_cap_ms: float | None = None,
    validate: bool = True,
    drafted_slots: np.ndarray | None = None,
) -> np.ndarray:
    """Verify lengths v_i, min_verify_i <= v_i <= drafted_i, sum v <= verify_cap.

    `survival` (B, K) are post-draft survival estimates built only from
    information before each position (e.g. the cumulative product of the
    draft distribution's max probability per position). `drafted_slots`, a
    plan's `slots`, names the drafted positions directly and saves finding
    them (it must agree with `drafted`; ignored with `min_verify`).
    """
    survival = np.asarray(survival)
    if validate:
        check_survival(survival)
    b, k = survival.shape
    lo, hi = bounds(b, k, min_verify, drafted)
    ranking = rank_slots(
        survival,
        cost,
        lo=lo,
        hi=hi,
        drafted_tokens=int(np.add.reduce(hi)),
        token_budget=token_budget,
        time_cap_ms=time_cap_ms,
        candidates=drafted_slots if min_verify is None else None,
    )
    limit = ranking.feasible_upto if verify_cap is None else min(ranking.feasible_upto, int(verify_cap))
    first = min(ranking.n_forced, limit)
    ratio = ranking.scaled_ratio(limit)[first:]
    drops = ratio[1:] <= ratio[:-1]
    stop = first + (int(drops.argmax()) if drops.any() else limit - first)
    return ranking.widths(stop)
