"""Counters a WCS engine exports: per-position draft/verify/accept counts, waste, and the step-time split."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field


class WCSStats(BaseModel):
    policy: str
    k: int
    steps: int = 0  # steps that planned at least one request
    planned_requests: int = 0  # request-steps planned (sum of batch sizes)
    held_steps: int = 0  # steps that kept the last plan's "no drafts" without planning (`replan_every`)
    probes: int = 0  # draft slots forced for exploration (`explore_every`)
    drafted_per_pos: list[int] = Field(default_factory=list)  # requests that drafted position j
    verified_per_pos: list[int] = Field(default_factory=list)  # ... whose position j was verified
    accepted_per_pos: list[int] = Field(default_factory=list)  # ... whose first j drafts were accepted
    verify_steps: int = 0  # request-steps that verified at least one draft
    drafter_passes: int = 0  # steps whose drafter ran its forward pass (not only the context K/V)
    drafter_rows: int = 0  # query rows those passes ran (sum of 1 + d_i): the drafter's real work
    planner_ms: float = 0.0
    draft_ms: float = 0.0
    target_ms: float = 0.0  # the target's forward pass and sampling
    step_ms: float = 0.0  # whole runner steps (target + drafting + planning + bookkeeping)
    step_cost_offset_ms: float = 0.0  # a gauge: what the online correction adds to the profiled intercept
    launch_offset_ms: float = 0.0  # a gauge: ... and to the profiled drafter launch cost

    def model_post_init(self, _) -> None:
        for name in ("drafted_per_pos", "verified_per_pos", "accepted_per_pos"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.k)

    def add_positions(self, name: str, widths: np.ndarray) -> None:
        """Count each request of width w at positions 0..w-1 (widths 0..k)."""
        widths = np.asarray(widths)
        if not widths.any():
            return
        # Requests wider than j: all of them less those of width <= j.
        counts = (len(widths) - np.bincount(np.minimum(widths, self.k), minlength=self.k + 1).cumsum()[: self.k]).tolist()
        setattr(self, name, [a + b for a, b in zip(getattr(self, name), counts)])

    @property
    def drafted(self) -> int:
        return sum(self.drafted_per_pos)

    @property
    def verified(self) -> int:
        return sum(self.verified_per_pos)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)

    @property
    def draft_waste(self) -> float:
        """Drafted tokens never verified / drafted."""
        return (self.drafted - self.verified) / self.drafted if self.drafted else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts + 1 per verification step (vLLM's definition)."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0

    @property
    def draft_share(self) -> float:
        return self.draft_ms / self.step_ms if self.step_ms else 0.0

    def minus(self, other: "WCSStats") -> "WCSStats":
        out = self.model_copy()
        for name, value in self:
            if isinstance(value, list):
                setattr(out, name, [a - b for a, b in zip(value, getattr(other, name))])
            elif isinstance(value, (int, float)) and name not in ("k", "step_cost_offset_ms", "launch_offset_ms"):
                setattr(out, name, value - getattr(other, name))
        return out

    def summary(self) -> dict:
        return {
            **self.model_dump(),
            "draft_waste": self.draft_waste,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "draft_share": self.draft_share,
        }
