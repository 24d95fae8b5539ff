"""Metrics the Ray way: the dashboard's queries against what the running application exports.

The pure parts first (PromQL metric names, the exposition text, the offline
dashboard check, the replica's and the router's export into Ray metrics with
stand-ins for `ray.serve.metrics`); then one `forespark serve` for the module,
scraped at its Ray metrics agent: every series the Grafana dashboard queries is
exported, and a replica's WCS counters arrive after a served request.
"""

from __future__ import annotations

import copy
import socket
import time

import httpx
import pytest

from cluster.dashboard import (
    check_dashboard,
    dashboard_queries,
    exported_names,
    filter_series,
    load_dashboard,
    missing_metrics,
    query_metric_names,
)

EXPOSITION = """\
# HELP ray_forespark_wcs_steps_total steps that planned at least one request
# TYPE ray_forespark_wcs_steps_total counter
ray_forespark_wcs_steps_total{Component="core_worker",replica="r1",deployment="EngineReplica"} 48.0
# TYPE ray_vllm_time_to_first_token_seconds histogram
ray_vllm_time_to_first_token_seconds_bucket{ReplicaId="r1",le="0.1"} 2.0
ray_vllm_time_to_first_token_seconds_bucket{ReplicaId="r1",le="+Inf"} 3.0
ray_vllm_time_to_first_token_seconds_sum{ReplicaId="r1"} 0.4
ray_vllm_time_to_first_token_seconds_count{ReplicaId="r1"} 3.0
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{NodeAddress="10.0.0.1"} 12.5
"""


@pytest.mark.parametrize(
    "expr, names",
    [
        ("ray_forespark_replica_headroom_tokens", {"ray_forespark_replica_headroom_tokens"}),
        (
            'sum by (replica, position) (rate(ray_forespark_wcs_accepted_tokens_total{replica=~"$replica",position="1"}[$__rate_interval]))'
            " / sum by (replica, position) (rate(ray_forespark_wcs_verified_tokens_total[5m]))",
            {"ray_forespark_wcs_accepted_tokens_total", "ray_forespark_wcs_verified_tokens_total"},
        ),
        (
            'histogram_quantile(0.99, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket{model_name="a,b(c)"}[1m])))',
            {"ray_vllm_time_to_first_token_seconds_bucket"},
        ),
        ("1 - sum(rate(a_total[1m] offset 5m)) / on(replica) group_left(policy) b > bool 1e-3", {"a_total", "b"}),
        ("sum(x) without (WorkerId) and ignoring(le) y unless z", {"x", "y", "z"}),
        ('label_values(ray_forespark_replica_tokens_per_step{ray_io_cluster=~"$Cluster"}, replica)', {"ray_forespark_replica_tokens_per_step"}),
        ("label_values(replica)", set()),
        ("query_result(topk(3, ray_vllm_num_requests_running))", {"ray_vllm_num_requests_running"}),
    ],
)
def test_query_metric_names_are_the_metrics_a_promql_expression_reads(expr, names):
    assert query_metric_names(expr) == names


def test_exported_names_are_the_sample_names_and_missing_metrics_names_what_a_scrape_lacks():
    assert exported_names(EXPOSITION) == {
        "ray_forespark_wcs_steps_total", "ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_time_to_first_token_seconds_sum",
        "ray_vllm_time_to_first_token_seconds_count", "ray_node_cpu_utilization",
    }
    present = ["rate(ray_forespark_wcs_steps_total[1m])", "histogram_quantile(0.5, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket[1m])))"]
    assert missing_metrics(present, EXPOSITION) == {}
    # Negative control: the same checker names a metric that is not exported, and only that one.
    absent = "rate(ray_forespark_wcs_steps_total[1m]) / rate(ray_forespark_no_such_series_total[1m])"
    assert missing_metrics([*present, absent], EXPOSITION) == {absent: ["ray_forespark_no_such_series_total"]}
    # A family's name is not a sample's: a counter is scraped with `_total`, a histogram by its buckets.
    assert missing_metrics(["ray_vllm_time_to_first_token_seconds"], EXPOSITION) == {
        "ray_vllm_time_to_first_token_seconds": ["ray_vllm_time_to_first_token_seconds"]
    }


def test_filter_series_keeps_foresparks_and_vllms_families_with_their_help_and_type():
    kept = filter_series(EXPOSITION)
    assert exported_names(kept) == exported_names(EXPOSITION) - {"ray_node_cpu_utilization"}
    assert "# TYPE ray_vllm_time_to_first_token_seconds histogram" in kept and "ray_node" not in kept


