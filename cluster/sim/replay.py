"""Acceptance replayed from recorded traces (`forespark models traces`, the embedded pair's
`replicas/models/weights/traces.npz`): what validation against the real engine runs on.

Each simulated request follows one recorded request (picked by its key), step by step: its n-th drafting step
sees the recorded request's n-th row (cycling), with that row's pre-draft features, the drafter's confidences
and the accepted length. So the controller's estimators, fitted on the same traces as the real engine's,
see the inputs they see in the engine. A row verified at full width gives the accepted length exactly; a
shorter row whose drafts were all accepted is censored, and counts as that many (a slight undercount).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.sim.acceptance import StepDraw, keyed_uniforms
from scheduling.traces import Traces


class TraceReplay:
    def __init__(self, traces: Traces | Path, seed: int = 0) -> None:
        self.traces = traces if isinstance(traces, Traces) else Traces.load(traces)
        t = self.traces
        if t.confidence is None:
            raise ValueError("replaying traces needs the drafter's confidences (record them with `forespark models traces`)")
        self.k, self.seed = t.k, seed
        self._rows = [np.flatnonzero(t.request_id == r) for r in np.unique(t.request_id)]
        self._next: dict[int, int] = {}
        self.confidence = np.nan_to_num(t.confidence, nan=0.5)

    def request_offset(self, domain: str, request: int) -> float:
        return 0.0

    def _source(self, key: int) -> np.ndarray:
        u = keyed_uniforms(self.seed, np.array([key]), np.array([2**41]), 1)[0, 0]
        return self._rows[int(u * len(self._rows))]

    def step(self, domains: list[str], offsets: np.ndarray, generated: np.ndarray, requests: np.ndarray | None = None) -> StepDraw:
        keys = np.arange(len(domains)) if requests is None else np.asarray(requests)
        rows = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys.tolist()):
            source = self._source(key)
            n = self._next.get(key, 0)
            rows[i] = source[n % len(source)]
            self._next[key] = n + 1
        t = self.traces
        return StepDraw(
            features=t.inputs.features[rows],
            hazards=np.full((len(rows), self.k), np.nan),
            accept_len=t.accepted[rows],
            confidence=self.confidence[rows],
        )
