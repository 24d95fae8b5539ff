"""`forespark bench serve`: its figures on hand-built runs, its rotation over stand-in servers, one real run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from loadtest.bench_serve import (
    FIB_PROMPT,
    BenchServeResult,
    Row,
    SetRun,
    _alive,
    checked_server,
    format_bench_serve,
    policy_app_config,
    prompt_sets,
    ratios,
    rotation,
    rows_from_runs,
    run_bench_serve,
    set_run,
)

REPO = Path(__file__).resolve().parent.parent


def _row(policy: str, prompts: str, tps: float) -> Row:
    return Row(policy=policy, prompts=prompts, concurrency=1, tokens_per_s=tps, per_request_tokens_per_s=tps,
               tokens_per_s_repeats=[tps], requests=8, max_tokens=64, completion_tokens=512, errors=0, short=0)


def _run(tps: float, per_request: float = 1.0, errors: int = 0) -> SetRun:
    return SetRun(requests=8, completion_tokens=512, wall_s=512 / tps, tokens_per_s=tps, per_request_tokens_per_s=per_request,
                  errors=errors)


def test_a_sets_rate_is_its_tokens_over_its_wall_time_and_the_per_request_rate_a_median():
    run = set_run([(1.0, 64), (2.0, 64), (0.5, 32), "HTTP 500: boom"], wall_s=4.0, max_tokens=64)
    assert run.requests == 4 and run.completion_tokens == 160 and run.tokens_per_s == 40.0
    assert run.per_request_tokens_per_s == 64.0  # median of 64, 32, 64 tok/s
    assert run.errors == 1 and run.first_error == "HTTP 500: boom" and run.short == 1
    assert set_run(["x"], wall_s=1.0, max_tokens=8).tokens_per_s == 0.0


def test_rows_are_medians_over_repeats_with_totals():
    runs = {("wcs", "code"): [_run(100.0, 10.0), _run(300.0, 30.0), _run(200.0, 50.0, errors=1)], ("ar", "code"): [_run(250.0)] * 3}
    rows = rows_from_runs(runs, concurrency=4, max_tokens=64)
    wcs, ar = rows
    assert (wcs.policy, wcs.prompts, wcs.concurrency) == ("wcs", "code", 4)
    assert wcs.tokens_per_s == 200.0 and wcs.per_request_tokens_per_s == 30.0 and wcs.tokens_per_s_repeats == [100.0, 300.0, 200.0]
    assert wcs.completion_tokens == 3 * 512 and wcs.errors == 1 and ar.tokens_per_s == 250.0


def test_ratios_per_prompt_set_against_ar_static_and_the_best_baseline():
    rows = [_row("wcs", "code", 200.0), _row("ar", "code", 250.0), _row("static", "code", 400.0),
            _row("wcs", "fib", 300.0), _row("ar", "fib", 200.0), _row("static", "fib", 150.0),
            _row("ar", "prose", 100.0)]  # no wcs row: no ratios
    values, best = ratios(rows)
    assert values["code"] == pytest.approx({"wcs_vs_ar": 0.8, "wcs_vs_static": 0.5, "wcs_vs_best": 0.5})
    assert values["fib"] == pytest.approx({"wcs_vs_ar": 1.5, "wcs_vs_static": 2.0, "wcs_vs_best": 1.5})
    assert best == {"code": "static", "fib": "ar", "prose": "ar"}
    assert values["prose"] == {"wcs_vs_ar": None, "wcs_vs_static": None, "wcs_vs_best": None}
    only_wcs, best = ratios([_row("wcs", "code", 1.0)])
    assert only_wcs["code"]["wcs_vs_best"] is None and best["code"] is None
    assert ratios([_row("wcs", "code", 1.0), _row("ar", "code", 0.0)])[0]["code"]["wcs_vs_ar"] is None


def test_the_table_shows_each_row_the_ratios_and_an_unclean_server_stop():
    from loadtest.bench_serve import ServerRun

    rows = [_row("wcs", "code", 200.0), _row("ar", "code", 250.0)]
    values, best = ratios(rows)
    result = BenchServeResult(protocol="sequential", repeats=1, concurrency=1, requests=8, max_tokens=64, rows=rows, ratios=values,
                              best_baseline=best, servers=[ServerRun(policy="ar", start_s=60.0, exit_code=-9, clean_exit=False,
                                                                     leftover_pids=[123])])
    table = format_bench_serve(result)
    assert "wcs       code    200.0" in table and "code: wcs_vs_ar 0.80x, wcs_vs_static -, wcs_vs_best 0.80x (best: ar)" in table
    assert "WARNING: the ar server exited with -9" in table and "[123]" in table


def test_prompt_sets_are_the_shipped_workloads_or_one_prompt_repeated():
    sets = prompt_sets(("code", "fib", "repetitive", "prose"), 3)
    assert sets["fib"] == [FIB_PROMPT] * 3 and len(set(sets["code"])) == 3 and len(set(sets["prose"])) == 3
    assert len(set(sets["repetitive"])) == 1 and sets["repetitive"][0].count("1,") > 90
    shipped = json.loads((REPO / "replicas/models/workloads/code.jsonl").read_text().splitlines()[0])["prompt"]
    assert sets["code"][0] == shipped
    assert len(prompt_sets(("code",), 200)["code"]) == 200  # cycled past the shipped count
    with pytest.raises(ValueError, match="unknown prompt sets"):
        prompt_sets(("code", "poems"), 2)


def test_each_policys_app_has_one_replica_serving_that_policy_and_keeps_the_base():
    base = {"replica": {"num_cpus": 0.5, "engine": {"wcs": {"replan_every": 4}}}}
    config = policy_app_config(base, "static")
    assert config["replica"]["num_replicas"] == 1 and config["replica"]["num_cpus"] == 0.5
    assert config["replica"]["engine"]["wcs"] == {"replan_every": 4, "policy": "static", "online_cost": True}
    assert base["replica"]["engine"]["wcs"] == {"replan_every": 4}  # not modified
    assert policy_app_config({"replica": {"num_replicas": 2}}, "ar")["replica"]["num_replicas"] == 2
    assert config["router"]["admission"] == {"enabled": False}  # timed requests are never refused...
    assert policy_app_config({"router": {"admission": {"enabled": True}}}, "ar")["router"]["admission"]["enabled"]  # ...unless asked
    from cluster.app import AppConfig

    AppConfig.model_validate(policy_app_config({}, "wcs"))


class _StandIn:
    def __init__(self, policy: str, events: list) -> None:
        self.url, self.policy, self.events, self.paused = f"http://stand-in/{policy}", policy, events, False

    def pause(self) -> None:
        assert not self.paused
        self.paused = True
        self.events.append(("pause", self.policy))

    def resume(self) -> None:
        assert self.paused
        self.paused = False
        self.events.append(("resume", self.policy))


RATES = {"wcs": [300.0, 100.0, 200.0], "ar": [250.0, 250.0, 240.0], "static": [150.0, 400.0, 350.0]}


def _bench(tmp_path, protocol, repeats=3, warmup=2):
    events: list = []
    servers: dict[str, _StandIn] = {}
    done = {p: 0 for p in RATES}

    @contextmanager
    def start_server(app, work):
        policy = app["replica"]["engine"]["wcs"]["policy"]
        assert app["replica"]["num_replicas"] == 1
        events.append(("start", policy))
        servers[policy] = _StandIn(policy, events)
        yield servers[policy]
        events.append(("stop", policy))

    def measure(url, prompts):
        policy = url.rsplit("/", 1)[1]
        assert not servers[policy].paused  # never a paused server
        if len(prompts) < 4:  # the sets have 4 prompts; warm-ups are shorter
            events.append(("warm", policy, len(prompts)))
            return _run(1.0)
        rate = RATES[policy][done[policy] // 2]
        done[policy] += 1
        events.append(("measure", policy))
        return _run(rate if prompts[0] == "code" else rate / 2)

    result = run_bench_serve(("wcs", "ar", "static"), {"code": ["code"] * 4, "fib": ["fib"] * 4}, start_server, measure, tmp_path,
                             repeats=repeats, warmup=warmup, protocol=protocol, settle_s=0.0, log=lambda _: None)
    return result, events


@pytest.mark.parametrize("protocol", ["sequential", "interleaved"])
def test_every_policy_and_set_is_measured_each_repeat_in_alternating_order_and_rows_are_medians(tmp_path, protocol):
    result, events = _bench(tmp_path, protocol)
    order = [e[1] for e in events if e[0] == "measure"][::2]  # one entry per (repeat, policy)
    assert order == ["wcs", "ar", "static", "static", "ar", "wcs", "wcs", "ar", "static"]
    by = {(r.policy, r.prompts): r for r in result.rows}
    assert by[("wcs", "code")].tokens_per_s == 200.0 and by[("wcs", "fib")].tokens_per_s == 100.0
    assert by[("static", "code")].tokens_per_s_repeats == [150.0, 400.0, 350.0]
    assert result.ratios["code"] == pytest.approx({"wcs_vs_ar": 0.8, "wcs_vs_static": 200 / 350, "wcs_vs_best": 200 / 350})
    assert result.protocol == protocol and result.requests == 4 and len(result.servers) == len([e for e in events if e[0] == "start"])
    assert all(s.clean_exit and not s.leftover_pids for s in result.servers)


def test_sequential_starts_a_fresh_warmed_server_per_policy_and_repeat(tmp_path):
    _, events = _bench(tmp_path, "sequential")
    starts = [e[1] for e in events if e[0] == "start"]
    assert starts == ["wcs", "ar", "static", "static", "ar", "wcs", "wcs", "ar", "static"]
    first = events[: events.index(("stop", "wcs")) + 1]
    assert first == [("start", "wcs"), ("warm", "wcs", 2), ("warm", "wcs", 2), ("measure", "wcs"), ("measure", "wcs"), ("stop", "wcs")]


def test_interleaved_starts_each_server_once_and_measures_only_the_resumed_one(tmp_path):
    result, events = _bench(tmp_path, "interleaved")
    assert [e[1] for e in events if e[0] == "start"] == ["wcs", "ar", "static"]
    assert [e for e in events if e[0] == "stop"] == [("stop", p) for p in ("static", "ar", "wcs")]  # all up until the end
    # after its start-up warm-up each server is paused; each turn is resume, one warm-up per set, both sets, pause
    assert events[:4] == [("start", "wcs"), ("warm", "wcs", 2), ("warm", "wcs", 2), ("pause", "wcs")]
    turn = events.index(("resume", "wcs"))
    assert events[turn: turn + 6] == [("resume", "wcs"), ("warm", "wcs", 1), ("warm", "wcs", 1), ("measure", "wcs"),
                                       ("measure", "wcs"), ("pause", "wcs")]
    assert result.protocol == "interleaved"


def test_the_default_protocol_is_sequential_for_one_repeat_and_for_gpu_replicas(tmp_path):
    assert _bench(tmp_path, None, repeats=1)[0].protocol == "sequential"
    assert _bench(tmp_path, None, repeats=3)[0].protocol == "interleaved"


def test_bad_arguments_are_refused_before_any_server_starts(tmp_path):
    def no_server(app, work):
        raise AssertionError("started")

    for policies, repeats in ((("wcs", "oracle"), 1), (("ar", "ar"), 1), ((), 1), (("ar",), 0)):
        with pytest.raises(ValueError):
            run_bench_serve(policies, {"fib": ["x"]}, no_server, lambda u, p: _run(1.0), tmp_path, repeats=repeats)


def test_a_stopped_servers_exit_status_and_surviving_processes_are_recorded_and_the_survivors_killed(tmp_path):
    """A stand-in server whose process tree leaves a child behind: the child is found, killed by pid, reported."""
    import psutil

    class Proc:
        def __init__(self) -> None:
            self.url = "http://stand-in"
            # a shell that starts a long sleep in the background and waits on its own
            self.proc = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], process_group=0)
            self.log_path = tmp_path / "server.log"

    procs: list[Proc] = []

    @contextmanager
    def start_server(app, work):
        procs.append(Proc())
        yield procs[-1]
        p = procs[-1].proc
        p.terminate()  # the shell goes; its sleep child lives on
        p.wait()

    records = []
    with checked_server(start_server, {}, tmp_path, records.append, "ar", linger_s=1.0) as server:
        time.sleep(0.3)  # the background sleep exists
        child = psutil.Process(server.proc.pid).children()[0]
    assert len(records) == 1 and records[0].exit_code == -15 and not records[0].clean_exit
    assert records[0].leftover_pids == [child.pid]
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:  # killed (perhaps a zombie of an init that does not reap)
        time.sleep(0.1)
    assert not _alive(child)


def _port_in_our_range() -> int:
    for port in range(8250, 8300):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 8250-8299")


def test_a_real_bench_serve_run_with_one_policy(tmp_path):
    """The command end to end: one `forespark serve` (policy ar), two greedy requests of 8 tokens, stopped by SIGTERM.
    Interleaved (for one policy, the same single server start): the server is also paused, resumed and stopped paused."""
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "serve", "--policies", "ar", "--requests", "2", "--max-tokens", "8",
         "--prompts", "fib", "--warmup", "1", "--protocol", "interleaved", "--port", str(_port_in_our_range()), "--out", str(tmp_path / "work"),
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"rows", "ratios", "servers"}
    (row,) = result["rows"]
    assert {k: row[k] for k in ("policy", "prompts", "concurrency")} == {"policy": "ar", "prompts": "fib", "concurrency": 1}
    assert row["tokens_per_s"] > 0 and row["per_request_tokens_per_s"] > 0
    assert row["completion_tokens"] == 16 and row["errors"] == 0 and row["short"] == 0  # ignore_eos: all 8 tokens each
    assert result["ratios"] == {"fib": {"wcs_vs_ar": None, "wcs_vs_static": None, "wcs_vs_best": None}}
    assert result["protocol"] == "interleaved"
    (server,) = result["servers"]
    assert server["clean_exit"] and server["exit_code"] == 0 and server["leftover_pids"] == []
    assert "ar        fib" in proc.stdout and "fib: wcs_vs_ar -" in proc.stdout


def test_a_server_whose_first_sigterm_goes_astray_gets_another_and_stops_cleanly(tmp_path):
    """`compare.ServerProcess`'s stop, on a stand-in driver that handles only its second SIGTERM (as a `forespark serve`
    just continued from a long pause may: the first lands on a thread whose handler never wakes the main one)."""
    from loadtest.compare import ServerProcess

    script = (
        "import signal, sys, time\n"
        "seen = []\n"
        "def on_term(*_):\n"
        "    seen.append(1)\n"
        "    if len(seen) == 2:\n"
        "        print('stopping', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(0.1)\n"
    )
    server = ServerProcess({}, 0, tmp_path)
    server._log = server.log_path.open("w")
    server.proc = subprocess.Popen([sys.executable, "-c", script], stdout=server._log, stderr=subprocess.STDOUT, process_group=0)
    time.sleep(1.0)
    start = time.monotonic()
    server.__exit__(None, None, None)
    assert server.proc.returncode == 0 and 9 < time.monotonic() - start < 30  # the second one, 10 s on; no SIGKILL at 120 s
    assert "stopping" in server.log_path.read_text()
