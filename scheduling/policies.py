"""Speculation policies (DESIGN.md section 2) as inputs and constraints to one planner and one allocator.

| policy | draft bounds (lo, hi)        | verify               |
|--------|------------------------------|----------------------|
| ar     | (0, 0)                       | nothing to verify    |
| static | (w, w), w = max width        | all drafted          |
| dspark | (w, w)                       | post-draft sorted    |
| wcs    | (0, w), estimator gains      | post-draft sorted    |
| oracle | (a+1, a+1), a = true accepts | all drafted          |

wcs drafts only when its plan beats the plan of its floors alone (no drafts
but due probes) by `margin` in predicted tokens per ms: near break-even the
sign of the gain is decided by what the step model does not see (at 64
requests on this CPU, drafting steps priced within 5% by the online cost
model, with drafts realising 96-99% of the acceptance predicted, still lost
to `ar`: speculation spreads finishing requests, and with them the new
requests' prefill, over more steps). With `whole_blocks`, wcs takes the
better of the plans (w, w) and (lo, lo) by the same rule.

No policy has a code path of its own: each only chooses the bounds passed to
`plan_step` and the verify floor passed to `distribute_verify_budget`.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
from pydantic import BaseModel, Field

from scheduling.allocator import distribute_verify_budget
from scheduling.cost_model import StepCostModel
from scheduling.planner import DraftPlan, plan_step
from scheduling.survival import clip


class PolicyName(StrEnum):
    AR = "ar"
    STATIC = "static"
    DSPARK = "dspark"
    WCS = "wcs"
    ORACLE = "oracle"


class StepLimits(BaseModel):
    """System limits that bind every policy."""

    token_budget: int | None = Field(default=None, ge=1, description="max target tokens per step")
    time_cap_ms: float | None = Field(default=None, gt=0, description="max predicted step time (TPOT SLO)")
    pace_tpot_ms: float | None = Field(
        default=None, gt=0, description="time per token each request is kept to, counting its slack (see plan_step)"
    )


class Policy(BaseModel):
    name: PolicyName
    k: int = Field(ge=1, description="drafter block size: the widest draft")
    whole_blocks: bool = Field(
        default=False,
        description="wcs drafts every request's widest block or nothing in a step (for drafters whose truncated blocks "
        "lose acceptance): the better of the two plans",
    )
    margin: float = Field(default=0.0, ge=0.0, description="wcs: the predicted gain a plan with drafts must show")

    @property
    def verifies_all_drafted(self) -> bool:
        return self.name in (PolicyName.AR, PolicyName.STATIC, PolicyName.ORACLE)

    def draft_bounds(
        self, max_width: np.ndarray, oracle_accepted: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) per request; `max_width` (B,) caps widths (e.g. tokens left to generate - 1)."""
        w = clip(np.asarray(max_width, dtype=np.int64), 0, self.k)
        match self.name:
            case PolicyName.AR:
                zero = np.zeros_like(w)
                return zero, zero
            case PolicyName.STATIC | PolicyName.DSPARK:
                return w, w
            case PolicyName.WCS:
                return np.zeros_like(w), w
            case PolicyName.ORACLE:
                if oracle_accepted is None:
                    raise ValueError("the oracle policy needs the true accepted lengths (replay/simulation only)")
                width = np.minimum(np.asarray(oracle_accepted, dtype=np.int64) + 1, w)
                return width, width

    def plan(
        self,
        survival: np.ndarray,
        cost: StepCostModel,
        limits: StepLimits,
        max_width: np.ndarray,
        oracle_accepted: np.ndarray | None = None,
        validate: bool = True,
        slack_ms: np.ndarray | None = None,
        probes: np.ndarray | None = None,
        margin: float | None = None,
    ) -> DraftPlan:
        """`slack_ms` (B,): how far each request is ahead of `limits.pace_tpot_ms` (used only with it).
        `probes` (B,): draft slots forced for exploration (`scheduling.exploration`), within each request's bounds.
        `margin`: this step's instead of the policy's own (`wcs` only)."""
        margin = self.margin if margin is None else margin
        lo, hi = self.draft_bounds(max_width, oracle_accepted)
        if probes is not None:
            lo = np.maximum(lo, np.minimum(probes, hi))

        def best(lo: np.ndarray, hi: np.ndarray) -> DraftPlan:
            return plan_step(
                survival,
                cost,
                lo=lo,
                hi=hi,
                token_budget=limits.token_budget,
                time_cap_ms=limits.time_cap_ms,
                slack_ms=slack_ms,
                tpot_ms=limits.pace_tpot_ms,
                validate=validate,
            )

        if self.name != PolicyName.WCS:
            return best(lo, hi)
        plan = best(hi, hi) if self.whole_blocks else best(lo, hi)
        if not self.whole_blocks and (margin == 0.0 or np.array_equal(plan.draft, lo)):
            return plan
        floor = best(lo, lo)
        return plan if plan.tokens_per_ms > floor.tokens_per_ms * (1.0 + margin) else floor

    def verify(
        self, post_survival: np.ndarray, plan: DraftPlan, cost: StepCostModel, limits: StepLimits
    ) -> np.ndarray:
        return distribute_verify_budget(
            post_survival,
            plan.draft,
            cost,
            verify_cap=plan.verify_cap,
            min_verify=plan.draft if self.verifies_all_drafted else None,
            token_budget=limits.token_budget,
            time_cap_ms=limits.time_cap_ms,
            drafted_slots=plan.slots,
        )