def test_the_shipped_dashboard_passes_the_offline_check_and_a_planted_fault_of_each_kind_fails():
    dashboard = load_dashboard()
    assert check_dashboard(dashboard) >= 30
    titles = " | ".join(p.get("title", "") for p in dashboard["panels"]).lower()
    for topic in ("acceptance per draft position", "draft waste", "tokens per request-step", "headroom", "predicted vs measured",
                  "planner", "router decisions", "router fallbacks", "ttft", "tpot", "per replica"):
        assert topic in titles, topic
    names = set().union(*(query_metric_names(q) for q in dashboard_queries(dashboard)))
    assert {"ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_request_time_per_output_token_seconds_bucket",
            "ray_forespark_router_decisions_total", "ray_forespark_replica_measured_step_ms"} <= names

    def planted(change):
        d = copy.deepcopy(dashboard)
        change(next(p for p in d["panels"] if p["type"] != "row"))
        return d

    faults = {
        "foreign": planted(lambda p: p["targets"][0].update(expr="rate(node_cpu_seconds_total[1m])")),
        "unbalanced": planted(lambda p: p["targets"][0].update(expr="sum(rate(ray_forespark_wcs_steps_total[1m])")),
        "no query": planted(lambda p: p.update(targets=[])),
        "fixed datasource": planted(lambda p: p.update(datasource={"type": "prometheus", "uid": "prom-1"})),
    }
    caught = []
    for kind, d in faults.items():
        try:
            check_dashboard(d)
        except ValueError:
            caught.append(kind)
    assert caught == list(faults)


