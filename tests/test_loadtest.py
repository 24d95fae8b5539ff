"""Load tests: the capacity search on a known threshold, and real Locust runs against a real `forespark serve`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from scipy import stats

from loadtest.capacity import search
from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.report import LoadTestReport, Percentiles, build_report, read_rows
from loadtest.run import free_port, rebuild_report


def _fake_measure(capacity: float, calls: list[float]):
    """A measurement whose outcome is known: sustainable exactly up to `capacity` (not a server; tests the search only)."""

    def measure(rate: float) -> LoadTestReport:
        calls.append(rate)
        return LoadTestReport.model_construct(
            attainment=1.0 if rate <= capacity else 0.5, goodput_rps=rate, requests=10, sustainable=rate <= capacity,
            offered_rate_rps=rate, arrival_lag_ms=Percentiles(p50=0.0, p90=0.0, p99=0.0, mean=0.0),
        )

    return measure


@pytest.mark.parametrize("capacity", [0.3, 5.3, 1000.0])
def test_capacity_search_doubles_then_bisects_to_the_threshold(capacity):
    calls: list[float] = []
    result = search(_fake_measure(capacity, calls), SLOConfig(), start_rate=1.0, bisect_steps=4, max_doublings=6)
    assert result.max_rate <= capacity
    if capacity < 64:
        passes = [r for r in calls if r <= capacity]
        fails = [r for r in calls if r > capacity]
        assert min(fails) - max(passes) <= max(passes) / 2 ** 4 + 1e-9  # bisection narrowed the bracket
        assert result.max_rate == max(passes)
    else:  # never failed: stops at the last doubling
        assert result.max_rate == 64.0 and calls == [1, 2, 4, 8, 16, 32, 64]
    assert [p.rate for p in result.path] == calls


def test_the_crossing_rate_interpolates_attainment_between_the_last_pass_and_first_fail():
    """Attainment falling linearly from 10 req/s crosses 90% at exactly 12.5 req/s; the bisection's max rate
    is only as fine as its last bracket (here 12), the interpolated crossing finds 12.5."""

    def measure(rate: float) -> LoadTestReport:
        attainment = float(np.clip(1.0 - 0.04 * (rate - 10.0), 0.0, 1.0))
        return LoadTestReport.model_construct(
            attainment=attainment, goodput_rps=rate, requests=10, sustainable=attainment >= 0.9, offered_rate_rps=rate,
            arrival_lag_ms=Percentiles(p50=0.0, p90=0.0, p99=0.0, mean=0.0),
        )

    result = search(measure, SLOConfig(), start_rate=1.0, bisect_steps=3)
    assert result.max_rate == 12.0 and result.crossing_rate == pytest.approx(12.5)
    assert search(_fake_measure(1000.0, []), SLOConfig(), max_doublings=3).crossing_rate == 8.0  # nothing failed above: a bound
    assert search(_fake_measure(0.0, []), SLOConfig(), min_rate=0.5).crossing_rate == 0.0


def test_capacity_search_reports_zero_when_nothing_passes():
    calls: list[float] = []
    result = search(_fake_measure(0.0, calls), SLOConfig(), start_rate=1.0, min_rate=0.1)
    assert result.max_rate == 0.0 and all(not p.sustainable for p in result.path) and min(calls) >= 0.1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `forespark serve`: two engine replicas, real Ray Serve, real HTTP."""
    from loadtest.compare import ServerProcess

    work = tmp_path_factory.mktemp("server")
    # Serve's power of two (no admission): the test compares the report with the server's own counters per
    # replica, which needs every request served and both replicas used. On a slow host admission refused part
    # of this light load, and the acceptance router sent all of it to the replica whose start-up profile was
    # taken while the other one started beside it (tests/test_router.py, tests/test_overload.py cover those).
    app = {"replica": {"num_replicas": 2, "num_cpus": 0.5, "served_model_name": "forespark"}, "router": {"kind": "pow2"}}
    with ServerProcess(app, free_port(), work) as srv:
        yield srv


