"""The router's and the ingress's series, exported through Ray's metrics system (`ray.serve.metrics`).

The router runs in the ingress replica (the engine handle's owner), so Serve
tags these series with the ingress's deployment and replica; the node's Ray
metrics agent serves them with the replicas' (docs/deploy.md). Each family
keeps prometheus_client's `labels(...).inc()` form and creates its Ray metric
on first use: in a Serve replica that is after Serve set the replica
context its tags come from, never at import. Outside Ray, recording is a
no-op.

Kept apart from `cluster/router.py`: Serve pickles the router's module by
value; this module is imported, not pickled.
"""

from __future__ import annotations

import threading
from typing import Any, Literal


class _Family:
    def __init__(
        self,
        kind: Literal["counter", "gauge", "histogram"],
        name: str,
        documentation: str,
        labelnames: tuple[str, ...] = (),
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames, self.buckets = labelnames, buckets
        self._metric: Any = None
        self._lock = threading.Lock()

    def metric(self) -> Any:
        with self._lock:
            if self._metric is None:
                from ray.serve import metrics

                keys = self.labelnames or None
                if self.kind == "counter":
                    self._metric = metrics.Counter(self.name, self.documentation, tag_keys=keys)
                elif self.kind == "gauge":
                    self._metric = metrics.Gauge(self.name, self.documentation, tag_keys=keys)
                else:
                    self._metric = metrics.Histogram(self.name, self.documentation, boundaries=list(self.buckets), tag_keys=keys)
            return self._metric

    def labels(self, *values: str) -> "_Child":
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
        return _Child(self, dict(zip(self.labelnames, map(str, values))))


class _Child:
    """One labelled series of a family (what prometheus_client's `labels(...)` returns)."""

    def __init__(self, family: _Family, tags: dict[str, str]) -> None:
        self.family, self.tags = family, tags

    def inc(self, amount: float = 1.0) -> None:
        if amount > 0:
            self.family.metric().inc(float(amount), tags=dict(self.tags))

    def set(self, value: float) -> None:
        self.family.metric().set(float(value), tags=dict(self.tags))

    def observe(self, value: float) -> None:
        self.family.metric().observe(float(value), tags=dict(self.tags))


DECISIONS = _Family(
    "counter",
    "forespark_router_decisions",
    "routing decisions of the request router",
    ("router", "mode"),  # ranked (on replica stats) | fallback (power of two choices) | refused | held (to be decided again) | gated (at the ingress) | proxy (from the board)
)
DECISION_SECONDS = _Family(
    "histogram",
    "forespark_router_decision_seconds",
    "time the router takes to rank the replicas for one request",
    ("router",),
    buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3),
)
ADMISSION_CORRECTION = _Family(
    "gauge",
    "forespark_admission_correction",
    "admission's correction from measured requests: ms added to predicted TTFTs (slo=ttft), and corrected "
    "TPOT = tpot + tpot_slope * predicted (ms)",
    ("slo",),
)
