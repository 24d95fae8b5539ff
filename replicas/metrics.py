"""Prometheus metrics of a replica: vLLM's own and WCS's, exported through Ray's metrics system.

In a Serve replica vLLM logs through `RayPrometheusStatLogger` (its `vllm:*`
series become Ray metrics, tagged `ReplicaId`), and `RayExport` hands the WCS
families below to `ray.serve.metrics` every stats period (Serve tags them
`deployment`, `replica`, `application`). Each node's Ray metrics agent serves
both at `http://<node>:<metrics export port>/metrics`, so nothing central
collects them (docs/deploy.md). An engine outside Serve renders the same
families as text (`replica_metrics_text`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replicas.routing_stats import RoutingStats

logger = logging.getLogger("ray.serve")


class LatestSchedulerStats:
    """A vLLM per-engine stat logger that keeps the last scheduler stats (waiting requests, KV use) and totals
    the engine's realised decoding: seconds between a request's outputs (`decode_s`) and the tokens those
    outputs carried (`decode_tokens`; every generated token but each request's first). `decode_outputs` counts
    those outputs: `decode_s / decode_outputs` is vLLM's mean inter-token latency, exactly (Ray's export of
    vLLM's histogram sums bucket midpoints)."""

    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
        self.waiting = 0
        self.kv_usage = 0.0
        self.decode_s = 0.0
        self.decode_tokens = 0
        self.decode_outputs = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.decode_s += sum(iteration_stats.inter_token_latencies_iter)
            self.decode_outputs += len(iteration_stats.inter_token_latencies_iter)
            self.decode_tokens += iteration_stats.num_generation_tokens - len(iteration_stats.time_to_first_tokens_iter)

    def realised_tpot_ms(self, before: tuple[float, int]) -> tuple[float | None, tuple[float, int]]:
        """Realised TPOT (ms per decoded token) since the totals `before`, None under 16 decoded tokens; and the
        totals now, for the next call."""
        now = (self.decode_s, self.decode_tokens)
        tokens = now[1] - before[1]
        return (1000.0 * (now[0] - before[0]) / tokens if tokens >= 16 else None), now

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def factory(self):
        """What `AsyncLLM(stat_loggers=[...])` takes: it builds per-engine loggers from (config, index)."""
        return lambda vllm_config, engine_index=0: self


def process_cpu_seconds(pid: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of a process, this one by default ("replica": the Serve actor, which tokenizes,
    detokenizes and streams), and of its child processes ("engine": vLLM's engine core, which AsyncLLM always
    runs apart)."""
    import psutil

    me = psutil.Process(pid)
    engine = 0.0
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        engine += times.user + times.system
    own = me.cpu_times()
    return {"replica": own.user + own.system, "engine": engine}


def measured_step_ms(wcs: dict | None, before: dict | None) -> float | None:
    """Mean runner step time (ms) between two WCS stats snapshots, over the steps the controller planned or held;
    None when no step ran."""
    if wcs is None:
        return None
    prior = before or {}
    steps = wcs["steps"] + wcs.get("held_steps", 0) - prior.get("steps", 0) - prior.get("held_steps", 0)
    return (wcs["step_ms"] - prior.get("step_ms", 0.0)) / steps if steps > 0 else None


def replica_families(
    wcs: dict | None,
    routing: RoutingStats | None,
    aborted: int | None = None,
    cpu: dict[str, float] | None = None,
    engine: LatestSchedulerStats | None = None,
    step_ms: float | None = None,
) -> list[Metric]:
    """WCS counters (`replicas/wcs/stats.py`), the routing stats, the replica's aborts, its processes' CPU
    time (`process_cpu_seconds`), the engine's exact inter-token latency totals and the measured step time
    (`measured_step_ms`) as Prometheus families."""
    out: list[Metric] = []
    if cpu is not None:
        fam = CounterMetricFamily("forespark_replica_cpu_seconds", "CPU time of the replica's processes", labels=["process"])
        for process, seconds in sorted(cpu.items()):
            fam.add_metric([process], seconds)
        out.append(fam)
    if aborted is not None:
        # vLLM's request_success{finished_reason="abort"} does not count requests aborted by the caller.
        out.append(CounterMetricFamily("forespark_engine_aborted_requests", "streams aborted in the engine because the caller went away", value=aborted))
    if engine is not None:
        out.append(CounterMetricFamily("forespark_engine_inter_token_latency_seconds", "sum of vLLM's inter-token latencies (exact)", value=engine.decode_s))
        out.append(CounterMetricFamily("forespark_engine_inter_token_latency_observations", "number of vLLM's inter-token latencies", value=engine.decode_outputs))
    if wcs is not None:
        for name, doc in (
            ("drafted", "requests that drafted position j"),
            ("verified", "requests whose draft position j was verified"),
            ("accepted", "requests whose first j drafts were accepted"),
        ):
            fam = CounterMetricFamily(f"forespark_wcs_{name}_tokens", f"WCS: {doc}", labels=["position"])
            for j, v in enumerate(wcs[f"{name}_per_pos"]):
                fam.add_metric([str(j + 1)], v)
            out.append(fam)
        drafted, verified = sum(wcs["drafted_per_pos"]), sum(wcs["verified_per_pos"])
        accepted = sum(wcs["accepted_per_pos"])
        out.append(GaugeMetricFamily("forespark_wcs_draft_waste", "drafted tokens never verified / drafted", value=(drafted - verified) / drafted if drafted else 0.0))
        out.append(GaugeMetricFamily("forespark_wcs_acceptance_rate", "accepted / verified draft tokens", value=accepted / verified if verified else 0.0))
        out.append(GaugeMetricFamily("forespark_wcs_mean_accepted_length", "1 + accepted drafts per verifying step", value=1.0 + accepted / wcs["verify_steps"] if wcs["verify_steps"] else 1.0))
        for name in ("planner", "draft", "target", "step"):
            out.append(CounterMetricFamily(f"forespark_wcs_{name}_seconds", f"WCS: time in {name}", value=wcs[f"{name}_ms"] / 1000.0))
        out.append(CounterMetricFamily("forespark_wcs_steps", "steps that planned at least one request", value=wcs["steps"]))
        out.append(CounterMetricFamily("forespark_wcs_held_steps", "steps that kept the last plan's 'no drafts' without planning", value=wcs.get("held_steps", 0)))
        out.append(GaugeMetricFamily("forespark_wcs_step_cost_offset_ms", "what measured step periods add to the profiled step intercept (ms)", value=wcs.get("step_cost_offset_ms", 0.0)))
        out.append(GaugeMetricFamily("forespark_wcs_launch_offset_ms", "what measured step periods add to the profiled drafter launch cost (ms)", value=wcs.get("launch_offset_ms", 0.0)))
        out.append(GaugeMetricFamily("forespark_wcs_policy_info", "the speculation policy", labels=["policy"]))
        out[-1].add_metric([wcs["policy"]], 1.0)
    if step_ms is not None:
        out.append(GaugeMetricFamily("forespark_replica_measured_step_ms", "measured mean step time over the last stats period (ms)", value=step_ms))
    if routing is not None:
        for name, doc in (
            ("headroom_tokens", "target tokens per step that still fit under the TPOT-SLO step cap"),
            ("step_ms", "predicted step time of the running batch (ms)"),
            ("cap_ms", "step-time cap from the TPOT SLO (ms)"),
            ("predicted_accept_len", "predicted mean accepted length of the running batch"),
            ("tokens_per_step", "tokens per request per step over the last period"),
            ("realised_tpot_ms", "measured ms per decoded token over the last period"),
        ):
            value = getattr(routing, name)
            if value is not None:
                out.append(GaugeMetricFamily(f"forespark_replica_{name}", doc, value=value))
    return out


class RayExport:
    """Exports Prometheus families through `ray.serve.metrics`, one Ray metric per family, created on first sight.

    Families carry cumulative totals; Ray counters take increments, so each export adds what a total gained
    since the last one (a total that fell, as after an engine restart, counts on from its new value). A
    counter series is exported from its first sight, at 0 until it gains: `rate()` then reads 0, not "no
    data". Gauges are set every export: Ray drops a gauge that was not set for two export intervals.
    Inside a Serve replica, Serve tags every series with its deployment, replica and application.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._totals: dict[tuple[str, tuple[str, ...]], float] = {}

    def _metric(self, fam: Metric, keys: tuple[str, ...]) -> Any | None:
        known = self._metrics.get(fam.name)
        if known is None:
            from ray.serve import metrics

            cls = metrics.Counter if fam.type == "counter" else metrics.Gauge
            known = self._metrics[fam.name] = (cls(fam.name, fam.documentation, tag_keys=keys or None), keys)
        if known[1] != keys:
            logger.warning("metric %s: labels %s, exported first with %s; sample dropped", fam.name, keys, known[1])
            return None
        return known[0]

    def export(self, families: Iterable[Metric]) -> None:
        for fam in families:
            if fam.type not in ("counter", "gauge"):
                continue
            for s in fam.samples:
                if fam.type == "counter" and not s.name.endswith("_total"):
                    continue
                keys = tuple(sorted(s.labels))
                metric = self._metric(fam, keys)
                if metric is None:
                    continue
                tags = {k: str(s.labels[k]) for k in keys} or None
                value = float(s.value)
                if fam.type == "gauge":
                    metric.set(value, tags=tags)
                    continue
                key = (fam.name, tuple(s.labels[k] for k in keys))
                last = self._totals.get(key)
                if last is None:
                    metric._record(0.0, tags=tags)  # `inc` refuses 0; Ray is pinned (pyproject.toml)
                    last = 0.0
                gained = value - last
                if gained > 0:
                    metric.inc(gained, tags=tags)
                self._totals[key] = value


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self):
        return self.families


def render(families: Iterable[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def replica_metrics_text(
    wcs: dict | None, routing: RoutingStats | None, aborted: int | None = None, cpu: dict[str, float] | None = None
) -> str:
    """This process's registry (vLLM's metrics) followed by the replica's own families."""
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY).decode() + render(replica_families(wcs, routing, aborted, cpu))
