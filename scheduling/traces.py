"""Logged acceptance traces: what the estimators learn from and are judged on.

One row per (engine step, request): the pre-draft inputs (context features and
the request's acceptance history as it stood *before* the step), how many
draft tokens were verified, and how many of them were accepted. Positions
beyond `drafted` are censored (never observed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from scheduling.survival import sigmoid


@dataclass(frozen=True)
class PreDraftInputs:
    """What exists before the draft pass, for a batch of B requests."""

    features: np.ndarray  # (B, F) float: target hidden-state summary, entropy, max-prob, position...
    history: np.ndarray  # (B,) float: EWMA per-token acceptance rate so far; NaN when the request has none

    def __post_init__(self) -> None:
        if self.features.ndim != 2 or self.history.shape != (self.features.shape[0],):
            raise ValueError(
                f"features must be (B, F) and history (B,); got {self.features.shape} and {self.history.shape}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.features.shape[0])


@dataclass(frozen=True)
class Traces:
    inputs: PreDraftInputs
    drafted: np.ndarray  # (N,) int: draft tokens verified this step (observation width)
    accepted: np.ndarray  # (N,) int: accepted draft tokens, 0 <= accepted <= drafted
    request_id: np.ndarray  # (N,) int
    k: int  # block size (max draft width)
    feature_names: tuple[str, ...] = ()
    # (N, K) the drafter's max probability per drafted position (NaN where not drafted); None if not logged
    confidence: np.ndarray | None = None
    domain: np.ndarray | None = None  # (N,) str: the workload domain of the row's prompt; None if not logged

    def __post_init__(self) -> None:
        n = self.inputs.batch_size
        if self.confidence is not None and self.confidence.shape != (n, self.k):
            raise ValueError(f"confidence must have shape ({n}, {self.k})")
        if self.domain is not None and self.domain.shape != (n,):
            raise ValueError(f"domain must have shape ({n},)")
        for name in ("drafted", "accepted", "request_id"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must have shape ({n},)")
        if (self.accepted > self.drafted).any() or (self.accepted < 0).any() or (self.drafted > self.k).any():
            raise ValueError("need 0 <= accepted <= drafted <= k")

    def __len__(self) -> int:
        return self.inputs.batch_size

    def subset(self, rows: np.ndarray) -> "Traces":
        return Traces(
            PreDraftInputs(self.inputs.features[rows], self.inputs.history[rows]),
            self.drafted[rows],
            self.accepted[rows],
            self.request_id[rows],
            self.k,
            self.feature_names,
            None if self.confidence is None else self.confidence[rows],
            None if self.domain is None else self.domain[rows],
        )

    def mean_accepted_length(self) -> dict[str, float]:
        """Per domain: accepted drafts + 1 over the rows verified at full width (an empty dict without domains)."""
        if self.domain is None:
            return {}
        full = self.drafted == self.k
        return {str(d): 1.0 + float(self.accepted[full & (self.domain == d)].mean())
                for d in np.unique(self.domain[full])}

    def split_by_request(self, holdout_fraction: float, seed: int = 0) -> tuple["Traces", "Traces"]:
        """Train/held-out split that keeps every request's rows on one side."""
        ids = np.unique(self.request_id)
        rng = np.random.default_rng(seed)
        held = rng.permutation(ids)[: max(1, int(round(len(ids) * holdout_fraction)))]
        mask = np.isin(self.request_id, held)
        return self.subset(np.flatnonzero(~mask)), self.subset(np.flatnonzero(mask))

    @classmethod
    def concatenate(cls, parts: list["Traces"]) -> "Traces":
        if not parts or any(p.k != parts[0].k for p in parts):
            raise ValueError("need at least one part, all with the same k")
        return cls(
            PreDraftInputs(
                np.concatenate([p.inputs.features for p in parts]), np.concatenate([p.inputs.history for p in parts])
            ),
            np.concatenate([p.drafted for p in parts]),
            np.concatenate([p.accepted for p in parts]),
            np.concatenate([p.request_id for p in parts]),
            parts[0].k,
            parts[0].feature_names,
            None if any(p.confidence is None for p in parts) else np.concatenate([p.confidence for p in parts]),
            None if any(p.domain is None for p in parts) else np.concatenate([p.domain for p in parts]),
        )

    def save(self, path: str | Path | IO[bytes]) -> None:
        np.savez_compressed(
            path,
            features=self.inputs.features,
            history=self.inputs.history,
            drafted=self.drafted,
            accepted=self.accepted,
            request_id=self.request_id,
            k=np.int64(self.k),
            feature_names=np.array(self.feature_names, dtype=str),
            **({} if self.confidence is None else {"confidence": self.confidence}),
            **({} if self.domain is None else {"domain": self.domain.astype(str)}),
        )

    @classmethod
    def load(cls, path: str | Path | IO[bytes]) -> "Traces":
        with np.load(path) as z:
            return cls(
                PreDraftInputs(z["features"], z["history"]),
                z["drafted"],
                z["accepted"],
                z["request_id"],
                int(z["k"]),
                tuple(str(x) for x in z["feature_names"]),
                z["confidence"] if "confidence" in z.files else None,
                z["domain"] if "domain" in z.files else None,
            )


