"""Online recalibration of any pre-draft estimator against the acceptance it is realised with.

An estimator fitted offline can be wrong for the traffic at hand (another
domain, another temperature, another model pair), and a wrong pessimistic
belief confirms itself: a request predicted to accept poorly is not drafted,
so no verdict corrects it. This layer closes the loop for every estimator
alike. Per draft position j it keeps decayed sums over the verdicts where j
was at risk (verified, and every earlier draft accepted): N_j rows, A_j
acceptances, P_j the estimator's own hazards. The served hazard is the
estimator's moved in logit space by

    o_j = logit(realised_j) - logit(predicted_j)

with realised_j = (A_j + m a) / (N_j + m) and predicted_j = (P_j + m p)
/ (N_j + m), shrunk towards the positions' pooled rates a = A/N, p = P/N by
`pseudo_rows` = m. A position nothing has reached yet takes the pooled
offset: one-token probes (`scheduling.exploration`) verify only position 1,
and what they show moves every position. Uses only verdicts of earlier
steps, so plans stay lossless.
"""

from __future__ import annotations

import numpy as np

from scheduling.estimators import hazard_labels
from scheduling.survival import hazards_from_survival, logit, sigmoid, survival_from_hazards

_EPS = 1e-3


class OnlineRecalibrator:
    def __init__(self, k: int, decay: float = 0.995, pseudo_rows: float = 20.0) -> None:
        if not 0.0 < decay <= 1.0 or pseudo_rows <= 0:
            raise ValueError("need 0 < decay <= 1 and pseudo_rows > 0")
        self.k = k
        self.decay = decay
        self.pseudo_rows = pseudo_rows
        self._n = np.zeros(k)
        self._a = np.zeros(k)
        self._p = np.zeros(k)
        self.offset = np.zeros(k)

    def update(self, hazards: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """One step's verdicts: the estimator's hazards (N, K) for the verified drafts, and their outcome."""
        at_risk, acc = hazard_labels(np.asarray(drafted), np.asarray(accepted), self.k)
        self._n = self.decay * self._n + at_risk.sum(axis=0)
        self._a = self.decay * self._a + (at_risk & acc).sum(axis=0)
        self._p = self.decay * self._p + np.where(at_risk, hazards, 0.0).sum(axis=0)
        n = self._n.sum()
        if n <= 0:
            return
        m = self.pseudo_rows
        realised = (self._a + m * self._a.sum() / n) / (self._n + m)
        predicted = (self._p + m * self._p.sum() / n) / (self._n + m)
        clip = lambda x: np.clip(x, _EPS, 1.0 - _EPS)  # noqa: E731
        self.offset = logit(clip(realised)) - logit(clip(predicted))

    def apply(self, survival: np.ndarray) -> np.ndarray:
        """Survival curves (B, K) with the offsets applied to their hazards."""
        if not self.offset.any():
            return survival
        hazards = np.clip(hazards_from_survival(survival), _EPS, 1.0 - _EPS)
        return survival_from_hazards(sigmoid(logit(hazards) + self.offset))
