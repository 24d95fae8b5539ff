"""`forespark simulate validate`: the real CPU deployment against the simulator, on the same arrivals.

For each policy, a real `forespark serve` (the default application, the policy set as `forespark compare`
sets it, admission off) takes a Locust load test at each rate. The simulator then replays each run's own requests (their
scheduled arrival times, domains, prompt and output lengths) through a simulated fleet of the same size,
pricing steps with the replicas' own profiled cost model (their cache entry on this host) and replaying the
embedded pair's recorded acceptance traces, on which its estimators are fitted as the engine's are. Per
case it reports real and simulated TTFT p50/p90, TPOT p50/p90, output-token throughput and SLO attainment,
and their relative errors; the median error over the cases is the headline. The sustainable-rate ordering
of the policies is compared with a real `forespark compare` result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from cluster.sim.compare import VARIANTS as SIM_VARIANTS, simulate_capacity, variant_fleet
from cluster.sim.engine import SimRequest
from cluster.sim.fleet import Fleet, FleetConfig, HostModel, LoadConfig
from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.report import LoadTestReport, RequestRow, build_report

METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput", "attainment")
TIE = 0.05  # sustainable rates within this share of each other count as tied


def metrics(report: LoadTestReport) -> dict[str, float | None]:
    return {"ttft_p50": report.ttft_ms.p50, "ttft_p90": report.ttft_ms.p90, "tpot_p50": report.tpot_ms.p50,
            "tpot_p90": report.tpot_ms.p90, "throughput": report.output_token_throughput, "attainment": report.attainment}


def relative_errors(real: dict, sim: dict) -> dict[str, float | None]:
    return {k: (abs(sim[k] - real[k]) / abs(real[k]) if real[k] and sim[k] is not None else None) for k in METRICS}


class Case(BaseModel):
    """One (policy, rate): with repeats, `real` and `sim` are each metric's median over the repeats' runs (each repeat
    simulated on its own arrivals) and `requests` their total; `repeats` holds every run's own figures."""

    policy: str
    rate: float
    requests: int
    real: dict[str, float | None]
    sim: dict[str, float | None]
    error: dict[str, float | None]
    repeats: list[dict[str, dict[str, float | None]]] = []


def _median(values: list[float | None]) -> float | None:
    given = [v for v in values if v is not None]
    return float(np.median(given)) if given else None


def case_from_repeats(policy: str, rate: float, runs: list[tuple[int, dict[str, float | None], dict[str, float | None]]]) -> Case:
    """A case from its repeats' (requests, real, simulated) figures: each side's median per metric, then their error. A
    run the host slowed as a whole (both replicas at once, for half a minute: docs/results.md) moves the median of
    three no further than the next run."""
    real = {k: _median([r[k] for _, r, _ in runs]) for k in METRICS}
    sim = {k: _median([m[k] for _, _, m in runs]) for k in METRICS}
    return Case(policy=policy, rate=rate, requests=sum(n for n, _, _ in runs), real=real, sim=sim,
                error=relative_errors(real, sim),
                repeats=[{"real": r, "sim": m} for _, r, m in runs] if len(runs) > 1 else [])


class HostFit(BaseModel):
    """What the host adds beyond the profiled engines, fitted on one real run (the calibration case; with repeats,
    the median of each run's fit): the serving path's CPU per output event on the cores the engines share
    (`HostModel`), and the HTTP path's time to a first token."""

    cores: float
    event_cpu_ms: float
    request_ms: float
    policy: str
    rate: float
    seed: int

    def fleet_update(self, refusal_cpu_ms: float = 0.0) -> dict:
        """What a `FleetConfig` of replicas on this host takes: its host model and HTTP time per request."""
        return {"host": HostModel(cores=self.cores, event_cpu_ms=self.event_cpu_ms, refusal_cpu_ms=refusal_cpu_ms),
                "request_ms": self.request_ms}