def _successes(url: str) -> float:
    """The server's own count of completed requests: vLLM's request_success counter (finished by stop or
    length, not abort) summed over the replicas, as the node's Ray metrics agent exports it."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "ray_vllm_request_success_total" and s.labels.get("finished_reason") in ("stop", "length")
    )


def _settled_successes(url: str) -> float:
    """Ray exports metrics every 2 s under `forespark serve`: read until two reads more than that apart agree."""
    last = _successes(url)
    for _ in range(10):
        time.sleep(2.5)
        now = _successes(url)
        if now == last:
            return now
        last = now
    return last


def _inter_arrivals(rows) -> np.ndarray:
    return np.diff(np.sort([r.start_s for r in rows]))


def test_a_real_locust_run_agrees_with_the_server_and_paces_poisson_arrivals(server, tmp_path):
    """`forespark loadtest` (Locust in 2 processes) against the real server, with an impossibly tight SLO."""
    rate, duration = 6.0, 25.0
    before = _settled_successes(server.url)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "loadtest", "--url", server.url, "--rate", str(rate), "--duration", str(duration),
         "--max-tokens", "4", "--processes", "2", "--ttft-ms", "0.001", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 10_000
    rows = read_rows(out)
    assert len(list(out.glob("requests-*.csv"))) == 2  # both Locust worker processes sent requests
    assert report["requests"] == len(rows) and abs(len(rows) - rate * duration) < 4 * np.sqrt(rate * duration)

    # The server's own counter agrees with the client's rows (all requests drained before Locust exited).
    ok = [r for r in rows if r.ok]
    assert len(ok) >= 0.95 * len(rows)
    assert _settled_successes(server.url) - before == len(ok)
    # The report's per-replica account, from the server's own metrics, covers the same requests on both replicas.
    replicas = report["replicas"]
    assert len(replicas) == 2 and sum(r["requests"] for r in replicas.values()) == len(ok)
    assert all(r["requests"] > 0 and r["itl_ms"] > 0 for r in replicas.values())
    # ... and what their processes spent on them: the engine core most of it, the replica actor the rest.
    assert all(r["cpu_ms_per_request"] > 0 and 0.0 < r["engine_cpu_share"] < 1.0 for r in replicas.values())
    assert all(r.ttft_ms <= r.e2e_ms and r.first_token_s <= r.end_s and r.output_tokens == 4 for r in ok)

    # Impossibly tight TTFT: nobody meets it. The same rows against loose SLOs: everybody does.
    assert report["attainment"] == 0.0 and report["sustainable"] is False and report["goodput_rps"] == 0.0
    loose = build_report(rows, SLOConfig(ttft_ms=1e9, tpot_ms=1e9, e2e_ms=1e9), rate, duration)
    assert loose.attainment == len(ok) / len(rows) and loose.met_slo == len(ok)
    # What `compare --tpot-sweep` re-evaluates: the finished run's own rows, read back, against any SLO.
    run = LoadTestConfig(url=server.url, rate=rate, duration_s=duration, out_dir=out)
    assert rebuild_report(run, SLOConfig.model_validate(report["slo"])).model_dump(mode="json", exclude={"replicas"}) == {
        k: v for k, v in report.items() if k != "replicas"}
    assert rebuild_report(run, SLOConfig(ttft_ms=1e9, tpot_ms=1e9, e2e_ms=1e9)).met_slo == len(ok)

    # No request left before its planned arrival (1 ms for the clock), and each one's lateness is recorded and summarised.
    assert all(r.start_s >= r.scheduled_s - 0.001 and abs((r.start_s - r.scheduled_s) * 1000 - r.lag_ms) < 1.0 for r in rows)
    assert report["arrival_lag_ms"]["p50"] == pytest.approx(float(np.median([r.lag_ms for r in rows])))

    # Open-loop Poisson pacing: the inter-arrival times fit Exp(rate).
    gaps = _inter_arrivals(rows)
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01


def test_a_closed_loop_run_at_the_same_mean_rate_is_not_poisson(server, tmp_path):
    """Negative control for the pacing test: Locust's classic closed loop (constant_throughput users)."""
    from loadtest.run import run_locust

    rate, duration = 6.0, 20.0
    config = LoadTestConfig(url=server.url, rate=rate, duration_s=duration, arrivals="closed", users=2, max_tokens=4, out_dir=tmp_path)
    rows = run_locust(config, progress=False)
    assert len(rows) > 0.7 * rate * duration
    assert stats.kstest(_inter_arrivals(rows), "expon", args=(0, 1 / rate)).pvalue < 0.01


