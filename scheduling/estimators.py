"""Pre-draft acceptance estimators: inputs that exist before drafting -> survival curves (B, K).

All three share one interface (`fit` offline from traces, `predict`, `update`
online from realised acceptance) and one training signal: per-position
hazards P(accept j | accepted 1..j-1) on the rows where position j was
observed, so censored rows (drafted < j) never count as rejections.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from scheduling.survival import fit_logistic, logit, sigmoid, survival_from_hazards
from scheduling.traces import PreDraftInputs, Traces


def hazard_labels(drafted: np.ndarray, accepted: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(at_risk, accepted_at) of shape (N, K): position j is at risk when j-1 drafts were accepted and j was verified."""
    j = np.arange(1, k + 1)[None, :]
    at_risk = (accepted[:, None] >= j - 1) & (drafted[:, None] >= j)
    return at_risk, accepted[:, None] >= j


class SurvivalEstimator(ABC):
    name: str = "estimator"

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k

    @abstractmethod
    def fit(self, traces: Traces) -> "SurvivalEstimator": ...

    @abstractmethod
    def predict(self, inputs: PreDraftInputs) -> np.ndarray:
        """Survival curves (B, K), non-increasing along K."""

    def update(self, inputs: PreDraftInputs, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Online recalibration from one step's realised acceptance (default: none)."""


class ConstantEstimator(SurvivalEstimator):
    """One acceptance rate per position, the same for every request (decayed counts online)."""

    name = "constant"

    def __init__(self, k: int, prior: float = 0.5, prior_weight: float = 1.0, decay: float = 1.0) -> None:
        super().__init__(k)
        self.decay = decay
        self._acc = np.full(k, prior * prior_weight)
        self._risk = np.full(k, prior_weight)

    def fit(self, traces: Traces) -> "ConstantEstimator":
        self._add(traces.drafted, traces.accepted, weight=1.0)
        return self

    def _add(self, drafted: np.ndarray, accepted: np.ndarray, weight: float) -> None:
        at_risk, acc = hazard_labels(drafted, accepted, self.k)
        self._acc = weight * self._acc + (at_risk & acc).sum(axis=0)
        self._risk = weight * self._risk + at_risk.sum(axis=0)

    @property
    def hazards(self) -> np.ndarray:
        return self._acc / self._risk

    @property
    def pooled_rate(self) -> float:
        """Per-token acceptance rate over all positions."""
        return float(self._acc.sum() / self._risk.sum())

    def predict(self, inputs: PreDraftInputs) -> np.ndarray:
        return np.broadcast_to(survival_from_hazards(self.hazards), (inputs.batch_size, self.k)).copy()

    def update(self, inputs: PreDraftInputs, drafted: np.ndarray, accepted: np.ndarray) -> None:
        self._add(drafted, accepted, weight=self.decay)


class EWMAEstimator(SurvivalEstimator):
    """History only: the constant per-position hazards scaled by the request's EWMA per-token
    acceptance rate relative to the global rate (the global curve when it has no history)."""

    name = "ewma"

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self._constant = ConstantEstimator(k)

    def fit(self, traces: Traces) -> "EWMAEstimator":
        self._constant.fit(traces)
        return self

    def predict(self, inputs: PreDraftInputs) -> np.ndarray:
        relative = np.where(np.isnan(inputs.history), 1.0, inputs.history / max(self._constant.pooled_rate, 1e-6))
        hazards = self._constant.hazards
        return survival_from_hazards(np.clip(hazards[None, :] * relative[:, None], 0.0, 1.0))

    def update(self, inputs: PreDraftInputs, drafted: np.ndarray, accepted: np.ndarray) -> None:
        self._constant.update(inputs, drafted, accepted)


class ContextEstimator(SurvivalEstimator):
    """Logistic hazard per position over standardised context features + history.

    Fitted offline by L2-regularised Newton steps; recalibrated online by a
    per-position logit offset nudged towards the realised acceptance.
    """

    name = "context"

    def __init__(self, k: int, l2: float = 1.0, newton_steps: int = 12, online_lr: float = 0.05) -> None:
        super().__init__(k)
        self.l2 = l2
        self.newton_steps = newton_steps
        self.online_lr = online_lr
        self.mean: np.ndarray | None = None
        self.scale: np.ndarray | None = None
        self.weights: np.ndarray | None = None  # (K, P+1), last column is the bias
        self.offset = np.zeros(k)
        self._fill = 0.5
        self._last: tuple[PreDraftInputs, np.ndarray] | None = None  # hazards of the last inputs, until weights move

    def _raw(self, inputs: PreDraftInputs) -> np.ndarray:
        # A missing history is imputed, never flagged: in traces recorded with every request drafting, "no
        # history" only ever meant "first draft after prefill", while a serving engine that lets a request
        # go without drafts keeps it unknown for long. The position feature tells the first draft apart.
        hist = np.where(np.isnan(inputs.history), self._fill, inputs.history)
        return np.column_stack([inputs.features, hist])

    def _design(self, inputs: PreDraftInputs) -> np.ndarray:
        return (self._raw(inputs) - self.mean) / self.scale

    def fit(self, traces: Traces) -> "ContextEstimator":
        h = traces.inputs.history
        self._fill = float(np.nanmean(h)) if np.any(~np.isnan(h)) else 0.5
        raw = self._raw(traces.inputs)
        self.mean = raw.mean(axis=0)
        self.scale = np.where(raw.std(axis=0) > 1e-9, raw.std(axis=0), 1.0)
        x = self._design(traces.inputs)
        x1 = np.column_stack([x, np.ones(len(x))])
        at_risk, acc = hazard_labels(traces.drafted, traces.accepted, self.k)
        self.weights = np.zeros((self.k, x1.shape[1]))
        prev = None
        for j in range(self.k):
            rows = at_risk[:, j]
            if rows.sum() < 10 or acc[rows, j].all() or not acc[rows, j].any():
                # Too little or one-sided data: reuse the previous position's fit, shifted to this rate.
                w = prev.copy() if prev is not None else np.zeros(x1.shape[1])
                rate = (acc[rows, j].sum() + 0.5) / (rows.sum() + 1.0)
                w[-1] = float(logit(np.array(rate)))
            else:
                w = fit_logistic(x1[rows], acc[rows, j].astype(np.float64), self.l2, self.newton_steps)
            self.weights[j] = w
            prev = w
        self.offset[:] = 0.0
        self._last = None
        return self

    def _hazards(self, inputs: PreDraftInputs) -> np.ndarray:
        """The hazards of `inputs` (the same object, unchanged weights: those computed last; a step's verdict rows
        are predicted for the recalibrator and then learnt from)."""
        if self._last is not None and self._last[0] is inputs:
            return self._last[1]
        if self.weights is None:
            raise RuntimeError("ContextEstimator.fit must run before predict")
        x = self._design(inputs)
        z = x @ self.weights[:, :-1].T + self.weights[:, -1] + self.offset
        hazards = sigmoid(z)
        hazards.flags.writeable = False
        self._last = (inputs, hazards)
        return hazards

    def predict(self, inputs: PreDraftInputs) -> np.ndarray:
        return survival_from_hazards(self._hazards(inputs))

    def update(self, inputs: PreDraftInputs, drafted: np.ndarray, accepted: np.ndarray) -> None:
        at_risk, acc = hazard_labels(drafted, accepted, self.k)
        n = at_risk.sum(axis=0)
        if not n.any():
            return
        err = ((acc - self._hazards(inputs)) * at_risk).sum(axis=0)
        # Log-loss gradient w.r.t. each position's bias is (y - p): one SGD step on its batch mean.
        self.offset += self.online_lr * np.divide(err, n, out=np.zeros(self.k), where=n > 0)
        self._last = None


ESTIMATORS: dict[str, type[SurvivalEstimator]] = {
    cls.name: cls for cls in (ConstantEstimator, EWMAEstimator, ContextEstimator)
}
