"""One load test: Locust headless in its own process(es), then the report from its per-request rows."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from loadtest.config import CONFIG_ENV, LoadTestConfig, SLOConfig
from loadtest.report import LoadTestReport, RequestRow, build_report, format_report, plot_report, read_rows
from loadtest.server_metrics import scrape, settled_loads

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


class LoadTestError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def locust_command(config: LoadTestConfig) -> list[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", config.url,
        "--loglevel", "WARNING", "--only-summary", "--stop-timeout", str(int(config.drain_s) + 5),
    ]
    if config.processes > 1:
        port = free_port()  # master and workers must agree on the port (DESIGN.md section 5)
        cmd += ["--processes", str(config.processes), "--master-port", str(port), "--master-bind-port", str(port)]
    return cmd


def _count_rows(out_dir: Path) -> int:
    return sum(max(0, sum(1 for _ in p.open()) - 1) for p in out_dir.glob("requests-*.csv"))


def run_locust(config: LoadTestConfig, progress: bool = True) -> list[RequestRow]:
    """Runs the load test and returns its rows (also left as CSV files in `config.out_dir`)."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("requests-*.csv"):
        old.unlink()
    run_file = out / "run.json"
    run_file.write_text(config.model_dump_json(indent=2))
    env = {**os.environ, CONFIG_ENV: str(run_file.resolve())}
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    log_path = out / "locust.log"
    limit = config.duration_s + config.drain_s + 120.0
    with log_path.open("w") as log:
        proc = subprocess.Popen(locust_command(config), stdout=log, stderr=subprocess.STDOUT, env=env)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=round(config.duration_s), desc=f"load {config.rate:g} req/s", unit="s", leave=False)
        start = time.monotonic()
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                if elapsed > limit:
                    proc.kill()
                    raise LoadTestError(f"Locust did not finish within {limit:.0f} s; see {log_path}")
                if bar is not None:
                    bar.n = min(round(elapsed), bar.total)
                    bar.set_postfix(done=_count_rows(out), refresh=False)
                    bar.refresh()
                time.sleep(1.0)
        finally:
            if proc.poll() is None:
                proc.kill()
            if bar is not None:
                bar.close()
    rows = read_rows(out)
    if proc.returncode not in (0, 1) or (not rows and proc.returncode != 0):
        # Locust exits 1 when any request failed; that is data, not a broken run.
        raise LoadTestError(f"Locust exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
    return rows


def run_loadtest(config: LoadTestConfig, slo: SLOConfig, progress: bool = True, plots: bool = True) -> LoadTestReport:
    before = scrape(config.url)
    rows = run_locust(config, progress)
    report = build_report(rows, slo, config.rate, config.duration_s)
    if before:
        report.replicas = settled_loads(config.url, before, finished=report.succeeded)
    out = Path(config.out_dir)
    (out / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
    if plots:
        plot_report(rows, report, out / "report.png")
    return report


def rebuild_report(config: LoadTestConfig, slo: SLOConfig) -> LoadTestReport:
    """A finished load test's report against `slo`, from the per-request rows it wrote: any SLO can be
    checked after the fact (without the server's per-replica account, which was scraped at the time)."""
    return build_report(read_rows(config.out_dir), slo, config.rate, config.duration_s)


__all__ = ["LoadTestError", "format_report", "rebuild_report", "run_locust", "run_loadtest"]