def _schedule(rows) -> tuple[np.ndarray, list[str]]:
    """Planned arrival times relative to the first, and the domains in that order."""
    rows = sorted(rows, key=lambda r: r.scheduled_s)
    return np.array([r.scheduled_s - rows[0].scheduled_s for r in rows]), [r.domain for r in rows]


def test_the_same_seed_sends_the_same_load_and_another_seed_does_not(server, tmp_path):
    """Common random numbers for A/B runs: a seed fixes the arrival schedule and the prompt mix, whatever the
    process ids; the negative control is a second seed."""
    from loadtest.run import run_locust

    def run(seed: int, name: str):
        config = LoadTestConfig(url=server.url, rate=4.0, duration_s=8.0, max_tokens=4, seed=seed, out_dir=tmp_path / name)
        return _schedule(run_locust(config, progress=False))

    (t_a, d_a), (t_b, d_b), (t_c, _) = run(0, "a"), run(0, "b"), run(1, "c")
    assert len(t_a) >= 10
    assert len(t_a) == len(t_b) and np.abs(t_a - t_b).max() < 0.001 and d_a == d_b
    assert len(t_c) != len(t_a) or np.abs(t_c - t_a).max() > 0.5


def _tree_cpu_s(pid: int) -> float:
    from replicas.metrics import process_cpu_seconds

    return sum(process_cpu_seconds(pid).values())


def test_a_paused_server_takes_no_cpu_and_serves_again_once_resumed(server):
    """What `compare --protocol interleaved` does between a server's probes, on the real server. The negative
    control is the same server running: idle, its Ray processes and replicas still spend CPU."""
    body = {"model": "forespark", "prompt": "def main():", "max_tokens": 4}
    running = _tree_cpu_s(server.proc.pid)
    time.sleep(3)
    assert _tree_cpu_s(server.proc.pid) - running > 0.05
    server.pause()
    try:
        paused = _tree_cpu_s(server.proc.pid)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=3)
        assert _tree_cpu_s(server.proc.pid) - paused < 0.01
    finally:
        server.resume()
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


class _StandInServer:
    """Stands in for a server in `compare`'s own logic (a real compare is a benchmark of many minutes; the real
    server, load test and pause are tested above): records what happens to it in a shared event list."""

    def __init__(self, name: str, events: list) -> None:
        self.url, self.name, self.events, self.paused = f"http://stand-in/{name}", name, events, False

    def pause(self) -> None:
        assert not self.paused
        self.paused = True
        self.events.append(("pause", self.name))

    def resume(self) -> None:
        assert self.paused
        self.paused = False
        self.events.append(("resume", self.name))


def _stand_ins(capacities: dict[str, list[float]], events: list):
    """A server starter, a measurement and a re-evaluation: variant `name` sustains up to capacities[name][repeat]
    against the TPOT SLO of 37 ms, and proportionally more against a looser one."""
    from contextlib import contextmanager

    served = {("wcs", "acceptance_headroom"): "wcs", ("dspark", "acceptance_headroom"): "dspark", ("wcs", "pow2"): "wcs-pow2"}
    servers: dict[str, _StandInServer] = {}

    @contextmanager
    def start_server(app_config, work):
        name = served[(app_config["replica"]["engine"]["wcs"]["policy"], app_config["router"]["kind"])]
        assert app_config["replica"]["num_replicas"] == 3  # the base config is kept
        assert app_config["replica"]["tpot_slo_ms"] == 37.0  # the replicas' headroom uses the load test's TPOT SLO
        events.append(("start", name))
        servers[name] = _StandInServer(name, events)
        yield servers[name]
        events.append(("stop", name))

    def measure(load, slo):
        name = load.url.rsplit("/", 1)[1]
        assert not servers[name].paused  # never measure a paused server
        if load.out_dir.name == "warm-up":
            events.append(("warm", name, load.rate, load.duration_s))
            return LoadTestReport.model_construct(attainment=0.5)
        rep = int(load.out_dir.parent.name.split("-")[1])
        events.append(("probe", name, load.rate, slo.tpot_ms, rep))
        return _fake_measure(capacities[name][rep] * slo.tpot_ms / 37.0, [])(load.rate)

    def evaluate(load, slo):
        name, rep = load.url.rsplit("/", 1)[1], int(load.out_dir.parent.name.split("-")[1])
        events.append(("evaluate", name, rep, load.rate, slo.tpot_ms))
        return _fake_measure(capacities[name][rep] * slo.tpot_ms / 37.0, [])(load.rate)

    return start_server, measure, evaluate


