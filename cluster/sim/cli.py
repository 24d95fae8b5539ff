"""`forespark simulate ...`: the fleet simulator's commands (registered by `cluster/cli.py`).

    forespark simulate profiles                    the cost profiles by name
    forespark simulate run --rate R [--json P]     one simulated load test: the load test's report
    forespark simulate compare [--json P]          capacity per variant, ratios as `forespark compare` writes them
    forespark simulate sweep [--json P]            throughput at matched per-request rate over concurrency
    forespark simulate bench [--json P]            simulated requests per wall second at a fleet size
    forespark simulate validate [--json P]         the real CPU deployment against the simulator, same arrivals
    forespark simulate autoscale [--json P]        the headroom autoscaling policy against Serve's default
    forespark simulate overload --capacity R       goodput at multiples of a capacity with admission on
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cluster.sim.profiles import DEFAULT_PROFILE


def _write(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")


def _slo(args: argparse.Namespace):
    """The SLO file with the thresholds given on the command line."""
    from loadtest.config import SLOConfig

    given = {k: v for k, v in (("ttft_ms", args.ttft_ms), ("tpot_ms", args.tpot_ms), ("attainment_target", args.target)) if v is not None}
    return SLOConfig.model_validate({**SLOConfig.load(args.slo).model_dump(), **given})


def _inputs(args: argparse.Namespace, rate: float):
    """The fleet, load and SLOs the command line describes; a value out of range ends the command (exit 2)."""
    from pydantic import ValidationError

    try:
        return _fleet_load_slo(args, rate)
    except ValidationError as e:
        print(f"forespark simulate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _fleet_load_slo(args: argparse.Namespace, rate: float):
    from cluster.admission import AdmissionConfig
    from cluster.sim.engine import EngineSpec
    from cluster.sim.fleet import FleetConfig, FleetDescription, LoadConfig
    from loadtest.config import Shape

    slo = _slo(args)
    shape = Shape(kind=args.shape, step_s=args.step_s, step_rate=args.step_rate, burst_at_s=args.burst_at_s,
                  burst_s=args.burst_s, burst_rate=args.burst_rate)
    load = LoadConfig(rate=rate, duration_s=args.duration, drain_s=args.drain, shape=shape, domains=args.domains,
                      max_tokens=args.max_tokens, seed=args.seed, long_prompts=args.long_prompts)
    admission = AdmissionConfig(ttft_ms=slo.ttft_ms or 1000.0, tpot_ms=slo.tpot_ms) if args.admission else None
    engine = EngineSpec(max_num_seqs=args.max_num_seqs, tpot_slo_ms=slo.tpot_ms or EngineSpec().tpot_slo_ms)
    groups = FleetDescription.load(args.fleet).groups if args.fleet else None
    host = {}
    if getattr(args, "host_from", None):  # CPU replicas sharing their host with the serving path, as a validation fitted it
        from cluster.sim.validate import ValidateResult

        fit = ValidateResult.model_validate_json(Path(args.host_from).read_text()).host
        host = fit.fleet_update(refusal_cpu_ms=args.refusal_cpu_ms)
    fleet = FleetConfig(replicas=args.replicas, profile=args.profile, acceptance=args.acceptance, engine=engine, groups=groups,
                        traces=Path(args.traces) if args.traces else None,
                        max_ongoing_requests=args.max_num_seqs, admission=admission, ingresses=args.ingresses,
                        stats_period_s=args.stats_period, workers=_workers(args, groups, host), **host)
    return fleet, load, slo


def _workers(args: argparse.Namespace, groups, host: dict) -> int:
    """`--workers`, or by default one per CPU for fleets of 8 replicas or more (none with a host model)."""
    if getattr(args, "workers", None) is not None:
        return args.workers
    replicas = sum(g.count for g in groups) if groups else args.replicas
    return (os.cpu_count() or 1) if replicas >= 8 and not host else 0


def _label(fleet) -> str:
    from cluster.sim.acceptance import ACCEPTANCE_MODELS
    from cluster.sim.profiles import load_profile

    accept = (f"acceptance replayed from {fleet.traces}" if fleet.traces else
              f"acceptance model {fleet.acceptance} ({ACCEPTANCE_MODELS[fleet.acceptance].source})")
    if fleet.groups:
        names = dict.fromkeys(g.profile for g in fleet.groups)
        groups = ", ".join(f"{g.count} x {g.profile}{'' if g.drafter else ' without a drafter'}" for g in fleet.groups)
        costs = "; ".join(f"{name}: {load_profile(name).source}" for name in names)
        return f"SIMULATED: fleet of {groups} (cost profiles {costs}); {accept}"
    return f"SIMULATED: cost profile {fleet.profile} ({load_profile(fleet.profile).source}); {accept}"


def _sensitivity(args: argparse.Namespace, fleet, run) -> dict | None:
    """With --sensitivity: `run(fleet)` at every corner of the roofline parameters' plausible box
    (`profiles.SENSITIVITY`); each ratio's band (min, max) over the corners and the nominal run."""
    if not getattr(args, "sensitivity", False):
        return None
    from cluster.sim.profiles import SENSITIVITY, sensitivity_corners

    corners = []
    for corner in sensitivity_corners():
        print(f"sensitivity corner {corner}", flush=True)
        corners.append({"efficiency": corner, "ratios": run(fleet.model_copy(update={"efficiency": corner})).ratios})
    return {"box": {k: list(v) for k, v in SENSITIVITY.items()}, "corners": corners}


