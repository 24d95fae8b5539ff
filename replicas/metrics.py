"""Prometheus metrics of a replica: vLLM's own, plus WCS's, merged across replicas for one `/metrics`.

Each replica renders its process's registry (vLLM's `PrometheusStatLogger`
registers there) and the WCS families below, and posts the text to the
`MetricsBoard` actor every stats period. The HTTP ingress serves the board's
texts merged, each series labelled with its `replica`, next to its own
process's series (the router's).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from replicas.routing_stats import RoutingStats

BOARD_NAME = "forespark-metrics-board"
BOARD_NAMESPACE = "forespark"


class LatestSchedulerStats:
    """A vLLM per-engine stat logger that keeps the last scheduler stats (waiting requests, KV use) and totals
    the engine's realised decoding: seconds between a request's outputs (`decode_s`) and the tokens those
    outputs carried (`decode_tokens`; every generated token but each request's first)."""

    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
        self.waiting = 0
        self.kv_usage = 0.0
        self.decode_s = 0.0
        self.decode_tokens = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.decode_s += sum(iteration_stats.inter_token_latencies_iter)
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


def replica_families(
    wcs: dict | None, routing: RoutingStats | None, aborted: int | None = None, cpu: dict[str, float] | None = None
) -> list[Metric]:
    """WCS counters (`replicas/wcs/stats.py`), the routing stats, the replica's aborts and its processes' CPU
    time (`process_cpu_seconds`) as Prometheus families."""
    out: list[Metric] = []
    if cpu is not None:
        fam = CounterMetricFamily("forespark_replica_cpu_seconds", "CPU time of the replica's processes", labels=["process"])
        for process, seconds in sorted(cpu.items()):
            fam.add_metric([process], seconds)
        out.append(fam)
    if aborted is not None:
        # vLLM's request_success{finished_reason="abort"} does not count requests aborted by the caller.
        out.append(CounterMetricFamily("forespark_engine_aborted_requests", "streams aborted in the engine because the caller went away", value=aborted))
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
    if routing is not None:
        for name, doc in (
            ("headroom_tokens", "target tokens per step that still fit under the TPOT-SLO step cap"),
            ("step_ms", "predicted step time of the running batch (ms)"),
            ("cap_ms", "step-time cap from the TPOT SLO (ms)"),
            ("predicted_accept_len", "predicted mean accepted length of the running batch"),
            ("tokens_per_step", "tokens per request per step over the last period"),
        ):
            value = getattr(routing, name)
            if value is not None:
                out.append(GaugeMetricFamily(f"forespark_replica_{name}", doc, value=value))
    return out


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


def merge_metrics(texts: dict[str, str]) -> str:
    """One exposition from several replicas' texts: series gain a `replica` label; families are merged by name."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                into.samples.append(type(s)(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar))
    return render(merged.values())


class MetricsBoard:
    """Latest metrics text per replica (a Ray actor: replicas post, the ingress reads)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.time(), text)

    def texts(self, max_age_s: float = 60.0) -> dict[str, str]:
        """Texts posted within `max_age_s` (a dead replica's last text ages out)."""
        now = time.time()
        self._texts = {k: v for k, v in self._texts.items() if now - v[0] <= max_age_s}
        return {k: text for k, (_, text) in self._texts.items()}


def metrics_board():
    """The cluster's board actor, created by whoever asks first.

    Detached: a named actor owned by the replica or ingress that happened to create it would die
    with its owner's last handle, and every other poster would go on posting into a dead actor.
    Stale texts age out on read; `remove_metrics_board` takes it down with the application.
    """
    import ray

    return (
        ray.remote(num_cpus=0)(MetricsBoard)
        .options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached")
        .remote()
    )


def remove_metrics_board() -> None:
    import ray

    try:
        ray.kill(ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE))
    except ValueError:  # never created
        pass