CAPACITIES = {"wcs": [6.0, 9.0, 7.0], "dspark": [4.0, 5.0, 3.0], "wcs-pow2": [7.0, 2.0, 5.0]}


def _compare(tmp_path, events, protocol, repeats=3, warmup_s=7.0, variants=("wcs", "dspark", "wcs-pow2"), tpot_sweep_ms=()):
    from loadtest.compare import compare

    start_server, measure, evaluate = _stand_ins(CAPACITIES, events)
    base = LoadTestConfig(url="http://unused", rate=1.0, duration_s=1.0, out_dir=tmp_path)
    return compare(
        base, SLOConfig(tpot_ms=37.0), list(variants), {"replica": {"num_replicas": 3, "tpot_slo_ms": 50}}, start_server, 1.5,
        bisect_steps=2, repeats=repeats, log=lambda _: None, measure=measure, warmup_s=warmup_s, protocol=protocol, settle_s=0.0,
        tpot_sweep_ms=tpot_sweep_ms, evaluate=evaluate,
    )


@pytest.mark.parametrize("protocol", ["sequential", "interleaved"])
def test_compare_reports_each_variants_median_rate_and_ratios_of_medians(tmp_path, protocol):
    events: list = []
    result = _compare(tmp_path, events, protocol)
    assert result.protocol == protocol
    # Each search is the plain capacity search on that variant's stand-in, whatever the order of probes.
    for name, caps in CAPACITIES.items():
        assert result.variants[name].max_rates == [
            search(_fake_measure(c, []), SLOConfig(), start_rate=1.5, bisect_steps=2).max_rate for c in caps
        ]
    for name, caps in CAPACITIES.items():
        assert result.variants[name].crossing_rates == [
            search(_fake_measure(c, []), SLOConfig(), start_rate=1.5, bisect_steps=2).crossing_rate for c in caps
        ]
        assert result.variants[name].crossing_rate == float(np.median(result.variants[name].crossing_rates))
    crossing = {name: v.crossing_rate for name, v in result.variants.items()}
    assert result.crossing_ratios["wcs_vs_dspark"] == pytest.approx(crossing["wcs"] / crossing["dspark"])
    rates = {name: v.max_rate for name, v in result.variants.items()}
    assert rates == {name: float(np.median(v.max_rates)) for name, v in result.variants.items()}
    assert result.ratios["wcs_vs_dspark"] == pytest.approx(rates["wcs"] / rates["dspark"])
    assert result.ratios["router_vs_pow2"] == pytest.approx(rates["wcs"] / rates["wcs-pow2"])
    assert result.ratios["wcs_vs_ar"] is None  # ar was not run
    # Every fresh server is warmed once, at the start rate, before any of its probes.
    starts = [e[1] for e in events if e[0] == "start"]
    assert [e[1:] for e in events if e[0] == "warm"] == [(name, 1.5, 7.0) for name in starts]


def test_sequential_compare_starts_a_fresh_server_per_variant_and_round(tmp_path):
    events: list = []
    _compare(tmp_path, events, "sequential")
    assert [e[1] for e in events if e[0] == "start"] == ["wcs", "dspark", "wcs-pow2"] * 3
    assert not any(e[0] in ("pause", "resume") for e in events)
    # One server at a time: each is stopped before the next starts, after all of its probes.
    lifetimes = [e for e in events if e[0] in ("start", "stop")]
    assert lifetimes == [(k, name) for name in ["wcs", "dspark", "wcs-pow2"] * 3 for k in ("start", "stop")]


