"""The router's Prometheus series (in the ingress process's registry, served at its /metrics).

Kept apart from `cluster/router.py`: Serve pickles the router's module by
value, and metric objects hold locks that cannot be pickled.
"""

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter(
    "forespark_router_decisions",
    "routing decisions of the request router",
    ["router", "mode"],  # ranked (on replica stats) | fallback (power of two choices) | refused | gated (at the ingress)
)
DECISION_SECONDS = Histogram(
    "forespark_router_decision_seconds",
    "time the router takes to rank the replicas for one request",
    ["router"],
    buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3),
)
ADMISSION_CORRECTION = Gauge(
    "forespark_admission_correction",
    "admission's correction from measured requests: ms added to predicted TTFTs (slo=ttft), and corrected "
    "TPOT = tpot + tpot_slope * predicted (ms)",
    ["slo"],
)
