"""Post-draft survival: the drafter's own confidences refine the pre-draft estimate (DESIGN.md 1.3).

Per position j, P(accept j | first j-1 accepted) = sigmoid(a_j logit(c_j) +
b_j logit(h_j) + e_j), where c_j is the draft distribution's maximum
probability at j (never the drafted token's own probability, and for a
parallel drafter computed without any drafted token) and h_j the pre-draft
estimator's hazard. Fitted offline on traces that logged the confidences,
recalibrated online through e_j as verdicts arrive. Without fitted weights it
trusts the raw confidence (a_j = 1).
"""

from __future__ import annotations

import numpy as np

from scheduling.estimators import hazard_labels
from scheduling.survival import fit_logistic, logit, sigmoid


class PostDraftCalibrator:
    def __init__(self, k: int, l2: float = 1.0, online_lr: float = 0.05) -> None:
        self.k = k
        self.l2 = l2
        self.online_lr = online_lr
        self.weights = np.tile([1.0, 0.0, 0.0], (k, 1))  # (K, 3): confidence, prior hazard, bias

    @staticmethod
    def _design(confidence: np.ndarray, prior: np.ndarray) -> np.ndarray:
        confidence = np.asarray(confidence, dtype=np.float64)
        x = np.empty((*confidence.shape, 3))  # (B, K, 3)
        # NaN (not drafted) reads as 0.5; logit clips, so infinities fare as they would after nan_to_num.
        x[..., 0] = logit(np.where(np.isnan(confidence), 0.5, confidence))
        x[..., 1] = logit(prior)
        x[..., 2] = 1.0
        return x

    def fit(self, confidence: np.ndarray, prior: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> "PostDraftCalibrator":
        at_risk, acc = hazard_labels(drafted, accepted, self.k)
        x = self._design(confidence, prior)
        for j in range(self.k):
            rows = at_risk[:, j] & ~np.isnan(confidence[:, j])
            y = acc[rows, j].astype(np.float64)
            if rows.sum() >= 20 and 0 < y.sum() < len(y):
                self.weights[j] = fit_logistic(x[rows, j], y, self.l2)
            elif j > 0:
                self.weights[j] = self.weights[j - 1]
        return self

    def hazards(self, confidence: np.ndarray, prior: np.ndarray) -> np.ndarray:
        return sigmoid(np.einsum("bkf,kf->bk", self._design(confidence, prior), self.weights))

    def survival(self, confidence: np.ndarray, prior: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """(B, K) post-draft survival over each request's first drafted[i] positions, 0 past them."""
        mask = np.arange(self.k)[None, :] < np.asarray(drafted)[:, None]
        return np.cumprod(np.where(mask, self.hazards(confidence, prior), 0.0), axis=1)

    def update(self, confidence: np.ndarray, prior: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        at_risk, acc = hazard_labels(drafted, accepted, self.k)
        at_risk &= ~np.isnan(confidence)
        n = at_risk.sum(axis=0)
        if not n.any():
            return
        err = ((acc - self.hazards(confidence, prior)) * at_risk).sum(axis=0)
        self.weights[:, 2] += self.online_lr * np.divide(err, n, out=np.zeros(self.k), where=n > 0)
