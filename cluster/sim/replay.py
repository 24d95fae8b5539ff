"""Acceptance replayed from recorded traces (`forespark models traces`, the embedded pair's
`replicas/models/weights/traces.npz`): what validation against the real engine runs on.

Each simulated request follows one recorded request (picked by its key, among those of its own domain where
the traces carry domains): at each drafting step it takes the
recorded row whose output position is the nearest at or below its own (the first row before any), with that
row's pre-draft features, the drafter's confidences and the accepted length. Keyed by position, not by the
count of drafting steps, because acceptance grows along an output (the shipped traces accept 0.7 drafts a
step in the first 20 tokens and 4.6 past 60, where greedy outputs repeat) and a policy that drafts less
often reaches a position in fewer drafting steps. The controller's estimators, fitted on the same traces
as the real engine's, see the inputs they see in the engine. A row verified at full width gives the
accepted length exactly; a shorter row whose drafts were all accepted is censored, and counts as that many
(a slight undercount).
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
        position = np.rint(np.expm1(t.inputs.features[:, list(t.feature_names).index("log_position")])).astype(np.int64)
        self._rows, self._positions = [], []
        self._by_domain: dict[str, list[int]] = {}  # domain -> its recorded requests (indices into _rows)
        for r in np.unique(t.request_id):
            rows = np.flatnonzero(t.request_id == r)
            rows = rows[np.argsort(position[rows], kind="stable")]
            if t.domain is not None:
                self._by_domain.setdefault(str(t.domain[rows[0]]), []).append(len(self._rows))
            self._rows.append(rows)
            self._positions.append(position[rows])
        self.confidence = np.nan_to_num(t.confidence, nan=0.5)

    def request_offset(self, domain: str, request: int) -> float:
        return 0.0

    def _source(self, key: int, domain: str) -> int:
        u = keyed_uniforms(self.seed, np.array([key]), np.array([2**41]), 1)[0, 0]
        pool = self._by_domain.get(domain)
        return pool[int(u * len(pool))] if pool else int(u * len(self._rows))

    def step(self, domains: list[str], offsets: np.ndarray, generated: np.ndarray, requests: np.ndarray | None = None) -> StepDraw:
        keys = np.arange(len(domains)) if requests is None else np.asarray(requests)
        rows = np.empty(len(keys), dtype=np.int64)
        for i, (key, domain, g) in enumerate(zip(keys.tolist(), domains, np.asarray(generated).tolist())):
            source = self._source(key, domain)
            at = max(int(np.searchsorted(self._positions[source], g, side="right")) - 1, 0)
            rows[i] = self._rows[source][at]
        t = self.traces
        return StepDraw(
            features=t.inputs.features[rows],
            hazards=np.full((len(rows), self.k), np.nan),
            accept_len=t.accepted[rows],
            confidence=self.confidence[rows],
        )