def test_interleaved_compare_keeps_servers_up_and_takes_turns_with_the_others_paused(tmp_path):
    events: list = []
    _compare(tmp_path, events, "interleaved")
    assert [e[1] for e in events if e[0] == "start"] == ["wcs", "dspark", "wcs-pow2"]  # once, for all rounds
    assert [e[0] for e in events[-3:]] == ["stop"] * 3
    # Every probe runs between its server's resume and pause, with every other server paused (checked in measure too).
    probes = [i for i, e in enumerate(events) if e[0] == "probe"]
    for i in probes:
        assert events[i - 1] == ("resume", events[i][1]) and events[i + 1] == ("pause", events[i][1])
    # Turns: in each round, the k-th probes of every variant whose search is still open, in variant order.
    expected = []
    for rep in range(3):
        lengths = {name: len(search(_fake_measure(caps[rep], []), SLOConfig(), start_rate=1.5, bisect_steps=2).path)
                   for name, caps in CAPACITIES.items()}
        assert len(set(lengths.values())) > 1  # searches of different lengths, so the test sees variants drop out
        expected += [name for k in range(max(lengths.values())) for name in CAPACITIES if lengths[name] > k]
    assert [events[i][1] for i in probes] == expected


@pytest.mark.parametrize("protocol", ["sequential", "interleaved"])
def test_a_tpot_sweep_searches_each_slo_and_measures_each_rate_once_per_server_and_round(tmp_path, protocol):
    from loadtest.compare import format_compare, plot_tpot_sweep

    events: list = []
    result = _compare(tmp_path, events, protocol, tpot_sweep_ms=(18.5, 37.0, 74.0))
    assert [c.slo.tpot_ms for c in [result, *result.tpot_sweep]] == [37.0, 18.5, 74.0]  # the main SLO once, first
    assert all(c.slo.ttft_ms == result.slo.ttft_ms for c in result.tpot_sweep)
    searches = 0
    for c in [result, *result.tpot_sweep]:
        for name, caps in CAPACITIES.items():
            plain = [search(_fake_measure(cap * c.slo.tpot_ms / 37.0, []), SLOConfig(), start_rate=1.5, bisect_steps=2) for cap in caps]
            assert c.variants[name].max_rates == [r.max_rate for r in plain]
            assert c.variants[name].crossing_rates == [r.crossing_rate for r in plain]
            searches += sum(len(r.path) for r in plain)
        rates = {name: v.max_rate for name, v in c.variants.items()}
        assert c.ratios["wcs_vs_dspark"] == pytest.approx(rates["wcs"] / rates["dspark"])
    probes = [(e[1], e[4], e[2]) for e in events if e[0] == "probe"]  # (variant, round, rate)
    assert len(probes) == len(set(probes))  # no server measures a rate twice in a round
    reused = [e for e in events if e[0] == "evaluate"]
    for _, name, rep, rate, tpot in reused:  # only rates that server measured in that round, never for the main SLO
        assert (name, rep, rate) in probes and tpot != 37.0
    assert len(probes) + len(reused) == searches and reused  # every search got its whole path; some of it reused
    if protocol == "interleaved":  # the sweep's plot and table, once
        plot_tpot_sweep(result, tmp_path / "tpot-sweep.png")
        assert (tmp_path / "tpot-sweep.png").stat().st_size > 10_000
        table = format_compare(result)
        assert [line for line in table.splitlines() if line.startswith("--")] == [
            "-- TPOT 37 ms, attainment >= 90%", "-- TPOT 18.5 ms, attainment >= 90%", "-- TPOT 74 ms, attainment >= 90%"]


def test_compare_without_warm_up_measures_only_probes(tmp_path):
    events: list = []
    _compare(tmp_path, events, "interleaved", repeats=1, warmup_s=0.0, variants=("wcs",))
    assert not any(e[0] == "warm" for e in events) and any(e[0] == "probe" for e in events)


