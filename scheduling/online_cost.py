"""The profiled step-cost model, corrected online by what serving steps really take.

A profile is taken in an idle engine at start-up, while a serving engine's
step also carries what the profile never sees: prefill chunks mixed into
decode steps, output handling and streaming for the requests, other
processes on the same CPUs. To the planner all of that is a fixed cost of
the step: it does not grow with the drafts the planner adds, but it makes
every step longer, so each drafted token is cheaper relative to the step
than the idle profile says, and a planner that prices steps with the idle
profile drafts too little.

`OnlineCostModel` keeps the mean residual (measured period minus the
profile's prediction for that step's R, D and N) over the last `window`
steps and adds it to the profiled intercept. Only the intercept moves. (Also
scaling the slopes by the runner's slow-down on decode-only steps was tried
under serving load here; it priced drafts higher and WCS drafted and
produced less: contention mostly lengthens the step's fixed part.) Fed only
with timings and counts, never with draft tokens, so it keeps every policy
lossless.
"""

from __future__ import annotations

import numpy as np

from scheduling.cost_model import StepCostModel


class OnlineCostModel:
    def __init__(self, profiled: StepCostModel, window: int = 128, refresh_every: int = 16, min_change_ms: float = 0.5) -> None:
        if window < 1 or refresh_every < 1:
            raise ValueError("need window >= 1 and refresh_every >= 1")
        self.profiled = profiled
        self.model = profiled
        self.refresh_every = refresh_every
        self.min_change_ms = min_change_ms
        self._residuals = np.zeros(window)
        self.seen = 0  # steps observed

    @property
    def offset_ms(self) -> float:
        """What the served model adds to the profiled intercept."""
        return self.model.intercept_ms - self.profiled.intercept_ms

    def observe(self, requests: int, drafted: int, target: int, period_ms: float) -> None:
        """One step with `requests` planned requests, `drafted` draft tokens and `target` tokens as the
        planner counts them (requests + verified drafts) took `period_ms` from its start to the next's."""
        self._residuals[self.seen % len(self._residuals)] = period_ms - self.profiled.step_ms(requests, drafted, target)
        self.seen += 1
        if self.seen % self.refresh_every == 0:
            self._refresh()

    def _refresh(self) -> None:
        residuals = self._residuals[: min(self.seen, len(self._residuals))]
        # The served model must stay a step-cost model: a non-negative intercept.
        offset = max(float(residuals.mean()), -self.profiled.intercept_ms)
        if abs(offset - self.offset_ms) >= self.min_change_ms:
            self.model = self.profiled.model_copy(update={"intercept_ms": self.profiled.intercept_ms + offset})