class AcceptanceHistory:
    """Per-request exponentially decayed acceptance counts -> per-token acceptance rate.

    A step that verified `d` drafts and accepted `a` observed `a` acceptances and,
    when a < d, one rejection: the geometric MLE of the per-token rate is
    accepted / trials, decayed by `decay` per step.
    """

    def __init__(self, decay: float = 0.7) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError("decay must be in [0, 1)")
        self.decay = decay
        self._acc: dict[int, float] = {}
        self._trials: dict[int, float] = {}

    def rates(self, request_ids: np.ndarray) -> np.ndarray:
        out = np.full(len(request_ids), np.nan)
        for n, rid in enumerate(request_ids.tolist()):
            trials = self._trials.get(rid, 0.0)
            if trials > 0:
                out[n] = self._acc[rid] / trials
        return out

    def observe(self, request_ids: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        trials = accepted + (accepted < drafted)
        for rid, a, t in zip(request_ids.tolist(), accepted.tolist(), trials.tolist()):
            if t == 0:
                continue
            self._acc[rid] = self.decay * self._acc.get(rid, 0.0) + a
            self._trials[rid] = self.decay * self._trials.get(rid, 0.0) + t

    def forget(self, request_id: int) -> None:
        self._acc.pop(request_id, None)
        self._trials.pop(request_id, None)


SYNTHETIC_FEATURES = ("entropy", "max_prob", "hidden_noise", "position")


def synthetic_traces(
    *,
    num_requests: int = 400,
    steps_per_request: int = 30,
    k: int = 8,
    feature_strength: float = 2.0,
    request_spread: float = 0.5,
    base_logit: float = 1.5,
    position_slope: float = 0.15,
    random_widths: bool = True,
    seed: int = 0,
) -> Traces:
    """Traces whose per-position acceptance is a known logistic function of a context feature.

    hazard_j = sigmoid(base - strength * entropy_z + u_request - slope * j).
    `feature_strength=0` makes the features carry no signal (the negative control);
    `request_spread` is a persistent per-request effect that only history can see.
    """
    rng = np.random.default_rng(seed)
    n = num_requests * steps_per_request
    rid = np.repeat(np.arange(num_requests), steps_per_request)
    u = rng.normal(0.0, request_spread, num_requests)[rid]
    entropy_z = rng.normal(0.0, 1.0, n)
    max_prob = sigmoid(-1.2 * entropy_z + rng.normal(0.0, 0.3, n))
    noise = rng.normal(0.0, 1.0, n)
    position = np.tile(np.arange(steps_per_request), num_requests).astype(np.float64)
    j = np.arange(1, k + 1)
    hazard = sigmoid(base_logit - feature_strength * entropy_z[:, None] + u[:, None] - position_slope * j[None, :])
    accepted_full = np.cumprod(rng.random((n, k)) < hazard, axis=1).sum(axis=1)
    drafted = rng.integers(1, k + 1, n) if random_widths else np.full(n, k)
    accepted = np.minimum(accepted_full, drafted)

    history = np.empty(n)
    tracker = AcceptanceHistory()
    for step in range(steps_per_request):
        rows = np.arange(num_requests) * steps_per_request + step
        history[rows] = tracker.rates(rid[rows])
        tracker.observe(rid[rows], drafted[rows], accepted[rows])

    features = np.stack([entropy_z, max_prob, noise, position], axis=1)
    return Traces(PreDraftInputs(features, history), drafted, accepted, rid, k, SYNTHETIC_FEATURES)
