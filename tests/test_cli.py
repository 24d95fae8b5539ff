"""The `forespark` commands run as a user runs them: a subprocess of the installed entry point."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FORESPARK = shutil.which("forespark", path=str(Path(sys.executable).parent)) or "forespark"


def run(*args, check=True):
    return subprocess.run([FORESPARK, *args], capture_output=True, text=True, timeout=300, check=check)


def test_bench_planner_writes_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run("bench", "planner", "--json", str(out), "--reps", "50", "--batches", "16,256", "--ks", "4,16")
    assert "p50 us" in proc.stdout and "target p50" in proc.stdout
    data = json.loads(out.read_text())
    rows = {(r["batch"], r["k"]): r for r in data["results"]}
    assert set(rows) == {(16, 4), (16, 16), (256, 4), (256, 16)}
    for r in rows.values():
        assert 0 < r["p50_us"] <= r["p99_us"]
        assert 0 <= r["mean_verified"] <= r["mean_drafted"] <= r["k"]


def test_simulate_bench_writes_its_contract_with_the_engines_in_workers(tmp_path):
    out = tmp_path / "bench.json"
    proc = run("simulate", "bench", "--replicas", "8", "--rate", "200", "--duration", "1", "--drain", "2", "--workers", "2",
               "--json", str(out))
    assert "simulated requests per wall second" in proc.stdout
    data = json.loads(out.read_text())
    assert {"replicas", "rate", "sim_seconds", "wall_s", "requests", "sim_requests_per_wall_s"} <= set(data)
    assert data["simulated"] is True and data["replicas"] == 8 and data["workers"] == 2 and data["requests"] > 100
    assert data["steps"] > 0 and 0 < data["planner_ms_per_step"] < data["wall_ms_per_step"]
    assert 0 < data["route_ms_per_request"] and data["served"]["attainment"] > 0.5


def test_simulate_overload_writes_overloads_rows_per_seed_and_refuses_unknown_settings(tmp_path):
    out = tmp_path / "overload.json"
    proc = run("simulate", "overload", "--replicas", "1", "--capacity", "60", "--multiples", "1,4", "--duration", "2",
               "--drain", "5", "--seeds", "0,1", "--admission-set", "trust=0.5", "--json", str(out))
    assert "SIMULATED" in proc.stdout and "medians over 2 seeds" in proc.stdout
    data = json.loads(out.read_text())
    assert data["simulated"] is True and data["admission"]["trust"] == 0.5 and [r["seed"] for r in data["runs"]] == [0, 1]
    assert all([row["multiple"] for row in r["rows"]] == [1.0, 4.0] and r["off_1x"]["rejected_share"] == 0.0 for r in data["runs"])
    assert data["runs"][0]["rows"][1]["rejected_share"] > data["runs"][0]["rows"][0]["rejected_share"]
    bad = run("simulate", "overload", "--capacity", "60", "--admission-set", "trust=abc", check=False)
    assert bad.returncode == 2 and "--admission-set" in bad.stderr


def test_demo_says_it_is_offline():
    proc = run("demo", "--batches", "8", "--steps", "5")
    assert "OFFLINE PLANNER DEMO" in proc.stdout and "no server is started" in proc.stdout
    for policy in ("ar", "static", "dspark", "wcs", "oracle"):
        assert policy in proc.stdout


@pytest.mark.parametrize("args", [
    ("bench", "planner", "--ks", "0"), ("bench", "planner", "--batches", "x"), ("nope",),
    ("simulate", "run", "--rate", "5", "--duration", "1", "--max-num-seqs", "0"),
    ("overload", "--url", "http://127.0.0.1:9", "--refusal-cpu", "--refusal-requests", "0"),
    ("overload", "--url", "http://127.0.0.1:9", "--repeats", "0"),
    ("overload", "--url", "http://127.0.0.1:9", "--multiples", "1,2,1"),
])
def test_bad_arguments_exit_2_with_a_message(args):
    proc = run(*args, check=False)
    assert proc.returncode == 2 and "error" in proc.stderr
