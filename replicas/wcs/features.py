"""Pre-draft features and the per-request bookkeeping that turns verdicts into training rows.

Before request i drafts from its newest token, the engine has the target's
hidden state and output distribution at that token. The features are a
summary of both (hidden-state norm and a fixed random projection, the
distribution's entropy and max probability), the number of tokens generated
so far, and the request's acceptance history. When that draft is verified
one step later, the features and the realised accepted length make one trace
row: the estimator's online update and `forespark models traces` consume the
same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from scheduling.traces import AcceptanceHistory, PreDraftInputs, Traces

if TYPE_CHECKING:  # torch only where the engine computes features: the controller and the simulator run without it
    import torch

PROJECTIONS = 4
FEATURE_NAMES = ("hidden_norm", "entropy", "max_prob", "log_position") + tuple(
    f"hidden_proj{i}" for i in range(PROJECTIONS)
)


def distribution_stats(logits: torch.Tensor) -> torch.Tensor:
    """(rows, 2): entropy and max probability of each row's softmax."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    # A dot product per row and a max without indices: the elementwise product and `max(-1)` cost more on CPU.
    return torch.stack([-torch.linalg.vecdot(logp.exp(), logp), logp.amax(-1).exp()], dim=1)


class FeatureExtractor:
    def __init__(self, hidden_size: int, seed: int = 0) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.projection = torch.randn(hidden_size, PROJECTIONS, generator=gen) / hidden_size**0.5

    def __call__(self, hidden: torch.Tensor, stats: torch.Tensor, generated: np.ndarray) -> np.ndarray:
        """(B, F) from the target hidden state (B, H) and distribution stats (B, 2) at each request's newest token."""
        import torch

        h = hidden.float().cpu()
        norm = h.norm(dim=-1)
        proj = (h / norm[:, None].clamp_min(1e-6)) @ self.projection
        position = torch.from_numpy(np.log1p(np.asarray(generated, dtype=np.float64))).float()
        return torch.cat([norm[:, None], stats.float().cpu(), position[:, None], proj], dim=1).numpy().astype(np.float64)


@dataclass
class _Drafted:
    """One drafting step's requests, row by row: what each was planned and drafted on."""

    features: np.ndarray  # (B, F)
    history: np.ndarray  # (B,)
    prior: np.ndarray  # (B, K) the estimator's hazards before drafting
    confidence: np.ndarray  # (B, K) the drafter's max probabilities; NaN past the drafted width


@dataclass(frozen=True)
class Verdicts:
    """Trace rows for the requests whose draft was verified this step, with the pre-draft hazards they were planned on."""

    rows: Traces
    prior: np.ndarray  # (N, K)


@dataclass
class AcceptanceTracker:
    """Per-request pre-draft inputs awaiting their verdict, and acceptance history."""

    k: int
    decay: float = 0.7
    _history: AcceptanceHistory = field(init=False)
    _pending: dict[str, tuple[_Drafted, int]] = field(default_factory=dict, init=False)  # request -> (step, row)
    _numbers: dict[str, int] = field(default_factory=dict, init=False)
    _next: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._history = AcceptanceHistory(self.decay)

    def number(self, req_id: str) -> int:
        """A small integer per live request (unique over the tracker's life)."""
        if req_id not in self._numbers:
            self._numbers[req_id] = self._next
            self._next += 1
        return self._numbers[req_id]

    def verdicts(self, req_ids: list[str], verified: np.ndarray, accepted: np.ndarray) -> Verdicts | None:
        """Rows for the requests whose last draft was verified now (None if none were)."""
        has = verified > 0
        if not has.any():  # most steps of a loaded engine: nothing to learn from
            return None
        pending = self._pending
        found = [(n, pending[r]) for n, (r, v) in enumerate(zip(req_ids, verified.tolist())) if v > 0 and r in pending]
        ids = np.array([self.number(r) for r in req_ids], dtype=np.int64)
        self._history.observe(ids[has], verified[has], accepted[has])
        if not found:
            return None
        rows = [n for n, _ in found]
        step = found[0][1][0]
        if all(s is step for _, (s, _) in found):  # drafted in one step (always, unless a verdict was skipped)
            at = [i for _, (_, i) in found]
            features, history, prior, confidence = step.features[at], step.history[at], step.prior[at], step.confidence[at]
        else:
            features, history, prior, confidence = (
                np.stack([getattr(s, name)[i] for _, (s, i) in found])
                for name in ("features", "history", "prior", "confidence")
            )
        traces = Traces(
            PreDraftInputs(features, history),
            verified[rows].astype(np.int64),
            accepted[rows].astype(np.int64),
            ids[rows],
            self.k,
            FEATURE_NAMES,
            confidence,
        )
        return Verdicts(traces, prior)

    def pre_draft(self, req_ids: list[str], features: np.ndarray) -> PreDraftInputs:
        ids = np.array([self.number(r) for r in req_ids], dtype=np.int64)
        return PreDraftInputs(features, self._history.rates(ids))

    def drafted(self, req_ids: list[str], inputs: PreDraftInputs, prior: np.ndarray, confidence: np.ndarray, draft: np.ndarray) -> None:
        """Remember what request i was planned and drafted on until its verdict arrives next step."""
        conf = np.where(np.arange(self.k)[None, :] < np.asarray(draft)[:, None], confidence, np.nan)
        step = _Drafted(np.asarray(inputs.features), np.asarray(inputs.history, dtype=np.float64), np.asarray(prior), conf)
        self._pending.update(zip(req_ids, zip([step] * len(req_ids), range(len(req_ids)))))

    def live(self) -> list[str]:
        return sorted(set(self._numbers) | set(self._pending))

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self._pending.pop(r, None)
            number = self._numbers.pop(r, None)
            if number is not None:
                self._history.forget(number)
