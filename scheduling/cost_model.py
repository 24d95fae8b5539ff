"""Profiled step-time model T(#requests, drafted tokens, target tokens) in milliseconds.

T = intercept + (launch + launch_r R) [D > 0] + g_req(R) + g_draft(D) + g_target(N),
each g piecewise linear between knots, non-decreasing (non-negative segment
slopes, fitted by NNLS) and extended linearly past its last knot with the
last segment's slope. The launch is what running the drafter at all costs in
a step, whatever D is: a fixed part, and a part per request in the batch (the
drafter stores the new context of every request, drafting or not). A step in
which no request drafts skips it, so the planner weighs it against the whole
step's gain. (With a fixed launch only, drafting steps at 64 requests that
drafted for a few requests ran 10-35% longer than predicted.) An engine
profiles timed steps once at start-up, fits, and stores the JSON.
"""

from __future__ import annotations

from functools import cached_property
import os
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduling.survival import clip


class PiecewiseLinear(BaseModel):
    """g(x) with g(knots[0]) = 0 and slope[i] on [knots[i], knots[i+1]]; the last slope runs on to infinity."""

    model_config = ConfigDict(frozen=True)

    knots: list[float] = Field(default_factory=lambda: [0.0])
    slopes: list[float] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "PiecewiseLinear":
        if any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError("knots must be strictly increasing")
        if self.slopes and len(self.slopes) != len(self.knots) - 1:
            raise ValueError("need one slope per segment between knots")
        if any(s < 0 for s in self.slopes):
            raise ValueError("slopes must be >= 0 (step time is monotone)")
        return self

    def _values_at_knots(self) -> np.ndarray:
        widths = np.diff(self.knots)
        return np.concatenate([[0.0], np.cumsum(np.asarray(self.slopes) * widths)])

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if not self.slopes:
            return np.zeros_like(x)
        knots = np.asarray(self.knots)
        y = np.interp(x, knots, self._values_at_knots())
        return y + self.slopes[-1] * np.maximum(x - knots[-1], 0.0)

    def basis(self, x: np.ndarray) -> np.ndarray:
        """Design columns whose non-negative weights are the segment slopes."""
        k = np.asarray(self.knots)
        if len(k) < 2:
            return np.zeros((len(x), 0))
        lo, hi = k[:-1], k[1:].copy()
        hi[-1] = np.inf  # the last segment extrapolates
        return clip(x[:, None] - lo[None, :], 0.0, (hi - lo)[None, :])


def _knots(values: np.ndarray, max_knots: int) -> list[float]:
    uniq = np.unique(np.concatenate([[0.0], values.astype(np.float64)]))
    if len(uniq) > max_knots:
        uniq = np.unique(np.quantile(uniq, np.linspace(0.0, 1.0, max_knots)))
    return uniq.tolist()


class StepCostModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    intercept_ms: float = Field(ge=0.0)
    draft_launch_ms: float = Field(default=0.0, ge=0.0, description="added once when any token is drafted")
    launch_per_request_ms: float = Field(default=0.0, ge=0.0, description="added per request when any token is drafted")
    requests: PiecewiseLinear = Field(default_factory=PiecewiseLinear)
    drafted: PiecewiseLinear = Field(default_factory=PiecewiseLinear)
    target: PiecewiseLinear = Field(default_factory=PiecewiseLinear)
    def prefix_curve(self, num_requests: int, num_slots: int, drafted_tokens: int | None) -> np.ndarray:
        """T for k = 0..num_slots admitted slots with num_requests + k target tokens: each slot also
        drafted (`drafted_tokens=None`, pre-draft) or D fixed (post-draft)."""
        return self._tables.prefix_curve(int(num_requests), num_slots, drafted_tokens)

    @cached_property
    def _tables(self) -> "_LookupTables":
        return _LookupTables(self)

    def model_copy(self, *, update=None, deep: bool = False) -> "StepCostModel":
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("_tables", None)  # built from the original's fields
        return copy

    def step_ms(self, num_requests: int, drafted_tokens: int, target_tokens: int) -> float:
        """Scalar T from the lookup tables (cheaper than `predict` for one point)."""
        return self._tables.step_ms(int(num_requests), int(drafted_tokens), int(target_tokens))

    def launch_ms(self, num_requests: int) -> float:
        """What running the drafter at all adds to a step of `num_requests` requests."""
        return self.draft_launch_ms + self.launch_per_request_ms * num_requests

    def min_slot_ms(self, drafted: bool) -> float:
        """A lower bound on the step time one more admitted slot adds (a verified token, plus a drafted one)."""
        return self._tables.min_slot_drafted if drafted else self._tables.min_slot_verified

    def predict(self, num_requests, drafted_tokens, target_tokens) -> np.ndarray:
        """Step time in ms; broadcasts over array arguments."""
        return (
            self.intercept_ms
            + self.requests(num_requests)
            + (self.draft_launch_ms + self.launch_per_request_ms * np.asarray(num_requests)) * (np.asarray(drafted_tokens) > 0)
            + self.drafted(drafted_tokens)
            + self.target(target_tokens)
        )

    @classmethod
    def linear(
        cls,
        intercept_ms: float,
        per_request_ms: float,
        per_draft_ms: float,
        per_target_ms: float,
        draft_launch_ms: float = 0.0,
        launch_per_request_ms: float = 0.0,
    ) -> "StepCostModel":
        def line(slope: float) -> PiecewiseLinear:
            return PiecewiseLinear(knots=[0.0, 1.0], slopes=[slope])

        return cls(
            intercept_ms=intercept_ms,
            draft_launch_ms=draft_launch_ms,
            launch_per_request_ms=launch_per_request_ms,
            requests=line(per_request_ms),
            drafted=line(per_draft_ms),
            target=line(per_target_ms),
        )

    @classmethod
    def fit(
        cls,
        num_requests: np.ndarray,
        drafted_tokens: np.ndarray,
        target_tokens: np.ndarray,
        step_ms: np.ndarray,
        max_knots: int = 12,
    ) -> "StepCostModel":
        """Least squares with non-negative slopes and launch cost over profiled (R, D, N) -> ms samples."""
        cols = [np.asarray(a, dtype=np.float64) for a in (num_requests, drafted_tokens, target_tokens)]
        y = np.asarray(step_ms, dtype=np.float64)
        if not (len(y) == len(cols[0]) == len(cols[1]) == len(cols[2])) or len(y) == 0:
            raise ValueError("need equally many (R, D, N, ms) samples, at least one")
        axes = [PiecewiseLinear(knots=_knots(c, max_knots)) for c in cols]
        blocks = [ax.basis(c) for ax, c in zip(axes, cols)]
        drafts = (cols[1] > 0).astype(np.float64)
        design = np.column_stack([np.ones(len(y)), drafts, drafts * cols[0]] + blocks)
        from scipy.optimize import nnls  # (here: scipy.optimize takes most of a second to import, and only fits need it)

        weights, _ = nnls(design, y)
        fitted, offset = [], 3
        for ax, block in zip(axes, blocks):
            n = block.shape[1]
            fitted.append(PiecewiseLinear(knots=ax.knots, slopes=weights[offset : offset + n].tolist()))
            offset += n
        return cls(
            intercept_ms=float(weights[0]),
            draft_launch_ms=float(weights[1]),
            launch_per_request_ms=float(weights[2]),
            requests=fitted[0],
            drafted=fitted[1],
            target=fitted[2],
        )

    def save(self, path: str | Path) -> None:
        """Written whole or not at all: an engine starting beside the writer may load the file at once."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "StepCostModel":
        return cls.model_validate_json(Path(path).read_text())


class _LookupTables:
    """T's parts per count (0, 1, 2, ... requests or tokens): the planners' hot path reads slices
    instead of evaluating piecewise-linear functions. Grown on demand."""

    def __init__(self, model: StepCostModel) -> None:
        self.model = model
        self.min_slot_verified = min(model.target.slopes, default=0.0)
        self.min_slot_drafted = self.min_slot_verified + min(model.drafted.slopes, default=0.0)
        self._grow(4096)

    def _grow(self, size: int) -> None:
        counts = np.arange(size, dtype=np.float64)
        m = self.model
        self.base, self.target = m.intercept_ms + m.requests(counts), m.target(counts)
        self.draft = m.drafted(counts) + m.draft_launch_ms * (counts > 0)
        self._lists = (self.base.tolist(), self.draft.tolist(), self.target.tolist())  # cheap scalar reads

    def _ensure(self, largest: int) -> None:
        if largest >= len(self.target):
            self._grow(max(largest + 1, 2 * len(self.target)))

    def step_ms(self, r: int, d: int, n: int) -> float:
        self._ensure(max(r, d, n))
        base, draft, target = self._lists
        return base[r] + draft[d] + target[n] + (self.model.launch_per_request_ms * r if d else 0.0)

    def prefix_curve(self, r: int, num_slots: int, drafted_tokens: int | None) -> np.ndarray:
        self._ensure(max(r + num_slots, drafted_tokens or 0))
        base, draft, _ = self._lists
        launch_r = self.model.launch_per_request_ms * r
        if drafted_tokens is None:
            curve = (base[r] + self.draft[: num_slots + 1]) + self.target[r : r + num_slots + 1]
            if launch_r:
                curve[1:] += launch_r
            return curve
        return (base[r] + draft[drafted_tokens] + (launch_r if drafted_tokens else 0.0)) + self.target[r : r + num_slots + 1]