class FakeMetric:
    """Stands in for a `ray.serve.metrics` Counter or Gauge: records what it was given."""

    made: dict[str, FakeMetric] = {}

    def __init__(self, name, description="", tag_keys=None, boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tag_keys, boundaries
        self.calls: list[tuple[str, float, dict | None]] = []
        FakeMetric.made[name] = self

    def _record(self, value, tags=None):
        self.calls.append(("record", value, tags))

    def inc(self, value=1.0, tags=None):
        assert value > 0  # as Ray's Counter insists
        self.calls.append(("inc", value, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def observe(self, value, tags=None):
        self.calls.append(("observe", value, tags))


@pytest.fixture
def fake_ray_metrics(monkeypatch):
    import ray.serve.metrics

    FakeMetric.made = {}
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray.serve.metrics, cls, FakeMetric)
    return FakeMetric.made


WCS = {
    "policy": "wcs", "k": 2, "steps": 3, "held_steps": 1, "planned_requests": 4, "drafted_per_pos": [4, 2], "verified_per_pos": [3, 0],
    "accepted_per_pos": [2, 0], "verify_steps": 3, "drafter_passes": 3, "drafter_rows": 9,
    "planner_ms": 1.0, "draft_ms": 2.0, "target_ms": 3.0, "step_ms": 8.0,
}


def test_the_replicas_families_reach_ray_counters_by_increment_from_zero_and_gauges_by_value(fake_ray_metrics):
    from replicas.metrics import RayExport, measured_step_ms, replica_families

    export = RayExport()
    export.export(replica_families(WCS, None, aborted=0, cpu={"engine": 7.5, "replica": 2.0}, step_ms=measured_step_ms(WCS, None)))
    verified = fake_ray_metrics["forespark_wcs_verified_tokens"]
    assert verified.tag_keys == ("position",)
    # Every series exists from its first export, at 0 until it gains (position 2 was never verified).
    assert verified.calls == [("record", 0.0, {"position": "1"}), ("inc", 3.0, {"position": "1"}), ("record", 0.0, {"position": "2"})]
    assert fake_ray_metrics["forespark_engine_aborted_requests"].calls == [("record", 0.0, None)]
    assert fake_ray_metrics["forespark_wcs_draft_waste"].calls == [("set", 0.5, None)]  # 3 of 6 drafts never verified
    assert fake_ray_metrics["forespark_replica_measured_step_ms"].calls == [("set", 2.0, None)]  # 8 ms over 3 + 1 steps
    assert fake_ray_metrics["forespark_replica_cpu_seconds"].tag_keys == ("process",)

    # The next export adds what each total gained; one that did not gain adds nothing; a gauge is set again.
    later = {**WCS, "verified_per_pos": [5, 1], "steps": 5}
    export.export(replica_families(later, None, aborted=0))
    assert verified.calls[3:] == [("inc", 2.0, {"position": "1"}), ("inc", 1.0, {"position": "2"})]
    assert fake_ray_metrics["forespark_wcs_steps"].calls == [("record", 0.0, None), ("inc", 3.0, None), ("inc", 2.0, None)]
    assert fake_ray_metrics["forespark_engine_aborted_requests"].calls == [("record", 0.0, None)]
    assert len(fake_ray_metrics["forespark_wcs_draft_waste"].calls) == 2
    # A total that fell (the engine restarted in this process) counts on from its new value.
    export.export(replica_families({**later, "steps": 1}, None))
    export.export(replica_families({**later, "steps": 4}, None))
    assert fake_ray_metrics["forespark_wcs_steps"].calls[3:] == [("inc", 3.0, None)]


def test_measured_step_time_is_step_time_over_planned_and_held_steps_between_snapshots():
    from replicas.metrics import measured_step_ms

    later = {**WCS, "steps": 7, "held_steps": 3, "step_ms": 20.0}
    assert measured_step_ms(later, WCS) == pytest.approx(12.0 / 6)
    assert measured_step_ms(WCS, WCS) is None and measured_step_ms(None, WCS) is None


def test_router_families_make_their_ray_metric_on_first_use_with_prometheus_clients_labels_form(fake_ray_metrics):
    from cluster.router_metrics import _Family

    family = _Family("counter", "forespark_test_decisions", "doc", ("router", "mode"))
    child = family.labels("acceptance_headroom", "ranked")
    assert fake_ray_metrics == {}  # created in use (in a replica, after Serve set the context its tags come from)
    child.inc()
    child.inc(0)
    assert fake_ray_metrics["forespark_test_decisions"].calls == [("inc", 1.0, {"router": "acceptance_headroom", "mode": "ranked"})]
    timer = _Family("histogram", "forespark_test_seconds", "doc", ("router",), buckets=(1e-4, 1e-3)).labels("r")
    timer.observe(5e-4)
    assert fake_ray_metrics["forespark_test_seconds"].boundaries == [1e-4, 1e-3]
    with pytest.raises(ValueError):
        family.labels("only-one")


# --- the running application -------------------------------------------------------------------------------

PORT = 8768


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`forespark serve`: one engine replica, its local Ray's metrics agent on a port of our choosing.
    Yields that agent's URL."""
    from tests.test_serve_cli import forespark_serve

    config = tmp_path_factory.mktemp("metrics") / "serve.yaml"
    config.write_text("replica:\n  num_replicas: 1\n  num_cpus: 1\n  stats_period_s: 0.5\n")
    agent = _free_port()
    first = {"model": "forespark", "prompt": "def f(x):", "max_tokens": 8}
    with forespark_serve(config, PORT, first, args=("--metrics-export-port", str(agent))) as (proc, _):
        yield f"http://127.0.0.1:{agent}/metrics"
    assert f":{agent}/metrics" in proc.output  # the CLI said where its metrics are


def _complete(max_tokens: int, stream: bool = False) -> None:
    body = {"model": "forespark", "prompt": "import os\n", "max_tokens": max_tokens, "stream": stream}
    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def _poll(read, done, timeout_s: float = 60.0):
    """`read()` until `done(value)`: Ray exports every 2 s under `forespark serve`."""
    deadline = time.time() + timeout_s
    while True:
        value = read()
        if done(value) or time.time() > deadline:
            return value
        time.sleep(1.0)


def test_every_series_the_dashboard_queries_is_exported_by_the_running_app(served):
    _complete(16)
    _complete(16, stream=True)
    queries = dashboard_queries(load_dashboard())

    def scrape():
        return httpx.get(served, timeout=30).text

    text = _poll(scrape, lambda t: not missing_metrics(queries, t))
    assert missing_metrics(queries, text) == {}
    # Negative control: the same checker, on the same scrape, reports a query of a series nobody exports.
    typo = "sum(rate(ray_forespark_wcs_acepted_tokens_total[1m]))"
    assert missing_metrics([*queries, typo], text) == {typo: ["ray_forespark_wcs_acepted_tokens_total"]}
    # The ingress's /metrics passes on this node's ForeSpark and vLLM series, not Ray's own.
    local = httpx.get(f"http://127.0.0.1:{PORT}/metrics", timeout=30).text
    assert "ray_forespark_wcs_steps_total" in local and "ray_vllm_request_success_total" in local
    assert "ray_serve_" not in local and "ray_node_" not in local


def _series(text: str, name: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def test_a_replicas_wcs_counters_reach_rays_metrics_endpoint_after_a_served_request(served):
    def steps() -> float:
        return sum(s.value for s in _series(httpx.get(served, timeout=30).text, "ray_forespark_wcs_steps_total"))

    _poll(steps, lambda v: v > 0)
    time.sleep(3.0)  # the last export of earlier requests has landed
    before = steps()
    _complete(24)
    after = _poll(steps, lambda v: v > before)
    assert after > before
    text = httpx.get(served, timeout=30).text
    (step_s,) = _series(text, "ray_forespark_wcs_step_seconds_total")
    assert step_s.value > 0
    # Serve tagged the replica's series; vLLM's carry the same replica id.
    assert step_s.labels["deployment"] == "EngineReplica" and step_s.labels["application"] == "forespark"
    vllm = {s.labels["ReplicaId"] for s in _series(text, "ray_vllm_request_success_total")}
    assert vllm == {step_s.labels["replica"]}
    positions = {s.labels["position"] for s in _series(text, "ray_forespark_wcs_verified_tokens_total")}
    assert positions == {str(j) for j in range(1, len(positions) + 1)} and len(positions) >= 2