def _metrics_text(replicas: dict[str, tuple[float, float, float, float]], cpu: dict[str, tuple[float, float]] | None = None) -> str:
    """A /metrics exposition as a ForeSpark server's node exports it through Ray: per replica (stop, abort, ITL sum s,
    ITL count) and, where given, (engine, replica) CPU seconds. vLLM's series are labelled `ReplicaId`, ForeSpark's
    `replica` (Serve's tag)."""
    common = 'SessionName="s",WorkerId="w"'
    lines = ["# TYPE ray_vllm_request_success_total counter", f'ray_vllm_request_success_total{{{common},ReplicaId="",finished_reason="stop"}} 99.0']  # vLLM outside Serve
    for r, (stop, abort, _, _) in replicas.items():
        lines += [f'ray_vllm_request_success_total{{{common},ReplicaId="{r}",finished_reason="stop"}} {stop}',
                  f'ray_vllm_request_success_total{{{common},ReplicaId="{r}",finished_reason="abort"}} {abort}']
    lines.append("# TYPE ray_forespark_engine_inter_token_latency_seconds_total counter")
    lines += [f'ray_forespark_engine_inter_token_latency_seconds_total{{{common},replica="{r}"}} {t}' for r, (_, _, t, _) in replicas.items()]
    lines.append("# TYPE ray_forespark_engine_inter_token_latency_observations_total counter")
    lines += [f'ray_forespark_engine_inter_token_latency_observations_total{{{common},replica="{r}"}} {n}' for r, (_, _, _, n) in replicas.items()]
    lines += ["# TYPE ray_process_cpu_seconds counter", f"ray_process_cpu_seconds_total{{{common}}} 500.0"]  # not a replica's
    lines.append("# TYPE ray_forespark_replica_cpu_seconds_total counter")
    for r, (engine, actor) in (cpu or {}).items():
        lines += [f'ray_forespark_replica_cpu_seconds_total{{{common},process="engine",replica="{r}"}} {engine}',
                  f'ray_forespark_replica_cpu_seconds_total{{{common},process="replica",replica="{r}"}} {actor}']
    return "\n".join(lines) + "\n"


def test_replica_loads_are_each_replicas_finished_requests_and_engine_itl_over_the_run():
    from loadtest.server_metrics import counters_from_text, format_loads, replica_loads

    before = counters_from_text(_metrics_text({"a": (10, 1, 1.0, 100), "b": (5, 0, 2.0, 100)}))
    after = counters_from_text(_metrics_text({"a": (40, 9, 1.6, 200), "b": (15, 0, 3.2, 200), "c": (10, 0, 0.0, 0)}))
    loads = replica_loads(before, after)
    assert list(loads) == ["a", "b", "c"]  # a replica that started during the run counts from zero
    assert [loads[r].requests for r in loads] == [30, 10, 10]  # aborts and a series of no replica are not requests
    assert [loads[r].share for r in loads] == pytest.approx([0.6, 0.2, 0.2])
    assert loads["a"].itl_ms == pytest.approx(6.0) and loads["b"].itl_ms == pytest.approx(12.0) and loads["c"].itl_ms is None
    assert format_loads(loads) == "replicas 60%/20%/20% of requests, ITL 6.0/12.0/- ms"
    assert replica_loads({}, counters_from_text("# TYPE x counter\nx_total 1.0\n")) == {}  # not a ForeSpark server


def test_replica_loads_count_each_replicas_cpu_time_per_finished_request_over_the_run():
    from loadtest.server_metrics import counters_from_text, format_loads, replica_loads

    work = {"a": (10, 0, 1.0, 100), "b": (5, 0, 2.0, 100)}
    before = counters_from_text(_metrics_text(work, cpu={"a": (100.0, 50.0), "b": (10.0, 5.0)}))
    after = counters_from_text(_metrics_text({"a": (40, 9, 1.6, 200), "b": (15, 0, 3.2, 200)}, cpu={"a": (103.0, 51.0), "b": (11.5, 5.5)}))
    loads = replica_loads(before, after)
    # a: 4 CPU s over 30 requests, 3 of them in the engine; b: 2 s over 10, 1.5 in the engine. The ingress's own
    # process CPU and aborted requests count for no replica.
    assert loads["a"].cpu_ms_per_request == pytest.approx(4000 / 30) and loads["a"].engine_cpu_share == pytest.approx(0.75)
    assert loads["b"].cpu_ms_per_request == pytest.approx(200.0) and loads["b"].engine_cpu_share == pytest.approx(0.75)
    assert format_loads(loads) == "replicas 75%/25% of requests, ITL 6.0/12.0 ms, CPU 133/200 ms per request (75%/75% in the engine)"
    # A server whose replicas do not report CPU time (or a replica that finished nothing) has no CPU figure.
    plain = replica_loads(counters_from_text(_metrics_text(work)), counters_from_text(_metrics_text({"a": (40, 0, 1.6, 200), "b": (5, 0, 2.0, 100)})))
    assert all(r.cpu_ms_per_request is None and r.engine_cpu_share is None for r in plain.values())
    assert "CPU" not in format_loads(plain)
    # A replica that started during the run: its requests count, its CPU time (its start-up's) does not.
    late = replica_loads(before, counters_from_text(_metrics_text({"a": (40, 0, 1.6, 200), "c": (5, 0, 0.0, 0)}, cpu={"a": (103.0, 51.0), "c": (30.0, 3.0)})))
    assert late["c"].requests == 5 and late["c"].cpu_ms_per_request is None and late["a"].cpu_ms_per_request == pytest.approx(4000 / 30)


