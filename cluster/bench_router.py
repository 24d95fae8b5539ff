"""Decision time of the cluster router: `forespark bench router`.

The real `AcceptanceHeadroomRouter` ranks fleets of 8..256 replicas for
requests from the shipped workloads. Replicas are stand-ins for Serve's
`RunningReplica` (which needs live actors) carrying the two things the
router reads: an id and real `RoutingStats`, computed from a profiled-like
cost model at random loads, refreshed every `refresh_every` decisions as
Serve's polling would (a new candidate list each time, as Serve hands the router). In-flight accounting runs as in serving (each routed
request completes a few decisions later). Variants, timed in one run:

- `ranked`: fresh stats on every replica (the normal path);
- `cold`: no stats yet (the power-of-two fallback), the floor of what any decision costs here.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque

import numpy as np
from pydantic import BaseModel

from replicas.routing_stats import StepMix, routing_stats
from scheduling.cost_model import StepCostModel

TARGET_P50_US = 200.0


class BenchReplica:
    """Stand-in for Serve's RunningReplica: the id and routing stats the router reads."""

    def __init__(self, replica_id, routing_stats: dict) -> None:
        self.replica_id = replica_id
        self.routing_stats = routing_stats


class RouterBenchRow(BaseModel):
    variant: str
    replicas: int
    decisions: int
    p50_us: float
    p90_us: float
    p99_us: float


class RouterBenchResult(BaseModel):
    rows: list[RouterBenchRow]
    target_p50_us: float = TARGET_P50_US
    p50_at_64_us: float | None = None
    ranked_vs_cold_at_64: float | None = None


def _fleet_stats(n: int, rng: random.Random) -> list[dict]:
    cost = StepCostModel.linear(intercept_ms=8.0, per_request_ms=0.1, per_draft_ms=0.2, per_target_ms=0.3, draft_launch_ms=5.0)
    out = []
    for _ in range(n):
        running = rng.randrange(0, 64)
        mix = StepMix(drafted=rng.uniform(0, 4), verified=rng.uniform(0, 3), accepted=rng.uniform(0, 2), measured=True)
        stats = routing_stats(
            cost=cost, running=running, waiting=rng.randrange(0, 3), kv_usage=rng.random(), max_num_seqs=64,
            token_budget=2048, cap_ms=100.0, mix=mix, predicted_accept_len=rng.uniform(1.5, 4.0),
        )
        out.append(stats.model_dump())
    return out


def _router():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster.router import AcceptanceHeadroomRouter

    router = AcceptanceHeadroomRouter(deployment_id=DeploymentID(name="EngineReplica", app_name="bench"), handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    return router


async def _time_variant(variant: str, n: int, decisions: int, refresh_every: int, seed: int) -> np.ndarray:
    from ray.serve._private.common import DeploymentID, ReplicaID, RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    from replicas.models.workloads import mixed_workload

    rng = random.Random(seed)
    router = _router()
    dep = DeploymentID(name="EngineReplica", app_name="bench")
    replicas = [BenchReplica(ReplicaID(unique_id=f"r{i}", deployment_id=dep), {}) for i in range(n)]
    bodies = [{"model": "forespark", "prompt": p.prompt, "max_tokens": p.max_tokens} for p in mixed_workload(256, seed)]
    routed: deque = deque()
    times = np.empty(decisions)
    for i in range(decisions):
        if variant == "ranked" and i % refresh_every == 0:  # as Serve does: a new candidate list with the new stats
            now = time.time()
            replicas = [BenchReplica(r.replica_id, {**s, "timestamp": now}) for r, s in zip(replicas, _fleet_stats(n, rng))]
        request = PendingRequest(
            args=["completions", bodies[i % len(bodies)]],
            kwargs={},
            metadata=RequestMetadata(request_id=str(i), internal_request_id=str(i), call_method="call"),
        )
        start = time.perf_counter()
        ranks = await router.choose_replicas(replicas, request)
        times[i] = time.perf_counter() - start
        chosen = ranks[0][0].replica_id
        router.on_request_routed(request, chosen, None)
        routed.append(chosen)
        if len(routed) > 4 * n:  # requests finish a while after they are routed
            router.on_request_completed(routed.popleft(), "")
    return times * 1e6


def run(replica_counts=(8, 64, 256), decisions: int = 3000, refresh_every: int = 200, seed: int = 0, progress=None) -> RouterBenchResult:
    rows = []
    for n in replica_counts:
        for variant in ("ranked", "cold"):
            us = asyncio.run(_time_variant(variant, n, decisions, refresh_every, seed))[decisions // 10 :]  # skip warm-up
            rows.append(
                RouterBenchRow(
                    variant=variant, replicas=n, decisions=len(us),
                    p50_us=float(np.median(us)), p90_us=float(np.percentile(us, 90)), p99_us=float(np.percentile(us, 99)),
                )
            )
            if progress:
                progress(rows[-1])
    result = RouterBenchResult(rows=rows)
    at64 = {r.variant: r.p50_us for r in rows if r.replicas == 64}
    if "ranked" in at64:
        result.p50_at_64_us = at64["ranked"]
        result.ranked_vs_cold_at_64 = at64["ranked"] / at64["cold"]
    return result


def format_table(result: RouterBenchResult) -> str:
    lines = [f"{'variant':>8} {'replicas':>8} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8}"]
    for r in result.rows:
        lines.append(f"{r.variant:>8} {r.replicas:>8} {r.p50_us:>8.1f} {r.p90_us:>8.1f} {r.p99_us:>8.1f}")
    if result.p50_at_64_us is not None:
        verdict = "meets" if result.p50_at_64_us <= result.target_p50_us else "MISSES"
        lines.append(
            f"p50 at 64 replicas: {result.p50_at_64_us:.1f} us ({verdict} the {result.target_p50_us:.0f} us target); "
            f"ranked/cold: {result.ranked_vs_cold_at_64:.2f}x"
        )
    return "\n".join(lines)