class ValidateResult(BaseModel):
    simulated: bool = True
    profile: str
    traces: str
    replicas: int
    slo: SLOConfig
    host: HostFit
    median_error: dict[str, float | None]
    ordering_matches: bool | None  # None: no real comparison given
    ordering: dict[str, dict[str, float]]  # "real" / "sim": sustainable (crossing) rate per policy
    cases: list[Case]


def deployment_profile(replicas: int) -> Path:
    """The profiled step-cost file the default application's replicas use on this host (their cache entry:
    `replicas.wcs.profiler.profile_name` under the CPU threads Ray gives each replica)."""
    import warnings

    from cluster.host import HostDescription, resolve_app_config
    from replicas.wcs.profiler import cache_dir, profile_name

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        app = resolve_app_config({"replica": {"num_replicas": replicas}}, HostDescription.detect())
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(int(app.replica.num_cpus))  # as Ray sets it for the replica's actor
    try:
        return cache_dir() / "step_cost" / profile_name(app.replica.engine)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def replayed(rows: list[RequestRow]) -> list[SimRequest]:
    """The real run's requests for the simulator: scheduled arrivals from the first, domains, token counts."""
    from loadtest.workload import shipped_prompts

    prompts = shipped_prompts()
    t0 = min((r.scheduled_s if r.scheduled_s is not None else r.start_s) for r in rows)
    out = []
    for n, r in enumerate(sorted(rows, key=lambda r: r.scheduled_s or r.start_s)):
        prompt = prompts[r.domain][n % len(prompts[r.domain])]["prompt"] if r.domain in prompts else ""
        out.append(SimRequest(id=r.request_id, key=n, domain=r.domain, prompt=prompt, prompt_tokens=r.prompt_tokens or 1,
                              max_tokens=r.output_tokens or 1, arrival_s=(r.scheduled_s or r.start_s) - t0))
    return out


def simulate_rows(fleet: FleetConfig, rows: list[RequestRow], load: LoadTestConfig, slo: SLOConfig, seed: int) -> LoadTestReport:
    sim = Fleet(fleet, seed=seed).run(LoadConfig(rate=load.rate, duration_s=load.duration_s, drain_s=load.drain_s, seed=seed),
                                      requests=replayed([r for r in rows if r.status == 200]))
    return build_report(sim, slo, load.rate, load.duration_s)


def real_app_config(policy: str, replicas: int, slo: SLOConfig) -> dict:
    """The real server of a policy's runs: the default application with the policy as `forespark compare` sets
    it, and admission off. The simulated fleet replays every request the load test sent; a real server that
    refused some (429) would be compared on other requests than the simulator serves."""
    from loadtest.compare import VARIANTS, variant_app_config

    base = {"replica": {"num_replicas": replicas}, "router": {"admission": {"enabled": False}}}
    return variant_app_config(base, VARIANTS[policy], slo)


def run_dir(work: Path, policy: str, rate: float, seed: int) -> Path:
    return work / policy / f"rate-{rate:g}-seed-{seed}"


def measured(work: Path, policy: str, rate: float, seed: int) -> bool:
    return any(run_dir(work, policy, rate, seed).glob("requests-*.csv"))


def real_runs(runs: list[tuple[str, float, int]], load: LoadTestConfig, slo: SLOConfig, replicas: int, port: int,
              work: Path) -> dict[tuple[str, float, int], list[RequestRow]]:
    """(policy, rate, seed) -> the real load test's rows; one server per policy, its runs in the order given. A run
    whose rows are already in `work` (an earlier validation's: `--reuse`) is read, not measured again."""
    from loadtest.compare import ServerProcess
    from loadtest.report import read_rows
    from loadtest.run import run_loadtest

    found = {run: read_rows(run_dir(work, *run)) for run in runs if measured(work, *run)}
    for policy in dict.fromkeys(run[0] for run in runs if run not in found):
        app = real_app_config(policy, replicas, slo)
        (work / policy).mkdir(parents=True, exist_ok=True)
        with ServerProcess(app, port, work / policy) as server:
            for run in [r for r in runs if r[0] == policy and r not in found]:
                _, rate, seed = run
                config = load.model_copy(update={"url": server.url, "out_dir": run_dir(work, *run), "rate": rate, "seed": seed})
                run_loadtest(config, slo, progress=True, plots=False)
                found[run] = read_rows(run_dir(work, *run))
    return {run: found[run] for run in runs}