def _wcs_metrics_text(wcs: dict[str, tuple[list[float], list[float], list[float], float, float]]) -> str:
    """WCS's series as Ray exports them: per replica, drafted / verified / accepted tokens per position, then draft and
    step seconds."""
    common = 'SessionName="s",WorkerId="w"'
    lines = []
    for name, at in (("drafted", 0), ("verified", 1), ("accepted", 2)):
        lines.append(f"# TYPE ray_forespark_wcs_{name}_tokens_total counter")
        lines += [f'ray_forespark_wcs_{name}_tokens_total{{{common},position="{j + 1}",replica="{r}"}} {v}'
                  for r, row in wcs.items() for j, v in enumerate(row[at])]
    for name, at in (("draft", 3), ("step", 4)):
        lines.append(f"# TYPE ray_forespark_wcs_{name}_seconds_total counter")
        lines += [f'ray_forespark_wcs_{name}_seconds_total{{{common},replica="{r}"}} {row[at]}' for r, row in wcs.items()]
    return "\n".join(lines) + "\n"


def test_replica_loads_report_what_each_replicas_engine_drafted_and_accepted_over_the_run():
    from loadtest.server_metrics import counters_from_text, format_loads, replica_loads

    work = {"a": (10, 0, 1.0, 100), "b": (5, 0, 2.0, 100)}
    before = counters_from_text(_metrics_text(work) + _wcs_metrics_text({"a": ([5, 3], [4, 2], [2, 1], 1.0, 10.0),
                                                                         "b": ([0, 0], [0, 0], [0, 0], 0.5, 10.0)}))
    after = counters_from_text(_metrics_text({"a": (40, 0, 1.6, 200), "b": (15, 0, 3.2, 200)})
                               + _wcs_metrics_text({"a": ([65, 43], [54, 32], [22, 11], 3.0, 30.0), "b": ([0, 0], [0, 0], [0, 0], 0.9, 30.0)}))
    loads = replica_loads(before, after)
    # a drafted 60 + 40 tokens in the run, 50 + 30 were verified and 20 + 10 accepted; its drafter took 2 of 20 s.
    assert loads["a"].drafted_tokens == 100 and loads["a"].acceptance == pytest.approx(30 / 80)
    assert loads["a"].draft_share == pytest.approx(0.1)
    # b drafted nothing (an `ar` engine keeps WCS's counters): no acceptance, and its drafter's time is context only.
    assert loads["b"].drafted_tokens == 0 and loads["b"].acceptance is None and loads["b"].draft_share == pytest.approx(0.02)
    assert format_loads(loads).endswith("drafted 100/0 tokens (38%/- of those verified accepted; drafter 10.0%/2.0% of step time)")
    # Control: a server whose engines have no WCS reports none of it.
    plain = replica_loads(counters_from_text(_metrics_text(work)), counters_from_text(_metrics_text({"a": (40, 0, 1.6, 200), "b": (15, 0, 3.2, 200)})))
    assert all(r.drafted_tokens is None and r.acceptance is None and r.draft_share is None for r in plain.values())
    assert "drafted" not in format_loads(plain)