def _band(nominal: dict, sensitivity: dict | None) -> dict[str, list[float]]:
    if sensitivity is None:
        return {}
    out = {}
    for key, value in nominal.items():
        values = [v for v in [value, *(c["ratios"].get(key) for c in sensitivity["corners"])] if v is not None]
        if values:
            out[key] = [min(values), max(values)]
    return out


def cmd_profiles(args: argparse.Namespace) -> int:
    from cluster.sim.profiles import profiles

    print(f"{'name':<14} {'K':>3} {'1 req ms':>9} {'64 req ms':>9} {'256 req ms':>10} {'launch ms':>9}  source")
    for name, p in profiles().items():
        c = p.cost
        print(f"{name:<14} {p.k:>3} {c.step_ms(1, 0, 1):>9.2f} {c.step_ms(64, 0, 64):>9.2f} {c.step_ms(256, 0, 256):>10.2f} "
              f"{c.launch_ms(1):>9.2f}  {p.source[:90]}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from cluster.sim.compare import VARIANTS, variant_fleet
    from cluster.sim.fleet import Fleet
    from loadtest.report import build_report, format_report, plot_report

    fleet, load, slo = _inputs(args, args.rate)
    fleet = variant_fleet(fleet, VARIANTS[args.variant], slo)
    print(_label(fleet))
    sim = Fleet(fleet, seed=args.seed)
    rows = sim.run(load, progress=True)
    report = build_report(rows, slo, load.rate, load.duration_s)
    print(format_report(report))
    if args.png:
        plot_report(rows, report, Path(args.png))
        print(f"wrote {args.png}")
    _write(args.json, {"simulated": True, "profile": fleet.profile, "acceptance": fleet.acceptance,
                       "variant": args.variant, "replicas": fleet.replicas, "router_decisions": sim.decisions,
                       **report.model_dump(mode="json")})
    return 0


def cmd_autoscale(args: argparse.Namespace) -> int:
    from cluster.sim.autoscaler import SimAutoscaling
    from cluster.sim.compare import VARIANTS, variant_fleet
    from cluster.sim.scaling import simulate_scaling

    fleet, load, slo = _inputs(args, args.rate)
    fleet = variant_fleet(fleet, VARIANTS["wcs"], slo)
    print(_label(fleet))
    from cluster.autoscale import HeadroomScaling

    low, high = (float(x) for x in args.headroom_band.split(","))
    headroom = HeadroomScaling(target=args.headroom_target, scale_down_below=low, scale_up_above=high)
    scaling = SimAutoscaling(min_replicas=args.min_replicas, max_replicas=args.max_replicas or fleet.replicas, headroom=headroom,
                             startup_s=args.startup_s, upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s)

    def shown(row) -> None:
        print(f"{row.variant:>24}: attainment {row.attainment:.1%} (worst window {row.worst_window_attainment:.1%}), "
              f"goodput {row.goodput_rps:.1f} req/s, {row.replica_seconds:.0f} replica-seconds, at most {row.most_replicas} replicas",
              flush=True)

    targets = [float(t) for t in args.target_ongoing.split(",") if t]
    result = simulate_scaling(fleet, load, slo, scaling, targets, progress=True, on_row=shown)
    for key, value in result.ratios.items():
        print(f"{key}: {value:.2f}x replica-seconds")
    _write(args.json, result.model_dump(mode="json"))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from cluster.sim.compare import simulate_compare

    fleet, load, slo = _inputs(args, args.start_rate)
    print(_label(fleet))
    names = [n.strip() for n in args.variants.split(",")]

    def shown(name, v) -> None:
        print(f"{name:>10} {v.policy:>7} {v.router:>9} sustainable {v.max_rate:.3g} req/s (crossing {v.crossing_rate:.3g}); "
              f"per seed {v.max_rates}", flush=True)

    seeds = list(range(args.seed, args.seed + args.seeds))
    result = simulate_compare(fleet, load, slo, names, args.start_rate, seeds, shown)
    sensitivity = _sensitivity(args, fleet, lambda f: simulate_compare(f, load, slo, names, args.start_rate, seeds))
    band = _band(result.ratios, sensitivity)
    for key, value in result.ratios.items():
        extra = f" (sensitivity band {band[key][0]:.2f}-{band[key][1]:.2f})" if key in band else ""
        print(f"{key}: {'-' if value is None else f'{value:.2f}x'}{extra}")
    if args.png:
        from loadtest.capacity import plot_capacity

        plot_capacity({name: v.capacity for name, v in result.variants.items()}, Path(args.png))
        print(f"wrote {args.png}")
    _write(args.json, {**result.model_dump(mode="json"), "sensitivity": sensitivity, "band": band})
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from cluster.sim.sweep import simulate_sweep

    fleet, _, _ = _inputs(args, 1.0)
    print(_label(fleet))
    names = [n.strip() for n in args.variants.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]

    def shown(r) -> None:
        print(f"{r.policy:>14} c={r.concurrency:<4} {r.tokens_per_s:>9.0f} tok/s per replica, {r.per_request_rate:>7.1f} tok/s "
              f"per request, accepted length {r.mean_accepted_length:.2f}, draft waste {r.draft_waste:.0%}", flush=True)

    result = simulate_sweep(fleet, names, concurrency, args.duration, args.seed, shown)
    sensitivity = _sensitivity(args, fleet, lambda f: simulate_sweep(f, names, concurrency, args.duration, args.seed))
    band = _band(result.ratios, sensitivity)
    for key, value in result.ratios.items():
        rate = result.matched_rate[key]
        extra = f" (sensitivity band {band[key][0]:.2f}-{band[key][1]:.2f})" if key in band else ""
        print(f"{key}: {'-' if value is None else f'{value:.2f}x'} at {'-' if rate is None else f'{rate:.0f}'} tok/s per request{extra}")
    print("wcs over the best other, per concurrency: " + ", ".join(
        f"{c}: {'-' if v is None else f'{v:.2f}'}" for c, v in result.wcs_vs_best.items()))
    _write(args.json, {**result.model_dump(mode="json"), "sensitivity": sensitivity, "band": band})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from cluster.sim.compare import VARIANTS, variant_fleet
    from cluster.sim.fleet import Fleet
    from loadtest.report import build_report

    fleet, load, slo = _inputs(args, args.rate)
    fleet = variant_fleet(fleet, VARIANTS[args.variant], slo)
    print(_label(fleet))
    t0 = time.perf_counter()
    sim = Fleet(fleet, seed=args.seed)
    rows = sim.run(load, progress=True)
    wall = time.perf_counter() - t0
    steps = sum(e.steps for e in sim.engines)
    out = {"simulated": True, "profile": fleet.profile, "replicas": fleet.replicas, "rate": load.rate,
           "sim_seconds": load.duration_s, "workers": fleet.workers, "wall_s": wall, "requests": len(rows), "steps": steps,
           "sim_requests_per_wall_s": len(rows) / wall, "wall_ms_per_step": 1e3 * wall / max(steps, 1),
           "planner_ms_per_step": 1e3 * sum(e.plan_s for e in sim.engines) / max(steps, 1),
           "route_ms_per_request": 1e3 * sim.route_s / max(len(rows), 1)}
    report = build_report(rows, slo, load.rate, load.duration_s)  # what the simulated fleet served
    out["served"] = report.model_dump(mode="json", include={"attainment", "goodput_rps", "request_throughput_rps",
                                                             "tpot_ms", "ttft_ms"})
    print(f"{len(rows)} requests, {steps} engine steps in {wall:.1f} s wall ({fleet.workers} workers): "
          f"{out['sim_requests_per_wall_s']:.0f} simulated requests per wall second, {out['wall_ms_per_step']:.3f} ms per "
          f"engine step, {out['planner_ms_per_step']:.3f} ms of it in the planner (in the engines' processes), "
          f"{out['route_ms_per_request']:.3f} ms per request routing; simulated SLO attainment {report.attainment:.1%}")
    _write(args.json, out)
    return 0


def cmd_overload(args: argparse.Namespace) -> int:
    import yaml
    from tqdm import tqdm

    from cluster.sim.compare import VARIANTS, variant_fleet
    from cluster.sim.overload import simulate_overload
    from loadtest.overload import format_overload

    args.admission = True
    fleet, load, slo = _inputs(args, args.capacity)
    fleet = variant_fleet(fleet, VARIANTS[args.variant], slo)
    try:
        settings = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.admission_set)}
        admission = fleet.admission.model_validate({**fleet.admission.model_dump(), **settings})
    except ValueError as e:  # a setting without "=", an unknown key, a bad value (pydantic's errors are ValueErrors)
        print(f"error: --admission-set takes KEY=VALUE of router.admission's settings: {e}", file=sys.stderr)
        return 2
    fleet = fleet.model_copy(update={"admission": admission})
    print(_label(fleet))
    multiples = [float(m) for m in args.multiples.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    with tqdm(total=len(seeds) * len(multiples), desc="simulate overload", unit="run") as bar:
        result = simulate_overload(fleet, load, slo, args.capacity, multiples, seeds, progress=bar.update)
    for run in result.runs:
        print(f"seed {run.seed} (SIMULATED)\n{format_overload(run)}")
    m = result.median
    print(f"medians over {len(seeds)} seeds: admission cost at 1x {m['admission_cost_1x']:.1%}; " + "; ".join(
        f"{k}x goodput {m['goodput_of_1x'][k]:.2f} of 1x, admitted attainment {m['attainment_admitted'][k]:.1%}"
        for k in m["goodput_of_1x"]))
    _write(args.json, result.model_dump(mode="json"))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from cluster.sim.validate import ValidateResult, validate
    from loadtest.config import LoadTestConfig

    slo = _slo(args)
    load = LoadTestConfig(url="http://127.0.0.1", rate=1.0, duration_s=args.duration, drain_s=args.drain, domains=args.domains,
                          max_tokens=args.max_tokens, seed=args.seed, processes=args.processes)
    rates = [float(r) for r in args.rates.split(",")]
    policies = [p.strip() for p in args.policies.split(",")]
    try:
        result = validate(policies, rates, load, slo, replicas=args.replicas, port=args.port, seed=args.seed,
                          real_compare=Path(args.real_compare) if args.real_compare else None, calibration_rate=args.calibration_rate,
                          calibration_policy=args.calibration_policy, work=Path(args.reuse) if args.reuse else None,
                          host=ValidateResult.model_validate_json(Path(args.host_from).read_text()).host if args.host_from else None,
                          profile=args.profile, fresh_profile=args.fresh_profile, repeats=args.repeats)
    except ValueError as e:  # (--fresh-profile with nothing to measure, a profile that does not fit the traces)
        print(f"forespark simulate validate: {e}", file=sys.stderr)
        return 2
    print("median relative error: " + ", ".join(f"{k} {'-' if v is None else f'{v:.1%}'}" for k, v in result.median_error.items()))
    if result.ordering_matches is not None:
        print(f"sustainable-rate ordering (crossing rates) real {result.ordering['real']}, simulated {result.ordering['sim']}: "
              f"{'matches' if result.ordering_matches else 'DOES NOT match'}")
    _write(args.json, result.model_dump(mode="json"))
    return 0


def add_parser(sub) -> None:
    from cluster.sim.acceptance import ACCEPTANCE_MODELS
    from cluster.sim.compare import VARIANTS
    from loadtest.config import LongPrompts

    def domain_weights(text: str) -> dict[str, float]:
        try:
            return {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected e.g. code=1,prose=1, got {text!r}") from None

    def common(p: argparse.ArgumentParser, duration: float) -> None:
        p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"cost profile (default {DEFAULT_PROFILE}; see `simulate profiles`)")
        p.add_argument("--acceptance", default="dflash-qwen3-8b", choices=sorted(ACCEPTANCE_MODELS), help="acceptance model")
        p.add_argument("--traces", metavar="PATH", help="replay these recorded acceptance traces instead (e.g. the embedded "
                       "pair's replicas/models/weights/traces.npz, with --profile cpu-embedded)")
        p.add_argument("--replicas", type=int, default=2)
        p.add_argument("--fleet", metavar="PATH", help="a heterogeneous fleet (manifests/fleets/*.yaml); replaces --replicas and --profile")
        p.add_argument("--max-num-seqs", type=int, default=64, help="each engine's batch (and Serve's max_ongoing_requests)")
        p.add_argument("--host-from", metavar="PATH", help="CPU replicas: the host model (cores shared with the serving path, "
                       "HTTP time per request) fitted by a `simulate validate` JSON, e.g. results/sim/validate.json")
        p.add_argument("--refusal-cpu-ms", type=float, default=0.0, metavar="MS", help="with --host-from: the serving path's "
                       "CPU per refused request, which the validation does not fit (docs/overload.md; default 0)")
        p.add_argument("--admission", action="store_true", help="SLO-aware admission at the ingress (cluster/admission.py)")
        p.add_argument("--ingresses", type=int, default=1, help="ingress replicas routing at once, each with its own in-flight "
                       "accounting (variant wcs-local-count: without the router's extrapolation to the others)")
        p.add_argument("--stats-period", type=float, default=1.0, help="seconds between the replicas' routing stats")
        p.add_argument("--workers", type=int, default=None, help="processes the engines step in, the same results (default: one "
                       "per CPU from 8 replicas; 0: in the simulator's own process)")
        p.add_argument("--duration", type=float, default=duration, help=f"simulated seconds of arrivals (default {duration:g})")
        p.add_argument("--drain", type=float, default=60.0, help="simulated seconds requests in flight may run after the arrivals stop")
        p.add_argument("--slo", metavar="PATH", help="SLO YAML (default loadtest/slo.yaml)")
        p.add_argument("--ttft-ms", type=float)
        p.add_argument("--tpot-ms", type=float)
        p.add_argument("--target", type=float, help="SLO attainment target (0-1)")
        p.add_argument("--domains", type=domain_weights, default={"code": 1.0, "prose": 1.0}, help="workload mix, e.g. code=1,prose=1")
        p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default: each domain's)")
        p.add_argument("--long-prompts", type=LongPrompts.argument, default=None, metavar="SHARE:MEDIAN[:SIGMA]",
                       help="skewed prompt lengths, as `forespark loadtest --long-prompts`, e.g. 0.1:2000")
        p.add_argument("--shape", choices=("constant", "step", "burst"), default="constant")
        p.add_argument("--step-s", type=float, default=10.0)
        p.add_argument("--step-rate", type=float, default=1.0)
        p.add_argument("--burst-at-s", type=float, default=10.0)
        p.add_argument("--burst-s", type=float, default=5.0)
        p.add_argument("--burst-rate", type=float, default=0.0)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", metavar="PATH", help="write the JSON result here")
        p.add_argument("--png", metavar="PATH", help="run: latency CDFs and attainment over time; compare: attainment and "
                       "goodput against rate per variant")

    sim = sub.add_parser("simulate", help="the fleet simulator: the real WCS controller and router over modelled engines")
    ss = sim.add_subparsers(dest="simulate", required=True)
    prof = ss.add_parser("profiles", help="list the cost profiles")
    prof.set_defaults(func=cmd_profiles)
    run = ss.add_parser("run", help="one simulated load test at a rate (the load test's report)")
    run.add_argument("--rate", type=float, required=True)
    run.add_argument("--variant", default="wcs", choices=sorted(VARIANTS))
    common(run, 60.0)
    run.set_defaults(func=cmd_run)
    scale = ss.add_parser("autoscale", help="the headroom autoscaling policy against Serve's default (replica-seconds, attainment)")
    scale.add_argument("--rate", type=float, required=True, help="base request rate (req/s) of the load shape")
    scale.add_argument("--target-ongoing", default="64,128", help="Serve default policy's target_ongoing_requests values to run")
    scale.add_argument("--headroom-target", type=float, default=0.6, help="utilisation the headroom policy scales to")
    scale.add_argument("--headroom-band", default="0.4,0.75", help="utilisation band inside which the headroom policy holds")
    scale.add_argument("--min-replicas", type=int, default=1)
    scale.add_argument("--max-replicas", type=int, default=None, help="default: --replicas")
    scale.add_argument("--startup-s", type=float, default=30.0, help="from a replica's start to its first request")
    scale.add_argument("--upscale-delay-s", type=float, default=10.0)
    scale.add_argument("--downscale-delay-s", type=float, default=60.0)
    common(scale, 180.0)
    scale.set_defaults(func=cmd_autoscale)
    cmp_ = ss.add_parser("compare", help="capacity of each variant and their ratios (forespark compare's JSON)")
    cmp_.add_argument("--variants", default="wcs,dspark,ar,wcs-pow2", help=f"from {','.join(VARIANTS)}")
    cmp_.add_argument("--start-rate", type=float, default=8.0)
    cmp_.add_argument("--seeds", type=int, default=1, help="searches per variant, seeds from --seed (medians reported)")
    cmp_.add_argument("--sensitivity", action="store_true", help="repeat at every corner of the roofline parameters' range; report each ratio's band")
    common(cmp_, 30.0)
    cmp_.set_defaults(func=cmd_compare)
    sweep = ss.add_parser("sweep", help="throughput per replica over concurrency, wcs against the others at matched per-request rate")
    sweep.add_argument("--variants", default="wcs,dspark,vllm-adaptive,ar", help=f"from {','.join(VARIANTS)}")
    sweep.add_argument("--concurrency", default="1,4,16,64,256", help="requests in flight per replica")
    sweep.add_argument("--sensitivity", action="store_true", help="repeat at every corner of the roofline parameters' range; report each ratio's band")
    common(sweep, 10.0)
    sweep.set_defaults(func=cmd_sweep, replicas=1, max_num_seqs=256)
    val = ss.add_parser("validate", help="run the real CPU deployment and the simulator on the same arrivals; report the errors")
    val.add_argument("--policies", default="wcs,dspark,ar")
    val.add_argument("--rates", default="2,5,8", help="request rates, light load to past the knee (req/s)")
    val.add_argument("--replicas", type=int, default=2)
    val.add_argument("--duration", type=float, default=30.0)
    val.add_argument("--drain", type=float, default=60.0)
    val.add_argument("--domains", type=domain_weights, default={"code": 1.0, "prose": 1.0})
    val.add_argument("--max-tokens", type=int, default=None)
    val.add_argument("--processes", type=int, default=1, help="Locust worker processes")
    val.add_argument("--slo", metavar="PATH")
    val.add_argument("--ttft-ms", type=float)
    val.add_argument("--tpot-ms", type=float)
    val.add_argument("--target", type=float)
    val.add_argument("--seed", type=int, default=0)
    val.add_argument("--port", type=int, default=8100, help="the real servers' port")
    val.add_argument("--calibration-rate", type=float, default=None, help="the real run the host overheads are fitted on "
                     "(another seed; default the middle rate)")
    val.add_argument("--calibration-policy", default=None, help="the policy of that run (default ar when validated, else the first)")
    val.add_argument("--host-from", metavar="PATH", help="take the host model from an earlier validation's JSON (no calibration run)")
    val.add_argument("--reuse", metavar="DIR", help="a folder of real runs (an earlier validation's, e.g. results/sim/validate-real): "
                     "runs found there are read, missing ones measured into it")
    val.add_argument("--profile", metavar="NAME|PATH", help="the replicas' step-cost profile (default: the one stored with the "
                     "real runs in the --reuse folder, else this host's, copied there)")
    val.add_argument("--fresh-profile", action="store_true", help="remove this host's cached profile of the replicas first, so "
                     "the first real server profiles its engine afresh (quiet host)")
    val.add_argument("--repeats", type=int, default=1, help="real runs per case and for the calibration, seeds one apart; "
                     "medians compared (a single run on a shared host can be 10-50%% off the next)")
    val.add_argument("--real-compare", metavar="PATH", help="a `forespark compare` JSON whose policy ordering the simulator must match")
    val.add_argument("--json", metavar="PATH")
    val.set_defaults(func=cmd_validate)
    over = ss.add_parser("overload", help="goodput under overload with admission on, as `forespark overload` reports it")
    over.add_argument("--capacity", type=float, required=True, help="the sustainable rate (req/s) the multiples scale")
    over.add_argument("--multiples", default="1,2,4")
    over.add_argument("--seeds", default=None, help="e.g. 0,1,2 (default --seed): each a run of every multiple, medians reported")
    over.add_argument("--variant", default="wcs", choices=sorted(VARIANTS))
    over.add_argument("--admission-set", action="append", default=[], metavar="KEY=VALUE",
                      help="an admission setting (router.admission's keys, e.g. trust=0.25), repeatable")
    common(over, 30.0)
    over.set_defaults(func=cmd_overload)
    bench = ss.add_parser("bench", help="simulator speed: simulated requests per wall second")
    bench.add_argument("--rate", type=float, default=100.0)
    bench.add_argument("--variant", default="wcs", choices=sorted(VARIANTS))
    common(bench, 10.0)
    bench.set_defaults(func=cmd_bench)