def fit_host(base: FleetConfig, rows: list[RequestRow], load: LoadTestConfig, slo: SLOConfig, seed: int, policy: str) -> HostFit:
    """The serving path's CPU per output event whose simulated TPOT p50 matches the real one (bisection: TPOT
    grows with it), then the request overhead that closes the TTFT p50 gap."""
    real = build_report(rows, slo, load.rate, load.duration_s)
    fleet = variant_fleet(base, SIM_VARIANTS[policy], slo)
    cores = float(os.cpu_count() or 1)

    def simulated(event_cpu_ms: float, request_ms: float = 0.0) -> LoadTestReport:
        cfg = fleet.model_copy(update={"host": HostModel(cores=cores, event_cpu_ms=event_cpu_ms), "request_ms": request_ms})
        return simulate_rows(cfg, rows, load, slo, seed)

    lo, hi = 0.0, 20.0
    for _ in range(12):
        mid = (lo + hi) / 2
        if (simulated(mid).tpot_ms.p50 or 0.0) < (real.tpot_ms.p50 or 0.0):
            lo = mid
        else:
            hi = mid
    event = (lo + hi) / 2
    gap = (real.ttft_ms.p50 or 0.0) - (simulated(event).ttft_ms.p50 or 0.0)
    return HostFit(cores=cores, event_cpu_ms=event, request_ms=max(gap, 0.0), policy=policy, rate=load.rate, seed=seed)


def ordering_matches(real: dict[str, float], sim: dict[str, float]) -> bool:
    """Every pair the real runs order clearly (more than `TIE` apart) the simulator orders the same way."""
    names = [n for n in real if n in sim]
    for a in names:
        for b in names:
            if real[a] > real[b] * (1 + TIE) and not sim[a] > sim[b]:
                return False
    return True


