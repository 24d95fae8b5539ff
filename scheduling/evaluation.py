"""Estimator quality per draft position: AUC, ECE and Brier of s_i(j) against 1[accepted >= j]."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from scheduling.traces import Traces


class PositionScore(BaseModel):
    position: int
    n: int
    positive_rate: float
    auc: float | None  # None when the position has only one class
    brier: float
    ece: float


class EstimatorReport(BaseModel):
    estimator: str
    positions: list[PositionScore]

    @property
    def mean_auc(self) -> float:
        aucs = [p.auc for p in self.positions if p.auc is not None]
        return float(np.mean(aucs)) if aucs else float("nan")

    @property
    def mean_brier(self) -> float:
        return float(np.mean([p.brier for p in self.positions]))

    @property
    def mean_ece(self) -> float:
        return float(np.mean([p.ece for p in self.positions]))


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Mann-Whitney AUC with average ranks for ties."""
    labels = labels.astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    # Average rank over each run of equal scores.
    _, start, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean((probs - labels.astype(np.float64)) ** 2))


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error over equal-width probability bins."""
    idx = np.minimum((probs * bins).astype(int), bins - 1)
    counts = np.bincount(idx, minlength=bins)
    conf = np.bincount(idx, weights=probs, minlength=bins)
    acc = np.bincount(idx, weights=labels.astype(np.float64), minlength=bins)
    nz = counts > 0
    return float(np.sum(np.abs(acc[nz] - conf[nz])) / len(probs))


def evaluate(estimator, traces: Traces, min_rows: int = 20) -> EstimatorReport:
    """Score `estimator.predict` on traces; position j counts the rows that verified at least j drafts."""
    survival = estimator.predict(traces.inputs)
    scores = []
    for j in range(1, traces.k + 1):
        rows = traces.drafted >= j
        if rows.sum() < min_rows:
            continue
        p = survival[rows, j - 1]
        y = traces.accepted[rows] >= j
        scores.append(
            PositionScore(
                position=j, n=int(rows.sum()), positive_rate=float(y.mean()), auc=auc(p, y), brier=brier(p, y), ece=ece(p, y)
            )
        )
    return EstimatorReport(estimator=getattr(estimator, "name", type(estimator).__name__), positions=scores)


def compare_estimators(traces: Traces, holdout_fraction: float = 0.3, seed: int = 0) -> dict[str, EstimatorReport]:
    """Fit every estimator on the training requests and score it on the held-out ones."""
    from scheduling.estimators import ESTIMATORS

    train, test = traces.split_by_request(holdout_fraction, seed=seed)
    return {name: evaluate(cls(traces.k).fit(train), test) for name, cls in ESTIMATORS.items()}


def survival_brier(survival: np.ndarray, traces: Traces, min_rows: int = 20) -> float:
    """Mean over positions j of the Brier score of survival[:, j-1] for `accepted >= j`, on rows verifying >= j."""
    scores = []
    for j in range(1, traces.k + 1):
        rows = traces.drafted >= j
        if rows.sum() >= min_rows:
            scores.append(brier(survival[rows, j - 1], traces.accepted[rows] >= j))
    return float(np.mean(scores))


def compare_post_draft(
    traces: Traces, estimator: str = "context", holdout_fraction: float = 0.3, seed: int = 0
) -> dict[str, float]:
    """Held-out survival Brier of the pre-draft estimate, the raw drafter confidences and the
    post-draft calibrator (DESIGN.md 1.3); needs traces that logged confidences."""
    from scheduling.calibration import PostDraftCalibrator
    from scheduling.estimators import ESTIMATORS
    from scheduling.survival import hazards_from_survival, survival_from_hazards

    if traces.confidence is None:
        raise ValueError("these traces did not log the drafter's confidences")
    train, test = traces.split_by_request(holdout_fraction, seed=seed)
    pre = ESTIMATORS[estimator](traces.k).fit(train)
    prior_train = hazards_from_survival(pre.predict(train.inputs))
    calibrator = PostDraftCalibrator(traces.k).fit(train.confidence, prior_train, train.drafted, train.accepted)
    pre_test = pre.predict(test.inputs)
    prior_test = hazards_from_survival(pre_test)
    full = np.full(len(test), traces.k)
    return {
        "pre-draft": survival_brier(pre_test, test),
        "raw confidence": survival_brier(survival_from_hazards(np.nan_to_num(test.confidence, nan=0.0)), test),
        "calibrated": survival_brier(calibrator.survival(test.confidence, prior_test, full), test),
    }


def format_comparison(reports: dict[str, EstimatorReport]) -> str:
    lines = [f"{'estimator':>10} {'mean AUC':>9} {'Brier':>8} {'ECE':>8}   AUC per position"]
    for name, r in reports.items():
        per = " ".join("  -  " if p.auc is None else f"{p.auc:.3f}" for p in r.positions)
        lines.append(f"{name:>10} {r.mean_auc:>9.3f} {r.mean_brier:>8.4f} {r.mean_ece:>8.4f}   {per}")
    return "\n".join(lines)
