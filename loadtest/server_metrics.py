"""What the server itself says about a load test, per engine replica, read over HTTP from its `/metrics`.

A ForeSpark server's `/metrics` passes on the series of its node's Ray metrics
agent: vLLM's under `ray_vllm_*` (labelled `ReplicaId`), ForeSpark's under
`ray_forespark_*` (labelled `replica`), both the Serve replica's id. Two
scrapes, before and after a run, give each replica's share of the finished
requests, its mean inter-token latency as the engine measured it, and the CPU
time its processes spent per finished request, and what its WCS engine drafted, how much of it was
accepted and what share of its step time the drafter took: a run in which one replica took
most of the load, or streamed slower than the others, shows here and not in
the client's percentiles. The CPU per request is what was spent at that load,
not a fixed cost: an engine steps whenever it has requests, so on CPU replicas
it falls as the rate rises and more requests share each step. Ray exports
every few seconds (`cluster/serve_env.py`), so the last requests show up late
(`settled_loads` waits for them). On a cluster the server's `/metrics` shows
only its ingress's node; a server without those series (another OpenAI
server) gives an empty result.
"""

from __future__ import annotations

import time

import httpx
from pydantic import BaseModel

SUCCESS = "ray_vllm_request_success_total"
# ForeSpark's exact totals: Ray's export of vLLM's inter-token latency histogram sums bucket midpoints.
ITL_SUM = "ray_forespark_engine_inter_token_latency_seconds_total"
ITL_COUNT = "ray_forespark_engine_inter_token_latency_observations_total"
CPU = "ray_forespark_replica_cpu_seconds_total"  # labelled by process: "engine" (the engine core) or "replica" (the actor)
# WCS's counters (replicas/metrics.py): draft tokens summed over their `position` label, and the runner's time.
DRAFTED, VERIFIED, ACCEPTED = (f"ray_forespark_wcs_{n}_tokens_total" for n in ("drafted", "verified", "accepted"))
DRAFT_S, STEP_S = "ray_forespark_wcs_draft_seconds_total", "ray_forespark_wcs_step_seconds_total"
SERIES = (SUCCESS, ITL_SUM, ITL_COUNT, CPU, DRAFTED, VERIFIED, ACCEPTED, DRAFT_S, STEP_S)
REPLICA_LABELS = ("replica", "ReplicaId")  # Serve's tag on ForeSpark's series, vLLM's on its own

Counters = dict[str, dict[str, float]]  # replica -> series name -> value


class ReplicaLoad(BaseModel):
    requests: float  # finished (stop or length) during the run
    share: float  # of all replicas' finished requests
    itl_ms: float | None  # mean inter-token latency in the engine during the run
    cpu_ms_per_request: float | None = None  # CPU time of the replica's processes during the run, per finished request
    engine_cpu_share: float | None = None  # the engine core's part of that CPU time
    drafted_tokens: float | None = None  # draft tokens the replica's WCS engine drafted during the run (None: no WCS)
    acceptance: float | None = None  # accepted over verified draft tokens (None: nothing verified)
    draft_share: float | None = None  # of the engine's step time, the drafter's part (drafting and keeping its context)


def scrape(url: str, timeout_s: float = 10.0) -> Counters:
    """The server's counters now (empty when it has none or does not answer)."""
    try:
        return counters_from_text(httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s).text)
    except (httpx.HTTPError, ValueError):
        return {}


def counters_from_text(text: str) -> Counters:
    """Per replica: finished requests, the engine's inter-token latency totals (sum and count), CPU seconds per
    process (as `cpu:<process>`) and WCS's draft-token and time totals."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: Counters = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            replica = next((s.labels[k] for k in REPLICA_LABELS if s.labels.get(k)), None)
            if replica is None or s.name not in SERIES:
                continue
            if s.name == SUCCESS and s.labels.get("finished_reason") not in ("stop", "length"):
                continue  # aborted requests did not finish
            name = f"cpu:{s.labels.get('process')}" if s.name == CPU else s.name
            row = counters.setdefault(replica, {})
            row[name] = row.get(name, 0.0) + s.value
    return counters


def replica_loads(before: Counters, after: Counters) -> dict[str, ReplicaLoad]:
    # A replica that started during the run counts its requests from zero, but not its CPU time: that
    # would be its start-up's.
    deltas = {
        replica: {
            name: value - before.get(replica, {}).get(name, 0.0)
            for name, value in row.items()
            if not name.startswith("cpu:") or name in before.get(replica, {})
        }
        for replica, row in after.items()
    }
    total = sum(d.get(SUCCESS, 0.0) for d in deltas.values())
    return {replica: _replica_load(d, total) for replica, d in sorted(deltas.items())}


def _replica_load(d: dict[str, float], total: float) -> ReplicaLoad:
    requests = d.get(SUCCESS, 0.0)
    cpu = {name: value for name, value in d.items() if name.startswith("cpu:")}
    cpu_s = sum(cpu.values())
    has_cpu = bool(cpu) and requests > 0
    return ReplicaLoad(
        requests=requests,
        share=requests / total if total > 0 else 0.0,
        itl_ms=1000.0 * d[ITL_SUM] / d[ITL_COUNT] if d.get(ITL_COUNT, 0.0) > 0 else None,
        cpu_ms_per_request=1000.0 * cpu_s / requests if has_cpu else None,
        engine_cpu_share=cpu.get("cpu:engine", 0.0) / cpu_s if has_cpu and cpu_s > 0 else None,
        drafted_tokens=d.get(DRAFTED),
        acceptance=d[ACCEPTED] / d[VERIFIED] if d.get(VERIFIED, 0.0) > 0 and ACCEPTED in d else None,
        draft_share=d[DRAFT_S] / d[STEP_S] if d.get(STEP_S, 0.0) > 0 and DRAFT_S in d else None,
    )


def settled_loads(url: str, before: Counters, finished: int, wait_s: float = 15.0) -> dict[str, ReplicaLoad]:
    """The replicas' loads once their counts reach `finished` (the client's successful requests): Ray exports
    metrics periodically (10 s by default on a cluster), so the last requests show up late. Gives up after
    `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        loads = replica_loads(before, scrape(url))
        if not loads or sum(r.requests for r in loads.values()) >= finished or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


def format_loads(loads: dict[str, ReplicaLoad]) -> str:
    if not loads:
        return ""
    shares = "/".join(f"{r.share:.0%}" for r in loads.values())
    itl = "/".join("-" if r.itl_ms is None else f"{r.itl_ms:.1f}" for r in loads.values())
    line = f"replicas {shares} of requests, ITL {itl} ms"
    if any(r.cpu_ms_per_request is not None for r in loads.values()):
        cpu = "/".join("-" if r.cpu_ms_per_request is None else f"{r.cpu_ms_per_request:.0f}" for r in loads.values())
        engine = "/".join("-" if r.engine_cpu_share is None else f"{r.engine_cpu_share:.0%}" for r in loads.values())
        line += f", CPU {cpu} ms per request ({engine} in the engine)"
    if any(r.drafted_tokens is not None for r in loads.values()):
        drafted = "/".join("-" if r.drafted_tokens is None else f"{r.drafted_tokens:.0f}" for r in loads.values())
        accepted = "/".join("-" if r.acceptance is None else f"{r.acceptance:.0%}" for r in loads.values())
        share = "/".join("-" if r.draft_share is None else f"{r.draft_share:.1%}" for r in loads.values())
        line += f", drafted {drafted} tokens ({accepted} of those verified accepted; drafter {share} of step time)"
    return line