def test_process_cpu_seconds_counts_a_busy_child_as_engine_time_and_an_idle_one_as_none():
    """Run in a fresh interpreter, whose only child is the one it starts (this one has servers as children)."""
    probe = """
import json, subprocess, sys, time
from replicas.metrics import process_cpu_seconds
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(1.5)
engine = process_cpu_seconds()["engine"]
child.kill()
before = process_cpu_seconds()["replica"]
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print(json.dumps({"engine": engine, "own": process_cpu_seconds()["replica"] - before}))
"""

    def run(child_code: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", probe, child_code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    busy = run("import time\nend = time.time() + 10\nwhile time.time() < end: pass")
    idle = run("import time; time.sleep(10)")
    assert busy["engine"] > idle["engine"] + 0.5 and idle["engine"] < 0.5  # the interpreter's start-up is the idle child's only CPU
    assert busy["own"] >= 0.25 and idle["own"] >= 0.25  # the process's own busy loop is its own, not the engine's

def test_variant_app_configs_set_policy_pricing_router_slo_step_cap_and_pace():
    from cluster.app import AppConfig
    from loadtest.compare import VARIANTS, variant_app_config

    slo = SLOConfig(tpot_ms=25.0)
    base = {"replica": {"num_replicas": 2, "engine": {"wcs": {"replan_every": 4}}}}
    configs = {name: AppConfig.model_validate(variant_app_config(base, v, slo)) for name, v in VARIANTS.items()}
    assert {name: (c.replica.engine.wcs.policy.value, c.router.kind) for name, c in configs.items()} == {
        name: (v.policy, v.router) for name, v in VARIANTS.items()
    }
    assert all(c.replica.num_replicas == 2 and c.replica.engine.wcs.replan_every == 4 for c in configs.values())
    assert all(c.replica.tpot_slo_ms == 25.0 for c in configs.values())
    assert configs["dspark"].replica.engine.wcs.online_cost is False and configs["wcs"].replica.engine.wcs.online_cost is True
    assert configs["wcs-slo-cap"].replica.engine.wcs.max_step_ms == 25.0
    assert all(c.replica.engine.wcs.max_step_ms is None for name, c in configs.items() if name != "wcs-slo-cap")
    assert configs["wcs-pace"].replica.engine.wcs.pace_tpot_ms == 20.0  # four fifths of the SLO
    assert all(c.replica.engine.wcs.pace_tpot_ms is None for name, c in configs.items() if name != "wcs-pace")
    assert base["replica"]["engine"]["wcs"] == {"replan_every": 4}  # the base is not modified


def test_long_prompts_give_a_share_of_requests_a_lognormal_context_and_leave_the_others_alone():
    import math
    import random

    from loadtest.config import LongPrompts
    from loadtest.workload import Workload

    lp = LongPrompts.parse("0.2:400:0.5")
    assert (lp.share, lp.median_tokens, lp.sigma) == (0.2, 400, 0.5)
    for bad in ("0.2", "a:400", "0.2:400:1:2", "2:400"):
        with pytest.raises(ValueError):
            LongPrompts.parse(bad)

    def bodies(long_prompts, n=2000, seed=3):
        config = LoadTestConfig(url="http://x", rate=1.0, duration_s=1.0, seed=seed, long_prompts=long_prompts)
        workload = Workload(config, random.Random(seed))
        return [workload.next() for _ in range(n)]

    plain = bodies(None)
    assert plain == bodies(LongPrompts(share=0.0, median_tokens=400))  # share 0: the same load, draw for draw
    shipped = {b["prompt"] for _, b in plain}
    longer = [(d, b["prompt"]) for d, b in bodies(lp)]
    extended = [(d, p) for d, p in longer if p not in shipped]
    assert 0.17 < len(extended) / len(longer) < 0.23
    # Each context ends in a shipped prompt of the same domain, and its length in tokens is lognormal around the median.
    by_domain = {}
    for d, b in plain:
        by_domain.setdefault(d, set()).add(b["prompt"])
    assert all(any(p.endswith("\n\n" + q) for q in by_domain[d]) for d, p in extended[:50])
    logs = np.log([len(p) / lp.chars_per_token for _, p in extended])
    assert abs(np.median(logs) - math.log(400)) < 0.15 and 0.35 < np.std(logs) < 0.65
