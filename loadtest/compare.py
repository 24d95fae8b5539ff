"""Side by side: the same capacity search against the application started once per variant.

Each variant is `forespark serve` with one speculation policy and one router
on the same machine. Two protocols:

- **interleaved** (CPU replicas): every variant's server is started once and
  stays up; the searches take turns, one probe each, so the variants' k-th
  probes run minutes apart under the same machine state. A server that is not
  being probed is paused (SIGSTOP on its whole process tree), so it takes no
  CPU from the one that is.
- **sequential** (GPU replicas, which cannot all fit at once): each variant's
  server is started fresh, searched to the end and stopped before the next.

With repeats, every variant is searched once per round and its rate is the
median over rounds. The result is the ratio of median sustainable request rates.

Further TPOT SLOs (`tpot_sweep_ms`) get their own searches on the same
servers after the main one, in the same turns; a rate already measured is
re-evaluated against the new SLO from its per-request rows rather than
measured again, so a sweep costs only the probes its knees need. The
replicas keep the main SLO as their routing headroom throughout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import numpy as np
import yaml
from pydantic import BaseModel

from loadtest.capacity import CapacityResult, Probe, Search, SLOSweep, format_probe, load_at
from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.report import LoadTestReport
from loadtest.run import rebuild_report, run_loadtest


class Variant(BaseModel):
    name: str
    policy: str
    router: str
    online_cost: bool = True  # the engine corrects its profiled step cost while serving (WCSConfig.online_cost)
    slo_step_cap: bool = False  # the planner caps predicted step time at the TPOT SLO (WCSConfig.max_step_ms)
    pace: bool = False  # the planner keeps every request on a TPOT pace under the SLO (WCSConfig.pace_tpot_ms)


# The engine paces from its own clock, which misses what the HTTP stack adds per request; a fifth of the SLO is
# left for that.
PACE_SHARE = 0.8


VARIANTS = {
    "wcs": Variant(name="wcs", policy="wcs", router="acceptance_headroom"),
    # vLLM's adaptive verification prices steps with its start-up profile only.
    "dspark": Variant(name="dspark", policy="dspark", router="acceptance_headroom", online_cost=False),
    "dspark-online": Variant(name="dspark-online", policy="dspark", router="acceptance_headroom"),
    "ar": Variant(name="ar", policy="ar", router="acceptance_headroom"),
    "wcs-pow2": Variant(name="wcs-pow2", policy="wcs", router="pow2"),
    # A request that drafts nothing gets one token per step: its TPOT is the step time, whatever others gain.
    "wcs-slo-cap": Variant(name="wcs-slo-cap", policy="wcs", router="acceptance_headroom", slo_step_cap=True),
    # Steps only as long as keeps each request on pace that a step can keep: prose that accepts little bounds them.
    "wcs-pace": Variant(name="wcs-pace", policy="wcs", router="acceptance_headroom", pace=True),
}
RATIOS = {"wcs_vs_dspark": ("wcs", "dspark"), "wcs_vs_ar": ("wcs", "ar"), "router_vs_pow2": ("wcs", "wcs-pow2")}


class VariantResult(BaseModel):
    policy: str
    router: str
    max_rate: float  # median over the repeats
    max_rates: list[float]  # one per repeat
    crossing_rate: float  # median over the repeats of the interpolated rate where attainment crosses the target
    crossing_rates: list[float]
    capacity: CapacityResult  # the last repeat's search


CompareProtocol = Literal["interleaved", "sequential"]


class SLOComparison(BaseModel):
    slo: SLOConfig
    variants: dict[str, VariantResult]
    ratios: dict[str, float | None]  # of median max_rate
    crossing_ratios: dict[str, float | None]  # of median crossing_rate


class CompareResult(SLOComparison):
    """The comparison under the main SLO, and under each further TPOT SLO of a sweep."""

    protocol: CompareProtocol = "sequential"  # results written before there were two protocols were sequential
    tpot_sweep: list[SLOComparison] = []


def variant_app_config(base: dict[str, Any], variant: Variant, slo: SLOConfig) -> dict[str, Any]:
    """`base` (an AppConfig as a dict) with the variant's policy, step-cost pricing and router; the replicas
    measure their headroom against the TPOT SLO the load test checks."""
    config = yaml.safe_load(yaml.safe_dump(base or {}))
    replica = config.setdefault("replica", {})
    if slo.tpot_ms is not None:
        replica["tpot_slo_ms"] = slo.tpot_ms
    engine = replica.setdefault("engine", {})
    engine.setdefault("wcs", {}).update(policy=variant.policy, online_cost=variant.online_cost)
    if variant.slo_step_cap and slo.tpot_ms is not None:
        engine["wcs"]["max_step_ms"] = slo.tpot_ms
    if variant.pace and slo.tpot_ms is not None:
        engine["wcs"]["pace_tpot_ms"] = PACE_SHARE * slo.tpot_ms
    config.setdefault("router", {})["kind"] = variant.router
    return config


class Server(Protocol):
    """A running application as `compare` uses it."""

    url: str

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ServerProcess:
    """`forespark serve` in its own process group; ready when `/v1/models` answers; SIGTERM on exit.

    `pause` stops the server's whole process tree (the driver, Ray's GCS and raylet, the replicas and their
    engine processes, which Ray puts in process groups of their own) and `resume` continues it.
    """

    def __init__(self, app_config: dict, port: int, work_dir: Path, start_timeout_s: float = 900.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.config_path = work_dir / "app.yaml"
        self.config_path.write_text(yaml.safe_dump(app_config))
        self.log_path = work_dir / "server.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._paused: list = []  # psutil.Process objects stopped by pause()

    def pause(self) -> None:
        import psutil

        assert self.proc is not None and not self._paused
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                p.suspend()
                self._paused.append(p)
            except psutil.NoSuchProcess:
                pass

    def resume(self) -> None:
        import psutil

        for p in self._paused:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
        self._paused = []

    def __enter__(self) -> "ServerProcess":
        repo_root = str(Path(__file__).resolve().parent.parent)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--config", str(self.config_path), "--port", str(self.port)],
            # Its own process group (so it can be killed whole) but not its own session: with the kernel's
            # autogroup scheduling a new session is a separate CPU group, whose fair share starves a load
            # generator in this one for up to seconds at a time; in one group Ray's worker niceness applies.
            stdout=self._log, stderr=subprocess.STDOUT, env=env, process_group=0,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server was not ready within {self.start_timeout_s:.0f} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        was_paused = bool(self._paused)
        self.resume()  # a stopped process would not act on SIGTERM
        if self.proc is not None and self.proc.poll() is None:
            if was_paused:
                # A just-continued driver's main thread still has SIGCONT pending, so the kernel hands a SIGTERM sent
                # now to another thread, and Python runs its handler only once the main thread (waiting on an
                # event) wakes: the stop would wait for the SIGKILL below. Measured: SIGTERM right after the resume
                # went unhandled for 40 s; 2 s after it, the server stopped at once.
                time.sleep(2.0)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # Still up and its handler has not run (`forespark serve` prints "stopping" when it does): once more.
                if not self._log_says_stopping():
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=110)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        self._log.close()

    def _log_says_stopping(self) -> bool:
        try:
            return "\nstopping\n" in self.log_path.read_text(errors="replace")
        except OSError:
            return False


def ratio(variants: dict[str, VariantResult], a: str, b: str, field: str = "max_rate") -> float | None:
    if a not in variants or b not in variants or getattr(variants[b], field) <= 0:
        return None
    return getattr(variants[a], field) / getattr(variants[b], field)


ServerStarter = Callable[[dict[str, Any], Path], AbstractContextManager[Server]]  # (app config, work dir) -> a running server
Measure = Callable[[LoadTestConfig, SLOConfig], LoadTestReport]  # one load test
Evaluate = Measure  # the same call on a finished load test: its rows against another SLO


def measure_load(load: LoadTestConfig, slo: SLOConfig) -> LoadTestReport:
    return run_loadtest(load, slo, progress=True, plots=False)


def local_servers(port: int) -> ServerStarter:
    """`forespark serve` on this machine: servers up at the same time get `port`, `port + 1`, ..."""
    busy: set[int] = set()

    @contextmanager
    def start(app_config: dict[str, Any], work: Path) -> Iterator[Server]:
        own = next(p for p in range(port, port + 1000) if p not in busy)
        busy.add(own)
        try:
            with ServerProcess(app_config, own, work) as server:
                yield server
        finally:
            busy.discard(own)

    return start


def default_protocol(base_app: dict[str, Any]) -> CompareProtocol:
    """Interleaved for CPU replicas (a paused server frees its CPUs); sequential for GPU replicas, whose
    memory a paused server keeps."""
    return "sequential" if (base_app or {}).get("replica", {}).get("accelerator") == "gpu" else "interleaved"


def compare(
    base_load: LoadTestConfig,
    slo: SLOConfig,
    variants: list[str],
    base_app: dict[str, Any],
    start_server: ServerStarter,
    start_rate: float,
    bisect_steps: int = 3,
    repeats: int = 1,
    log: Callable[[str], None] = print,
    measure: Measure = measure_load,
    warmup_s: float = 10.0,
    protocol: CompareProtocol = "interleaved",
    settle_s: float = 3.0,
    tpot_sweep_ms: Sequence[float] = (),
    evaluate: Evaluate = rebuild_report,
) -> CompareResult:
    """Each repeat searches every variant once; a variant's rate is the median over repeats.

    A fresh server first gets `warmup_s` seconds of load at `start_rate`, not counted: the first
    seconds after a start miss SLOs for reasons no variant owns (first touches of the KV cache, the
    router's first stats), and they would otherwise fall on whichever probe comes first. A resumed
    server gets `settle_s` before its probe: its replicas' routing stats went stale while it was paused.
    """
    slos = [slo] + [slo.model_copy(update={"tpot_ms": t}) for t in dict.fromkeys(tpot_sweep_ms) if t != slo.tpot_ms]
    results_of: list[dict[str, list[CapacityResult]]] = [{name: [] for name in variants} for _ in slos]
    label = (lambda s: f"[TPOT {s.tpot_ms:g} ms] ") if len(slos) > 1 else (lambda s: "")

    def start(name: str, work: Path, stack: ExitStack) -> Server:
        variant = VARIANTS[name]
        work.mkdir(parents=True, exist_ok=True)
        log(f"== {name}: policy {variant.policy}, router {variant.router}; starting the server")
        server = stack.enter_context(start_server(variant_app_config(base_app, variant, slo), work))
        if warmup_s > 0:
            warm = base_load.model_copy(
                update={"url": server.url, "rate": start_rate, "duration_s": warmup_s, "drain_s": warmup_s,
                        "seed": base_load.seed + 1, "out_dir": work / "warm-up"}
            )
            log(f"   warm-up: {warmup_s:g} s at {start_rate:g} req/s, not counted (attainment {measure(warm, slo).attainment:.1%})")
        return server

    def logged(name: str, rep: int, search: Search, probe: Probe, note: str = "") -> None:
        log(f"   {name} (repeat {rep + 1}/{repeats}): {label(search.slo)}{format_probe(probe)}{note}")
        if search.result is not None:
            results_of[slos.index(search.slo)][name].append(search.result)
            log(f"   {name}: {label(search.slo)}max sustainable rate {search.result.max_rate:.3g} req/s "
                f"(crossing {search.result.crossing_rate:.3g})")

    def probe(name: str, server: Server, sweep: SLOSweep, rep: int) -> None:
        """One measurement for the open search, then every later search that only needs rates measured."""
        search = sweep.search
        assert search is not None
        load = base_load.model_copy(update={"url": server.url, "out_dir": Path(base_load.out_dir) / name / f"repeat-{rep}"})
        load = load_at(load, search.rate)
        logged(name, rep, search, sweep.record(load, measure(load, search.slo)))
        for later, replayed in sweep.replay(evaluate):
            logged(name, rep, later, replayed, " (rows measured earlier)")

    if protocol == "sequential":
        for rep in range(repeats):
            for name in variants:
                with ExitStack() as stack:
                    server = start(name, Path(base_load.out_dir) / name / f"repeat-{rep}", stack)
                    sweep = SLOSweep(slos, start_rate, bisect_steps)
                    while sweep.search is not None:
                        probe(name, server, sweep, rep)
    else:
        with ExitStack() as stack:
            servers: dict[str, Server] = {}
            for name in variants:
                servers[name] = start(name, Path(base_load.out_dir) / name, stack)
                servers[name].pause()
            for rep in range(repeats):
                sweeps = {name: SLOSweep(slos, start_rate, bisect_steps) for name in variants}
                while pending := [name for name in variants if sweeps[name].search is not None]:
                    for name in pending:  # one probe each, in turn
                        servers[name].resume()
                        time.sleep(settle_s)
                        probe(name, servers[name], sweeps[name], rep)
                        servers[name].pause()
    main, *sweep = [comparison(s, found) for s, found in zip(slos, results_of)]
    return CompareResult(**dict(main), protocol=protocol, tpot_sweep=sweep)


def comparison(slo: SLOConfig, found: dict[str, list[CapacityResult]]) -> SLOComparison:
    """Each variant's median over its rounds' searches under `slo`, and the ratios of those medians."""
    results = {}
    for name, rounds in found.items():
        max_rates, crossings = [r.max_rate for r in rounds], [r.crossing_rate for r in rounds]
        results[name] = VariantResult(
            policy=VARIANTS[name].policy, router=VARIANTS[name].router, capacity=rounds[-1],
            max_rate=float(np.median(max_rates)), max_rates=max_rates, crossing_rate=float(np.median(crossings)), crossing_rates=crossings,
        )
    return SLOComparison(
        slo=slo, variants=results,
        ratios={key: ratio(results, a, b) for key, (a, b) in RATIOS.items()},
        crossing_ratios={key: ratio(results, a, b, "crossing_rate") for key, (a, b) in RATIOS.items()},
    )


def format_compare(result: CompareResult) -> str:
    lines = [f"protocol: {result.protocol}"]
    for c in [result, *result.tpot_sweep]:
        if result.tpot_sweep:
            lines.append(f"-- {c.slo.describe()}")
        lines.append(f"{'variant':>10} {'policy':>7} {'router':>20} {'median rate':>11} {'crossing':>8}  repeats (rate / crossing)")
        for name, v in c.variants.items():
            repeats = ", ".join(f"{r:.3g} / {x:.3g}" for r, x in zip(v.max_rates, v.crossing_rates))
            lines.append(f"{name:>10} {v.policy:>7} {v.router:>20} {v.max_rate:>11.3g} {v.crossing_rate:>8.3g}  {repeats}")
        for key, value in c.ratios.items():
            crossing = c.crossing_ratios[key]
            lines.append(f"{key}: {'-' if value is None else f'{value:.2f}x'} (crossing {'-' if crossing is None else f'{crossing:.2f}x'})")
    return "\n".join(lines)


def plot_tpot_sweep(result: CompareResult, path: Path) -> None:
    """Each variant's median sustainable rate (points) and crossing rate (line) against the TPOT SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = sorted([result, *result.tpot_sweep], key=lambda c: c.slo.tpot_ms or 0.0)
    tpots = [c.slo.tpot_ms for c in comparisons]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in result.variants:
        line = ax.plot(tpots, [c.variants[name].crossing_rate for c in comparisons], label=f"{name} (crossing)")[0]
        ax.scatter(tpots, [c.variants[name].max_rate for c in comparisons], color=line.get_color(), marker="o")
    ax.set_xlabel("TPOT SLO (ms)")
    ax.set_ylabel(f"sustainable rate (req/s, attainment >= {result.slo.attainment_target:.0%})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