def validate(policies: list[str], rates: list[float], load: LoadTestConfig, slo: SLOConfig, replicas: int = 2,
             port: int = 8100, seed: int = 0, real_compare: Path | None = None, work: Path | None = None,
             calibration_rate: float | None = None, calibration_policy: str | None = None, host: HostFit | None = None,
             profile: str | None = None, fresh_profile: bool = False, repeats: int = 1, log=print) -> ValidateResult:
    """The cases are every (policy, rate) at `seed`; the host overheads are fitted on one more real run of
    `calibration_policy` (default `ar`, whose steps hold no acceptance to get wrong, else the first policy) at
    `calibration_rate` (default the middle rate) with another seed, which no case shares. `repeats` > 1 runs each
    case and the calibration that many times (seeds `seed`, `seed + 1`, ...; `seed + 1000`, ...) and compares
    medians (`case_from_repeats`): one real run is as far as 10-50% from the next on these hosts. `work` may hold an
    earlier validation's real runs, which are reused. `host`: a fit from another validation, used as it is (no
    calibration run): the strictest test of settings the model was not fitted on.

    What the real runs were measured with stays beside them in `work`, so that re-simulating them on another machine
    gives the same figures: the replicas' step-cost profile (`profile.json`, copied from this host's cache when the
    runs are measured; `profile` overrides it: a profile name or file). `fresh_profile`: the replicas' cached
    profile is removed first, so that the first real server profiles its engine afresh on this host, quiet (a
    profile cached while other work ran prices steps for that host, not this one)."""
    from replicas.models.build import WEIGHTS_DIR

    traces = WEIGHTS_DIR / "traces.npz"
    work = work or Path(tempfile.mkdtemp(prefix="forespark-validate-"))
    cal_policy = calibration_policy or ("ar" if "ar" in policies else policies[0])
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    cal_rate = calibration_rate or sorted(rates)[len(rates) // 2]
    calibrations = [(cal_policy, cal_rate, seed + 1000 + k) for k in range(repeats)]
    cases_runs = [(p, r, seed + k) for p in policies for r in rates for k in range(repeats)]
    wanted = ([] if host else calibrations) + cases_runs
    stored = work / "profile.json"
    if fresh_profile:
        if all(measured(work, *run) for run in wanted):
            raise ValueError(f"--fresh-profile needs real runs to measure: every run is already in {work}")
        deployment_profile(replicas).unlink(missing_ok=True)
        stored.unlink(missing_ok=True)
    runs = real_runs(wanted, load, slo, replicas, port, work)
    if profile is None:
        if not stored.exists():
            cached = deployment_profile(replicas)
            if not cached.exists():  # (the real servers profile their engines at start when this host has no profile yet)
                raise FileNotFoundError(f"no step-cost profile at {cached}: the real replicas did not profile where expected")
            shutil.copyfile(cached, stored)
        profile = str(stored)
    base = FleetConfig(replicas=replicas, profile=profile, traces=traces)
    if host is None:
        fits = [fit_host(base, runs.pop(run), load.model_copy(update={"rate": run[1], "seed": run[2]}), slo, run[2], run[0])
                for run in calibrations]
        host = fits[0].model_copy(update={"event_cpu_ms": float(np.median([f.event_cpu_ms for f in fits])),
                                          "request_ms": float(np.median([f.request_ms for f in fits]))})
        log(f"host fitted on {cal_policy} at {cal_rate:g} req/s, seed {host.seed}{f' and {repeats - 1} more' if repeats > 1 else ''}: "
            f"{host.event_cpu_ms:.2f} ms of CPU per output event on {host.cores:g} cores, {host.request_ms:.1f} ms per request")
    base = base.model_copy(update=host.fleet_update())
    cases = []
    for policy in policies:
        for rate in rates:
            fleet, rate_load = variant_fleet(base, SIM_VARIANTS[policy], slo), load.model_copy(update={"rate": rate})
            measured_runs = []
            for k in range(repeats):
                rows = runs[(policy, rate, seed + k)]
                real = build_report(rows, slo, rate, load.duration_s)
                sim = simulate_rows(fleet, rows, rate_load, slo, seed + k)
                measured_runs.append((len(rows), metrics(real), metrics(sim)))
            case = case_from_repeats(policy, rate, measured_runs)
            log(format_case(case))
            cases.append(case)
    median = {k: _median([c.error[k] for c in cases]) for k in METRICS}
    ordering: dict[str, dict[str, float]] = {}
    matches = None
    if real_compare is not None:
        from loadtest.compare import CompareResult

        real = CompareResult.model_validate_json(Path(real_compare).read_text())
        ordering["real"] = {p: real.variants[p].crossing_rate for p in policies if p in real.variants}
        sim_load = LoadConfig(rate=1.0, duration_s=load.duration_s, drain_s=load.drain_s, domains=load.domains, seed=seed)
        ordering["sim"] = {p: simulate_capacity(variant_fleet(base, SIM_VARIANTS[p], real.slo), sim_load, real.slo, 4.0, seed).crossing_rate
                           for p in ordering["real"]}
        matches = ordering_matches(ordering["real"], ordering["sim"])
    return ValidateResult(profile=str(profile), traces=str(traces), replicas=replicas, slo=slo, host=host, median_error=median,
                          ordering_matches=matches, ordering=ordering, cases=cases)


def format_case(c: Case) -> str:
    def f(v):
        return "-" if v is None else f"{v:.3g}"

    cells = "  ".join(f"{k} {f(c.real[k])}/{f(c.sim[k])} ({'-' if c.error[k] is None else f'{c.error[k]:.0%}'})" for k in METRICS)
    return f"{c.policy:>7} @ {c.rate:g} req/s ({c.requests} requests), real/simulated (error): {cells}"
