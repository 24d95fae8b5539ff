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
from scheduling.survival import clip, hazards_from_survival, logit, sigmoid, survival_from_hazards

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
        self.offset = logit(clip(realised, _EPS, 1.0 - _EPS)) - logit(clip(predicted, _EPS, 1.0 - _EPS))

    def apply(self, survival: np.ndarray) -> np.ndarray:
        """Survival curves (B, K) with the offsets applied to their hazards."""
        if not self.offset.any():
            return survival
        hazards = clip(hazards_from_survival(survival), _EPS, 1.0 - _EPS)
        return survival_from_hazards(sigmoid(logit(hazards) + self.offset))


class RealisedGain:
    """What a drafted position turns into, against what the plan expected of it.

    The planner drafts position j of request i for the survival s_ij it was
    given; the position pays only if it is then verified (the post-draft
    allocator may cut it) and accepted. Per position j this keeps decayed sums
    over drafted slots of the expected s_ij (E_j) and of the realised outcome
    (R_j: 1 when verified and every draft up to j accepted, else 0), and scales
    later plans' survival by r_j = (R_j + m r) / (E_j + m r') (pooled rates r,
    r' as prior, `pseudo_rows` = m), capped at 1 and kept non-increasing along j,
    so plans count the tokens drafting has been realising, not those it was
    promised. The selection the planner makes (drafting where survival looks
    highest) and the allocator's cuts both show up here and nowhere else.
    Uses only verdicts of earlier steps: plans stay lossless.
    """

    def __init__(self, k: int, decay: float = 0.99, pseudo_rows: float = 20.0) -> None:
        if not 0.0 < decay <= 1.0 or pseudo_rows <= 0:
            raise ValueError("need 0 < decay <= 1 and pseudo_rows > 0")
        self.k = k
        self.decay = decay
        self.pseudo_rows = pseudo_rows
        self.expected = np.zeros(k)
        self.realised = np.zeros(k)
        self.slots = np.zeros(k)
        self.ratio = np.ones(k)

    def update(self, survival: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, verified: np.ndarray) -> None:
        """Requests that drafted `drafted` (N,) positions on `survival` (N, K): `verified` (N,) of them were
        verified and `accepted` (N,) accepted."""
        j = np.arange(self.k)[None, :]
        slot = j < np.asarray(drafted)[:, None]
        won = slot & (j < np.minimum(accepted, verified)[:, None])
        self.slots = self.decay * self.slots + slot.sum(axis=0)
        self.expected = self.decay * self.expected + np.where(slot, survival, 0.0).sum(axis=0)
        self.realised = self.decay * self.realised + won.sum(axis=0)
        n = self.slots.sum()
        if n <= 0:
            return
        m = self.pseudo_rows
        per_slot_realised, per_slot_expected = self.realised.sum() / n, self.expected.sum() / n
        ratio = (self.realised + m * per_slot_realised) / np.maximum(self.expected + m * per_slot_expected, _EPS)
        self.ratio = np.minimum.accumulate(clip(ratio, 0.0, 1.0))

    def apply(self, survival: np.ndarray) -> np.ndarray:
        if (self.ratio >= 1.0).all():
            return survival
        return survival * self.ratio[None, :]
