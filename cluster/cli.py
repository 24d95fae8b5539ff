"""The `forespark` command line.

    forespark serve [--port 8000]        serve the OpenAI API on Ray Serve (what `make serve` runs)
    forespark serve --dry-run [--assume-gpus N]   the configuration it would serve on this (or an N-GPU) host
    forespark demo                       offline planner demo (no server)
    forespark bench planner [--json P]   decision time of the WCS planner per engine step
    forespark bench engine [--json P]    every policy on one WCS vLLM engine, matched-rate throughput ratios
    forespark bench router [--json P]    decision time of the cluster router at 8..256 replicas
    forespark loadtest --url U --rate R  Locust SLO load test at a request rate (JSON report + PNG)
    forespark capacity --url U           highest request rate meeting the SLOs (doubling, then bisection)
    forespark compare                    capacity per policy / router, each on its own application, probes in turns
    forespark overload --url U           goodput and refusals at multiples of the sustainable rate
    forespark manifests check [PATH...]  validate the ray up, Serve, KubeRay manifests and the Grafana dashboard offline
    forespark manifests fleet FLEET [--base P] [--out P] [--args-only]   a fleet description as a Serve config
    forespark models build [--check]     train the embedded target + drafter (--spec, --checkpoint-dir, --resume)
    forespark models checkpoint PATH     describe a build checkpoint (--compact FILE: the committable form)
    forespark models progress DIR        a build's held-out curve and its extrapolation to the perplexity targets
    forespark models evaluate CHECKPOINT   a drafter-phase checkpoint evaluated mid-training
    forespark models bench [--temperature T] [--weights DIR] [--json P]
                                         drafter acceptance per domain and width through vLLM
    forespark models traces [--out P]    record acceptance traces through vLLM; score the estimators on them
    forespark models workloads           rewrite the shipped workload prompts from held-out text
    forespark simulate profiles|run|compare|sweep|bench|validate|autoscale   the fleet simulator (cluster/sim/): simulated figures
    forespark results check              docs/results.md against the JSON it cites
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.app import AppConfig


def _policy_list(text: str) -> tuple[str, ...]:
    engine_policies = ("ar", "static", "dspark", "wcs")
    names = tuple(v.strip() for v in text.split(","))
    bad = [n for n in names if n not in engine_policies]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {','.join(engine_policies)}")
    return names


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def cmd_bench_planner(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from scheduling import benchmark

    rounds = 5
    with tqdm(total=len(args.batches) * len(args.ks) * rounds, desc="planner bench", unit="config") as bar:
        result = benchmark.run(args.batches, args.ks, reps=args.reps, rounds=rounds, progress=lambda _c: bar.update())
    print(benchmark.format_table(result))
    _write_json(args.json, result.model_dump())
    return 0


def load_app_config(path: str | None, overrides: dict[str, dict], host=None) -> AppConfig:
    """The application config from a YAML/JSON file, with command-line values (where given) on top and the
    host's defaults (cluster/host.py; default: this machine) under both."""
    from cluster import host as hosts

    return hosts.load_app_config(path, overrides, host or hosts.HostDescription.detect())


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from cluster.app import build_app
    from cluster.host import HostDescription, print_dry_run
    from cluster.serve_env import serve_environment
    from replicas.engine import cpu_engine_environment

    cpu_engine_environment()
    serve_environment()  # a cluster joined with --address has its own, from `ray start` (see the manifests)
    try:
        host = HostDescription.detect() if args.assume_gpus is None else HostDescription.assume(args.assume_gpus)
        config = load_app_config(
            args.config, {"ingress": {"api_key": args.api_key}, "replica": {"num_replicas": args.replicas}, "router": {"kind": args.router}},
            host,
        )
    except (ValueError, OSError) as e:
        print(f"forespark serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_dry_run(config, host)
        return 0

    import ray
    from ray import serve

    stop = threading.Event()
    own_ray = args.address is None
    if own_ray:
        from cluster.serve_env import local_ray_environment

        local_ray_environment()
        ray.init(include_dashboard=False, configure_logging=False, _metrics_export_port=args.metrics_export_port)
    else:
        ray.init(address=args.address, include_dashboard=False, configure_logging=False)
    # After ray.init: Ray's own failure handler would otherwise take SIGTERM and abort the process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(
            f"starting {config.replica.num_replicas} {config.replica.accelerator.upper()} engine replica(s), router {config.router.kind}; "
            "the first start profiles each engine's step cost",
            flush=True,
        )
        serve.run(build_app(config), name="forespark", route_prefix="/")
        from cluster.ingress import node_metrics_url

        print(
            f"serving the OpenAI API at http://{args.host}:{args.port}/v1 (model {config.replica.served_model_name!r}); "
            f"metrics: this node's Ray metrics agent at {node_metrics_url()} (ForeSpark's series also at /metrics); "
            "Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(1.0):  # a timed wait: a signal that reaches another thread is still seen
            pass
        print("stopping", flush=True)
    finally:
        if own_ray:
            serve.shutdown()
            ray.shutdown()
        else:  # stop only what this command started
            serve.delete("forespark")
    return 0


def _domain_weights(text: str) -> dict[str, float]:
    try:
        pairs = [item.split("=") if "=" in item else (item, "1") for item in text.split(",")]
        return {name.strip(): float(weight) for name, weight in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected domain=weight,..., got {text!r}") from None


def _positive_floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _load_config(args: argparse.Namespace, url: str, rate: float):
    from loadtest.config import LoadTestConfig, Shape

    shape = Shape(kind=args.shape, step_s=args.step_s, step_rate=args.step_rate, burst_at_s=args.burst_at_s,
                  burst_s=args.burst_s, burst_rate=args.burst_rate)
    return LoadTestConfig(
        url=url.rstrip("/"), model=args.model, api_key=args.api_key, rate=rate, duration_s=args.duration,
        drain_s=args.drain, arrivals=args.arrivals, shape=shape, domains=args.domains, max_tokens=args.max_tokens,
        processes=args.processes, seed=args.seed, out_dir=Path(args.out), long_prompts=args.long_prompts,
        temperature=args.temperature,
    )


def _slo(args: argparse.Namespace):
    from loadtest.config import SLOConfig

    slo = SLOConfig.load(args.slo)
    given = {k: v for k, v in (("ttft_ms", args.ttft_ms), ("tpot_ms", args.tpot_ms), ("e2e_ms", args.e2e_ms), ("attainment_target", args.target)) if v is not None}
    return SLOConfig.model_validate({**slo.model_dump(), **given})


def _load_inputs(args: argparse.Namespace, url: str, rate: float):
    """The load-test config and the SLOs, or None after saying why (the command then exits 2)."""
    try:
        return _load_config(args, url, rate), _slo(args)
    except (ValueError, OSError) as e:
        print(f"forespark {args.command}: {e}", file=sys.stderr)
        return None


def cmd_loadtest(args: argparse.Namespace) -> int:
    from loadtest.run import format_report, run_loadtest

    if (inputs := _load_inputs(args, args.url, args.rate)) is None:
        return 2
    config, slo = inputs
    report = run_loadtest(config, slo)
    print(format_report(report))
    print(f"wrote {config.out_dir / 'report.json'}, {config.out_dir / 'report.png'} and the per-request rows (requests-*.csv)")
    _write_json(args.json, report.model_dump(mode="json"))
    return 0


def _refusal_cpu(args: argparse.Namespace) -> int:
    """`forespark overload --refusal-cpu`: the host CPU one refused request takes (loadtest/refusal_cpu.py)."""
    import httpx

    from loadtest.refusal_cpu import measure_refusal_cpu

    if args.refusal_requests < 1:
        print("forespark overload: error: --refusal-requests must be at least 1", file=sys.stderr)
        return 2
    try:
        result = measure_refusal_cpu(args.url, args.model, args.api_key, requests=args.refusal_requests)
    except (RuntimeError, OSError, httpx.HTTPError) as e:
        print(f"forespark overload: {args.url}: {e}", file=sys.stderr)
        return 1
    print(f"{result.refused} refusals in {result.seconds:.1f} s: host busy {result.busy_cores:.2f} cores against "
          f"{result.baseline_cores:.2f} idle; {result.refusal_cpu_ms:.2f} ms of CPU per refusal "
          "(simulate ... --refusal-cpu-ms)")
    _write_json(args.json or str(Path(args.out) / "refusal_cpu.json"), result.model_dump(mode="json"))
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from loadtest.capacity import capacity, format_path, format_probe, plot_capacity

    if (inputs := _load_inputs(args, args.url, args.start_rate)) is None:
        return 2
    base, slo = inputs
    result = capacity(base, slo, args.start_rate, args.bisect_steps, on_probe=lambda p: print(format_probe(p), flush=True))
    print(format_path(result))
    plot_capacity({"server": result}, Path(args.out) / "capacity.png")
    print(f"wrote {Path(args.out) / 'capacity.png'}")
    _write_json(args.json or str(Path(args.out) / "capacity.json"), result.model_dump(mode="json"))
    return 0


def cmd_overload(args: argparse.Namespace) -> int:
    from loadtest.capacity import capacity, format_probe
    from loadtest.overload import format_overload, measure_overload, off_row_from, with_off

    if args.refusal_cpu:
        return _refusal_cpu(args)
    try:
        multiples = [float(m) for m in args.multiples.split(",") if m]
    except ValueError:
        print(f"forespark overload: --multiples must be numbers, got {args.multiples!r}", file=sys.stderr)
        return 2
    if len(set(multiples)) != len(multiples):
        print(f"forespark overload: error: --multiples names a multiple twice ({args.multiples}); --repeats runs them again",
              file=sys.stderr)
        return 2
    if args.warmup < 0:
        print("forespark overload: --warmup must be >= 0", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("forespark overload: error: --repeats must be at least 1", file=sys.stderr)
        return 2
    if (inputs := _load_inputs(args, args.url, args.capacity or args.start_rate)) is None:
        return 2
    base, slo = inputs
    try:
        off_earlier, off_repeats = off_row_from(Path(args.off_json)) if args.off_json else (None, 1)
    except (ValueError, OSError) as e:
        print(f"forespark overload: --off-json: {e}", file=sys.stderr)
        return 2
    rate = args.capacity or (off_earlier.rate if off_earlier else None)  # the earlier run's 1x rate is its capacity
    if rate is None:
        found = capacity(base.model_copy(update={"out_dir": Path(args.out) / "capacity"}), slo, args.start_rate,
                         args.bisect_steps, on_probe=lambda p: print(format_probe(p), flush=True))
        rate = found.max_rate
    if (args.off_json or args.off_url) and 1.0 not in multiples:  # admission's cost is read at 1x
        multiples.insert(0, 1.0)
    result, rc = measure_overload(base, slo, multiples, rate, args.warmup, args.off_url, repeats=args.repeats), 0
    if off_earlier is not None:
        try:
            result = with_off(result, off_earlier, args.off_json, off_repeats)
        except ValueError as e:  # the rows measured here are still written
            print(f"forespark overload: --off-json: {e}", file=sys.stderr)
            rc = 1
    print(format_overload(result))
    _write_json(args.json or str(Path(args.out) / "overload.json"), result.model_dump(mode="json"))
    return rc


def cmd_compare(args: argparse.Namespace) -> int:
    import yaml

    from loadtest.capacity import plot_capacity
    from loadtest.compare import VARIANTS, compare, default_protocol, format_compare, local_servers, plot_tpot_sweep

    if args.repeats < 1:
        print("forespark compare: --repeats must be >= 1", file=sys.stderr)
        return 2
    if args.warmup < 0:
        print("forespark compare: --warmup must be >= 0", file=sys.stderr)
        return 2
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"forespark compare: unknown variants {unknown}; choose from {','.join(VARIANTS)}", file=sys.stderr)
        return 2
    try:
        from cluster.app import AppConfig

        base_app = (yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else {}
        AppConfig.model_validate(base_app)  # a bad file fails here, before any server starts
    except (ValueError, OSError) as e:
        print(f"forespark compare: {e}", file=sys.stderr)
        return 2
    if (inputs := _load_inputs(args, f"http://127.0.0.1:{args.port}", args.start_rate)) is None:
        return 2
    base, slo = inputs
    result = compare(base, slo, list(args.variants), base_app, local_servers(args.port), args.start_rate, args.bisect_steps, args.repeats,
                     warmup_s=args.warmup, protocol=args.protocol or default_protocol(base_app), tpot_sweep_ms=args.tpot_sweep)
    print(format_compare(result))
    plot_capacity({name: v.capacity for name, v in result.variants.items()}, Path(args.out) / "compare.png")
    print(f"wrote {Path(args.out) / 'compare.png'}")
    if result.tpot_sweep:
        plot_tpot_sweep(result, Path(args.out) / "tpot-sweep.png")
        print(f"wrote {Path(args.out) / 'tpot-sweep.png'}")
    _write_json(args.json or str(Path(args.out) / "compare.json"), result.model_dump(mode="json"))
    return 0


def _add_load_options(p: argparse.ArgumentParser, out: str, duration: float) -> None:
    from loadtest.config import LongPrompts

    p.add_argument("--duration", type=float, default=duration, help=f"seconds of arrivals per load test (default {duration:g})")
    p.add_argument("--drain", type=float, default=60.0, help="seconds requests in flight may run after the arrivals stop")
    p.add_argument("--slo", metavar="PATH", help="SLO YAML (default loadtest/slo.yaml)")
    p.add_argument("--ttft-ms", type=float, help="override the SLO file's TTFT threshold")
    p.add_argument("--tpot-ms", type=float, help="override the SLO file's TPOT threshold")
    p.add_argument("--e2e-ms", type=float, help="override the SLO file's E2E threshold")
    p.add_argument("--target", type=float, help="override the SLO attainment target (0-1)")
    p.add_argument("--model", default="forespark")
    p.add_argument("--api-key", default=None)
    p.add_argument("--domains", type=_domain_weights, default={"code": 1.0, "prose": 1.0}, help="workload mix, e.g. code=1,prose=1")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default: each domain's)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (default 0: "
                   "greedy; the OpenAI API's default is 1)")
    p.add_argument("--long-prompts", type=LongPrompts.argument, default=None, metavar="SHARE:MEDIAN[:SIGMA]",
                   help="skewed prompt lengths: SHARE of requests carry a context of lognormal length (MEDIAN tokens, "
                   "SIGMA the spread of its log, default 1), e.g. 0.1:2000")
    p.add_argument("--arrivals", choices=("poisson", "closed"), default="poisson", help="open-loop Poisson (default) or closed-loop users")
    p.add_argument("--shape", choices=("constant", "step", "burst"), default="constant")
    p.add_argument("--step-s", type=float, default=10.0, help="step shape: seconds per step")
    p.add_argument("--step-rate", type=float, default=1.0, help="step shape: req/s added per step")
    p.add_argument("--burst-at-s", type=float, default=10.0, help="burst shape: start of the burst")
    p.add_argument("--burst-s", type=float, default=5.0, help="burst shape: its length")
    p.add_argument("--burst-rate", type=float, default=0.0, help="burst shape: req/s during the burst")
    p.add_argument("--processes", type=int, default=1, help="Locust worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help=f"output folder (default {out})")
    p.add_argument("--json", metavar="PATH", help="also write the JSON result here")


def cmd_manifests_check(args: argparse.Namespace) -> int:
    from cluster.manifests import ManifestError, check_file, shipped_manifests

    paths = [Path(p) for p in args.paths] or shipped_manifests()
    failed = 0
    for path in paths:
        try:
            kind = check_file(path)
            print(f"ok    {path} ({kind})")
        except ManifestError as e:
            failed += 1
            print(f"FAIL  {path}: {e}")
    print(f"{len(paths) - failed} of {len(paths)} manifests valid")
    return 1 if failed else 0


def cmd_manifests_fleet(args: argparse.Namespace) -> int:
    import yaml

    from cluster.fleets import FleetDescription, serve_config
    from cluster.manifests import ManifestError, check_serve

    try:
        doc = serve_config(FleetDescription.load(args.fleet), yaml.safe_load(Path(args.base).read_text()))
        check_serve(doc)
    except (ValueError, ManifestError) as e:  # (pydantic's ValidationError is a ValueError)
        print(f"error: {e}", file=sys.stderr)
        return 1
    what = "Serve config"
    if args.args_only:  # the application's AppConfig: what `forespark serve --config` and `forespark compare --config` take
        doc, what = doc["applications"][0]["args"], "application config (AppConfig)"
    text = f"# {what} for the fleet {args.fleet}, from {args.base} (forespark manifests fleet)\n" + yaml.safe_dump(doc, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from scheduling.policies import PolicyName
    from scheduling.simulate import format_outcomes, simulate

    print("OFFLINE PLANNER DEMO: no server is started and no model runs.")
    print("Synthetic acceptances through the real planner and allocator, one table per load level.\n")
    for batch in args.batches:
        rows = simulate(list(PolicyName), batch=batch, k=args.k, steps=args.steps, seed=args.seed)
        print(f"batch {batch}, block size {args.k}:")
        print(format_outcomes(rows) + "\n")
    return 0


def _set_threads(threads: int | None) -> None:
    """One build thread count for torch, OpenMP/MKL and the tokenizer (set before they start their pools)."""
    if threads is None:
        return
    import os

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"
    import torch

    torch.set_num_threads(threads)


def cmd_models_build(args: argparse.Namespace) -> int:
    import tempfile

    _set_threads(args.threads)
    from replicas.models.build import WEIGHTS_DIR, BuildReport, Interrupted, build, compare_reports
    from replicas.models.spec import load_spec

    spec = load_spec(args.spec)
    out = Path(args.out) if args.out else (WEIGHTS_DIR if args.spec == "shipped" else WEIGHTS_DIR.parent / f"weights-{Path(args.spec).stem}")
    checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.resume and checkpoint_dir is None:
        print("--resume needs --checkpoint-dir", file=sys.stderr)
        return 2
    if not args.check:
        print(f"building spec {args.spec!r} into {out}" + (f", checkpoints in {checkpoint_dir} every {args.checkpoint_minutes:g} min" if checkpoint_dir else ""), flush=True)
        try:
            report = build(
                out, spec, reuse_target=args.reuse_target, checkpoint_dir=checkpoint_dir,
                checkpoint_minutes=args.checkpoint_minutes, resume=args.resume, resume_from=args.resume_from,
                estimate_only=args.estimate, log=lambda msg: print(msg, flush=True),
            )
        except Interrupted as e:
            print(f"interrupted: {e}; continue with the same command and --resume", file=sys.stderr)
            return 130
        if report is not None:
            print(report.model_dump_json(indent=2))
        return 0
    reference = BuildReport.model_validate_json((out / "build_report.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        rebuilt = build(Path(tmp), reference.spec, log=lambda msg: print(msg, flush=True))
    problems = compare_reports(reference, rebuilt)
    for domain, q in rebuilt.domains.items():
        ref = reference.domains[domain]
        print(
            f"{domain}: perplexity {q.perplexity:.2f} (shipped {ref.perplexity:.2f}), "
            f"mean accepted length {q.mean_accepted_length:.2f} (shipped {ref.mean_accepted_length:.2f})"
        )
    for p in problems:
        print(f"MISMATCH {p}", file=sys.stderr)
    print("rebuild matches the shipped models" if not problems else "rebuild differs from the shipped models")
    return 0 if not problems else 1


def cmd_models_checkpoint(args: argparse.Namespace) -> int:
    """Describe a build checkpoint, or write its compact (committable) form."""
    from replicas.models import checkpoint as ckpt

    src = Path(args.path)
    if src.is_dir():
        src = src / ckpt.STATE_FILE
    import torch

    raw = torch.load(src, map_location="cpu", weights_only=False)
    where = raw["phase"]
    for part in ("target", "drafter"):
        if raw["phase"] == part and isinstance(raw.get(part), dict) and "step" in raw[part]:
            where += f" step {raw[part]['step']}"
    print(f"{src}: {raw.get('kind')} checkpoint at {where}, {src.stat().st_size / 2**20:.1f} MiB, "
          f"seconds {', '.join(f'{k} {v:.0f}' for k, v in raw['seconds'].items())}")
    if args.compact:
        small = ckpt.compact(raw)
        ckpt.save(small, Path(args.compact))
        size = Path(args.compact).stat().st_size
        print(f"wrote {args.compact}: {size / 2**20:.1f} MiB (float16 weights, 8-bit log second moments, no first moments)")
        if size > 40 * 2**20:
            print("warning: over 40 MiB", file=sys.stderr)
    return 0


def cmd_models_evaluate(args: argparse.Namespace) -> int:
    from replicas.models import checkpoint as ckpt
    from replicas.models.build import evaluate_checkpoint

    path = Path(args.path)
    where, quality = evaluate_checkpoint(path / ckpt.STATE_FILE if path.is_dir() else path)
    print(f"{path}: {where}")
    for domain, q in quality.items():
        print(f"  {domain}: perplexity {q.perplexity:.2f}; offline survival of positions 1-4 greedy "
              + " ".join(f"{a:.2f}" for a in q.offline_acceptance[:4]) + f" (accepted length {q.mean_accepted_length:.2f}), T=1 "
              + " ".join(f"{a:.2f}" for a in q.offline_acceptance_t1[:4]) + f" ({1.0 + sum(q.offline_acceptance_t1):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint": str(path), "at": where,
                                               "domains": {d: q.model_dump() for d, q in quality.items()}}, indent=2) + "\n")
    return 0


def cmd_models_progress(args: argparse.Namespace) -> int:
    from replicas.models.progress import format_progress
    from replicas.models.spec import load_spec

    path = Path(args.path)
    path = path / "progress.jsonl" if path.is_dir() else path
    print(format_progress(path, load_spec(args.spec).train.target_steps if args.spec else None, min_step=args.min_step))
    return 0


def cmd_bench_router(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cluster import bench_router

    with tqdm(total=2 * len(args.replicas), desc="router bench", unit="variant") as bar:
        result = bench_router.run(args.replicas, decisions=args.decisions, progress=lambda _row: bar.update())
    print(bench_router.format_table(result))
    _write_json(args.json, result.model_dump())
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from replicas.engine import EngineConfig
    from replicas.wcs.bench import bench_engine_config, format_engine_bench, run_engine_bench

    result = run_engine_bench(
        engine_config=bench_engine_config(EngineConfig(), args.concurrency, args.draft_sampling),
        temperature=args.temperature,
        policies=args.policies,
        concurrency=args.concurrency,
        requests_per_slot=args.requests_per_slot,
        reps=args.reps,
        max_tokens=args.max_tokens,
        progress=lambda msg: print(msg, flush=True),
    )
    print()
    print(format_engine_bench(result))
    _write_json(args.json, result.model_dump())
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.config:
        try:
            import yaml

            from cluster.app import AppConfig

            AppConfig.model_validate(yaml.safe_load(Path(args.config).read_text()) or {})  # before any server starts
        except (ValueError, OSError) as e:
            print(f"forespark bench serve: {e}", file=sys.stderr)
            return 2
    from loadtest.bench_serve import bench_serve_command

    return bench_serve_command(args)


def cmd_models_bench(args: argparse.Namespace) -> int:
    from replicas.models.bench import format_models_bench, run_models_bench

    from replicas.engine import DrafterConfig, EngineConfig

    widths = list(args.widths) if args.widths else None
    engine = EngineConfig(wcs=None)
    if args.weights:
        engine.model = Path(args.weights) / "target"
        engine.drafter = DrafterConfig(path=Path(args.weights) / "drafter")
    if args.drafter:
        engine.drafter = DrafterConfig(path=Path(args.drafter))
    engine.drafter = engine.drafter.model_copy(update={"draft_sample_method": args.draft_sampling})
    result = run_models_bench(widths=widths, prompts_per_domain=args.prompts, engine=engine, progress=lambda msg: print(msg, flush=True),
                              temperature=args.temperature, seed=args.seed)
    print(format_models_bench(result))
    _write_json(args.json, result.model_dump())
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import json
    import os

    import yaml

    from cluster.host import HostDescription, resolve_app_config
    from replicas.engine import engine_environment
    from replicas.models.workloads import load_workloads
    from replicas.wcs.calibration import calibrate, format_calibration, load_prompts

    try:
        k = args.k
        if k is None:
            k = json.loads((Path(args.drafter) / "config.json").read_text())["block_size"] - 1
        raw = (yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else {}
        replica = dict(raw.get("replica") or {})
        engine = dict(replica.get("engine") or {})
        # The engine that records runs the constant prior: the pair has no traces yet.
        wcs = {**(engine.get("wcs") or {}), "estimator": "constant", "traces": None, "calibration": None}
        engine.update(model=args.model, drafter={**(engine.get("drafter") or {}), "path": args.drafter, "num_speculative_tokens": k}, wcs=wcs)
        config = resolve_app_config({**raw, "replica": {**replica, "engine": engine}}, HostDescription.detect())
        if args.prompts:
            prompts = load_prompts(Path(args.prompts))
        else:
            prompts = {d: p[: args.prompts_per_domain] for d, p in load_workloads().items()}
    except (ValueError, OSError, KeyError) as e:
        print(f"forespark calibrate: {e}", file=sys.stderr)
        return 2
    engine_config = config.replica.engine
    engine_environment(engine_config)
    # Ray gives a replica actor OMP_NUM_THREADS = its num_cpus: profiling with the same keeps the step-cost
    # profile's key (and its costs) those of the served replicas.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, int(config.replica.num_cpus))))
    summary = calibrate(
        engine_config, Path(args.out), prompts, temperature=args.temperature, truncation_prompts=args.truncation_prompts,
        progress=lambda msg: print(msg, flush=True),
    )
    print(format_calibration(summary))
    print(f"wrote {args.out}; serve the pair with engine.wcs.calibration: {Path(args.out).resolve()}")
    return 0


def cmd_models_traces(args: argparse.Namespace) -> int:
    from replicas.models.trace_recorder import record_traces
    from scheduling.evaluation import compare_estimators, compare_post_draft, format_comparison

    traces = record_traces(prompts_per_domain=args.prompts, repeats=args.repeats, temperature=args.temperature)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    traces.save(args.out)
    accepted = traces.mean_accepted_length()
    print(f"recorded {len(traces)} verification steps "
          f"({', '.join(f'{d}: {(traces.domain == d).sum()}, mean accepted length {accepted[d]:.2f}' for d in sorted(accepted))}); "
          f"wrote {args.out}")
    reports = compare_estimators(traces)
    print(format_comparison(reports))
    post = compare_post_draft(traces)
    print("post-draft survival Brier (held out): " + ", ".join(f"{k} {v:.4f}" for k, v in post.items()))
    payload = {name: {"mean_auc": r.mean_auc, "mean_brier": r.mean_brier, "mean_ece": r.mean_ece, **r.model_dump()} for name, r in reports.items()}
    _write_json(args.json, {**payload, "post_draft_brier": post, "mean_accepted_length": accepted})
    return 0


def cmd_models_workloads(args: argparse.Namespace) -> int:
    from replicas.models.corpus import load_corpus
    from replicas.models.workloads import WORKLOADS_DIR, build_workloads, write_workloads

    write_workloads(build_workloads(load_corpus(), per_domain=args.per_domain))
    print(f"wrote {WORKLOADS_DIR}")
    return 0


def cmd_results_check(args: argparse.Namespace) -> int:
    from loadtest.results_doc import main as results_doc

    return results_doc(["check", *([args.doc] if args.doc else [])])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forespark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve (local Ray unless --address)")
    srv.add_argument("--config", metavar="PATH", help="YAML/JSON application config (cluster/app.py: AppConfig)")
    srv.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--replicas", type=int, default=None, help="engine replicas (default: GPUs / tensor_parallel_size, else max(2, CPUs / 2))")
    srv.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1/*")
    srv.add_argument("--router", choices=("acceptance_headroom", "pow2"), default=None, help="request router (default: acceptance_headroom)")
    srv.add_argument("--dry-run", action="store_true", help="print the resolved configuration and its Serve options; start nothing")
    srv.add_argument("--assume-gpus", type=int, default=None, metavar="N", help="resolve defaults for a host with N GPUs (0: a CPU host)")
    srv.add_argument("--metrics-export-port", type=int, default=None, metavar="PORT",
                     help="port of the local Ray's metrics agent, for Prometheus (default: one Ray picks, printed at start)")
    srv.set_defaults(func=cmd_serve)

    load = sub.add_parser("loadtest", help="Locust SLO load test at one request rate: JSON report and PNG plots")
    load.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    load.add_argument("--rate", type=float, required=True, help="requests per second (Poisson arrivals)")
    _add_load_options(load, "results/loadtest", 60.0)
    load.set_defaults(func=cmd_loadtest)

    cap = sub.add_parser("capacity", help="highest request rate meeting the SLOs: doubling, then bisection")
    cap.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    cap.add_argument("--start-rate", type=float, default=1.0, help="first rate probed (req/s)")
    cap.add_argument("--bisect-steps", type=int, default=3)
    _add_load_options(cap, "results/capacity", 30.0)
    cap.set_defaults(func=cmd_capacity)

    over = sub.add_parser("overload", help="goodput, attainment and refusals at multiples of the sustainable rate")
    over.add_argument("--url", required=True)
    over.add_argument("--capacity", type=float, help="sustainable rate (req/s); default: found by the capacity search")
    over.add_argument("--multiples", default="1,2,4", help="multiples of the capacity to load at (default 1,2,4)")
    off = over.add_mutually_exclusive_group()
    off.add_argument("--off-url", help="the same application with admission off: its 1x load runs too, for admission's cost")
    off.add_argument("--off-json", metavar="PATH", help="admission's cost against the 1x row of an earlier run on the "
                     "admission-off server, where both cannot run at once (same --seed; --capacity defaults to that run's)")
    over.add_argument("--warmup", type=float, default=10.0, help="seconds of load at 1x before the rows, not counted "
                      "(each server's; default 10, 0: none)")
    over.add_argument("--repeats", type=int, default=1, help="run the multiples this many times, interleaved, and pool "
                      "each multiple's requests into its row (default 1; the admission-off side is measured alike)")
    over.add_argument("--start-rate", type=float, default=8.0)
    over.add_argument("--bisect-steps", type=int, default=3)
    over.add_argument("--refusal-cpu", action="store_true", help="instead: measure the host CPU one refused request "
                      "takes (a server on this host, admission on; for `simulate --refusal-cpu-ms`)")
    over.add_argument("--refusal-requests", type=int, default=500, help="--refusal-cpu: refusals to send (default 500)")
    _add_load_options(over, "results/overload", 30.0)
    over.set_defaults(func=cmd_overload)

    cmp_ = sub.add_parser("compare", help="capacity of each variant (policy x router), each on its own application, searched in turns")
    cmp_.add_argument("--variants", type=lambda t: tuple(v.strip() for v in t.split(",")), default=("wcs", "dspark", "ar", "wcs-pow2"),
                      help="comma-separated: wcs, dspark (start-up step-cost profile only, as vLLM's adaptive verification), "
                           "dspark-online (dspark with the online step-cost correction WCS uses), ar (router ours), "
                           "wcs-pow2 (Serve's power-of-two router), wcs-slo-cap (wcs with its predicted step time capped at the TPOT SLO), "
                           "wcs-pace (wcs keeping on a TPOT pace of 0.8 x the SLO each request a step can keep on it)")
    cmp_.add_argument("--config", metavar="PATH", help="base application config (AppConfig YAML); variants set policy and router")
    cmp_.add_argument("--port", type=int, default=8100, help="the first server's port (servers up at once take the next ones)")
    cmp_.add_argument("--protocol", choices=("interleaved", "sequential"), default=None,
                      help="interleaved (default for CPU replicas): all servers up, paused between their probes, which take "
                           "turns; sequential (default for GPU replicas): one server at a time, each searched to the end")
    cmp_.add_argument("--start-rate", type=float, default=1.0, help="first rate probed (req/s)")
    cmp_.add_argument("--bisect-steps", type=int, default=3)
    cmp_.add_argument("--repeats", type=int, default=1, help="rounds over all variants; rates are medians over rounds")
    cmp_.add_argument("--tpot-sweep", type=_positive_floats, default=(), metavar="MS,MS,...",
                      help="further TPOT SLOs: each variant's capacity against each too, on the same servers after the main "
                           "search; rates already probed are re-evaluated from their per-request rows, not measured again")
    cmp_.add_argument("--warmup", type=float, default=10.0, metavar="SECONDS",
                      help="load at the start rate after each server start, not counted (0: none)")
    _add_load_options(cmp_, "results/compare", 30.0)
    cmp_.set_defaults(func=cmd_compare)

    manifests = sub.add_parser("manifests", help="the shipped ray up, Serve and KubeRay manifests")
    manifests_sub = manifests.add_subparsers(dest="manifests", required=True)
    mcheck = manifests_sub.add_parser("check", help="validate manifests offline (default: every manifests/*.yaml and manifests/grafana/*.json); exit 1 on any problem")
    mcheck.add_argument("paths", nargs="*", help="manifest files (default: the shipped ones)")
    mcheck.set_defaults(func=cmd_manifests_check)
    mfleet = manifests_sub.add_parser("fleet", help="a fleet description (manifests/fleets/*.yaml) as a Serve config, checked as `check` does")
    mfleet.add_argument("fleet", help="fleet YAML")
    mfleet.add_argument("--base", default=str(Path(__file__).resolve().parent.parent / "manifests" / "serve-gpu.yaml"),
                        help="the Serve config whose application becomes the fleet (default manifests/serve-gpu.yaml)")
    mfleet.add_argument("--out", metavar="PATH", help="write it here (default: stdout)")
    mfleet.add_argument("--args-only", action="store_true", help="only the application's args (an AppConfig, for "
                        "`forespark serve --config` and `forespark compare --config`)")
    mfleet.set_defaults(func=cmd_manifests_fleet)

    demo = sub.add_parser("demo", help="offline planner demo on synthetic acceptances (no server)")
    demo.add_argument("--batches", type=_int_list, default=(8, 64, 512), help="comma-separated batch sizes")
    demo.add_argument("--k", type=int, default=8, help="drafter block size")
    demo.add_argument("--steps", type=int, default=100, help="simulated steps per batch size")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    planner = bench_sub.add_parser("planner", help="decision time of plan_step + distribute_verify_budget")
    planner.add_argument("--json", metavar="PATH", help="write results here")
    planner.add_argument("--batches", type=_int_list, default=(16, 64, 256, 1024), help="comma-separated batch sizes")
    planner.add_argument("--ks", type=_int_list, default=(4, 8, 16), help="comma-separated block sizes")
    planner.add_argument("--reps", type=int, default=3000, help="timed decisions per configuration")
    planner.set_defaults(func=cmd_bench_planner)
    router = bench_sub.add_parser("router", help="decision time of the cluster router per request (p50 target: 200 us at 64 replicas)")
    router.add_argument("--json", metavar="PATH", help="write results here")
    router.add_argument("--replicas", type=_int_list, default=(8, 64, 256), help="comma-separated fleet sizes")
    router.add_argument("--decisions", type=int, default=3000, help="timed decisions per (variant, fleet size)")
    router.set_defaults(func=cmd_bench_router)
    engine = bench_sub.add_parser("engine", help="every policy on one WCS vLLM engine at several concurrencies")
    engine.add_argument("--json", metavar="PATH", help="write {ratios, matched_rate, rows} here")
    engine.add_argument("--policies", type=_policy_list, default=("ar", "static", "dspark", "wcs"), help="comma-separated policies")
    engine.add_argument("--concurrency", type=_int_list, default=(1, 4, 16, 64, 128), help="requests in flight")
    engine.add_argument("--requests-per-slot", type=int, default=2, help="finished requests per run = this x concurrency")
    engine.add_argument("--reps", type=int, default=3, help="interleaved runs per (policy, concurrency); rows are medians")
    engine.add_argument("--max-tokens", type=int, default=None, help="cap output tokens (default: the workload's)")
    engine.add_argument("--temperature", type=float, default=0.0, help="every request samples at this temperature "
                        "(default 0: greedy; the OpenAI API's default is 1)")
    engine.add_argument("--draft-sampling", choices=["greedy", "probabilistic"], default=None,
                        help="vLLM's draft_sample_method (default: the engine config's)")
    engine.set_defaults(func=cmd_bench_engine)
    bserve = bench_sub.add_parser("serve", help="tokens/s of each policy served: its own `forespark serve` each, greedy, closed loop")
    bserve.add_argument("--policies", type=_policy_list, default=("wcs", "ar", "static"), help="comma-separated policies")
    bserve.add_argument("--prompts", type=lambda t: tuple(v.strip() for v in t.split(",")), default=("code", "fib"),
                        help="comma-separated prompt sets: code, prose (the shipped workloads), fib (def fibonacci(n):), repetitive")
    bserve.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    bserve.add_argument("--requests", type=int, default=8, help="requests per prompt set")
    bserve.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos: every request makes all)")
    bserve.add_argument("--repeats", type=int, default=1, help="policy rotations (reversed every other one); rows are medians")
    bserve.add_argument("--warmup", type=int, default=2, help="requests per prompt set after each server start, not counted")
    bserve.add_argument("--protocol", choices=("interleaved", "sequential"), default=None,
                        help="interleaved: every server up once, paused while the others run (default on CPU with --repeats > 1); "
                             "sequential: a fresh server per policy and repeat (default otherwise)")
    bserve.add_argument("--config", metavar="PATH", help="base application config (AppConfig YAML); the policy is set per server")
    bserve.add_argument("--port", type=int, default=8200, help="the first server's port (servers up at once take the next ones)")
    bserve.add_argument("--api-key", default=None)
    bserve.add_argument("--out", default="results/bench-serve", help="server logs and configs (default results/bench-serve)")
    bserve.add_argument("--json", metavar="PATH", help="write {rows, ratios} here (default OUT/bench_serve.json)")
    bserve.set_defaults(func=cmd_bench_serve)

    cal = sub.add_parser(
        "calibrate", help="calibrate WCS for a model pair: acceptance traces, estimator fit and quality, step-cost profile"
    )
    cal.add_argument("--model", required=True, help="target model folder (Hugging Face format)")
    cal.add_argument("--drafter", required=True, help="DFlash drafter folder")
    cal.add_argument("--k", type=int, default=None, help="draft tokens per pass (default: the drafter's block)")
    cal.add_argument("--prompts", metavar="FILE.jsonl", help='prompt lines {"prompt", "max_tokens"?, "domain"?} (default: the shipped workloads)')
    cal.add_argument("--prompts-per-domain", type=int, default=64, help="shipped prompts per domain when --prompts is not given")
    cal.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the recorded requests")
    cal.add_argument("--truncation-prompts", type=int, default=12, help="prompts per domain for a non-causal drafter's truncation check")
    cal.add_argument("--config", metavar="PATH", help="the AppConfig you serve with: its engine settings (dtype, TP, KV, max_num_seqs) are calibrated")
    cal.add_argument("--out", default="calibration", help="calibration folder to write (default ./calibration)")
    cal.set_defaults(func=cmd_calibrate)

    models = sub.add_parser("models", help="the embedded target and drafter")
    models_sub = models.add_subparsers(dest="models", required=True)
    mbuild = models_sub.add_parser(
        "build", help="train tokenizer, target and drafter (shipped spec: about 15 minutes on 2 cores; prints its estimate)"
    )
    mbuild.add_argument("--spec", default="shipped", help="build spec: 'shipped' (replicas/models/weights), a name under replicas/models/specs/, or a JSON file")
    mbuild.add_argument("--out", default=None, help="output folder (default: replicas/models/weights for the shipped spec, else replicas/models/weights-<spec>)")
    mbuild.add_argument("--check", action="store_true", help="rebuild in a temporary folder and compare with the report in --out")
    mbuild.add_argument("--reuse-target", action="store_true", help="retrain only the drafter against the target in --out")
    mbuild.add_argument("--checkpoint-dir", default=None, help="save the build state here (resumable; git-ignored /checkpoints/ is meant for it)")
    mbuild.add_argument("--checkpoint-minutes", type=float, default=10.0, help="minutes between checkpoints (and at every phase end)")
    mbuild.add_argument("--resume", action="store_true", help="continue from the state in --checkpoint-dir (if there is one)")
    mbuild.add_argument("--resume-from", default=None, metavar="FILE", help="continue from this checkpoint file (full or compact)")
    mbuild.add_argument("--threads", type=int, default=None, help="torch/OpenMP/tokenizer threads (default: torch's)")
    mbuild.add_argument("--estimate", action="store_true", help="print how long the build would take, then stop")
    mbuild.set_defaults(func=cmd_models_build)
    mckpt = models_sub.add_parser("checkpoint", help="describe a build checkpoint; --compact writes the small committable form")
    mckpt.add_argument("path", help="a checkpoint file, or a checkpoint folder (its state.pt)")
    mckpt.add_argument("--compact", metavar="FILE", help="write the compact form here (<= 40 MiB for the next spec)")
    mckpt.set_defaults(func=cmd_models_checkpoint)
    meval = models_sub.add_parser("evaluate", help="a drafter-phase build checkpoint's models evaluated mid-training, as a "
                                  "build's last phase evaluates them (a few minutes)")
    meval.add_argument("path", help="a build's checkpoint folder (its state.pt) or a checkpoint file in it")
    meval.add_argument("--json", metavar="PATH")
    meval.set_defaults(func=cmd_models_evaluate)
    mprog = models_sub.add_parser("progress", help="a build's held-out curve and when it would reach the perplexity targets")
    mprog.add_argument("path", help="a checkpoint folder (its progress.jsonl) or a progress.jsonl")
    mprog.add_argument("--spec", default=None, help="the build's spec, to compare with its step count")
    mprog.add_argument("--min-step", type=int, default=500, help="fit the evaluations from this step on (warm-up is not on the curve)")
    mprog.set_defaults(func=cmd_models_progress)
    mbench = models_sub.add_parser("bench", help="acceptance per domain and draft width through vLLM")
    mbench.add_argument("--json", metavar="PATH", help="write results here")
    mbench.add_argument("--widths", type=_int_list, default=None, help="comma-separated widths (default 1..block)")
    mbench.add_argument("--prompts", type=int, default=24, help="prompts per domain")
    mbench.add_argument("--drafter", metavar="PATH", help="DFlash checkpoint to bench (default: the embedded drafter)")
    mbench.add_argument("--weights", metavar="DIR", help="a built pair's folder (DIR/target, DIR/drafter), e.g. "
                        "replicas/models/weights-next (default: the shipped pair)")
    mbench.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy; "
                        "the OpenAI API's default is 1)")
    mbench.add_argument("--seed", type=int, default=0, help="sampling seed of the first request (one per request)")
    mbench.add_argument("--draft-sampling", choices=["greedy", "probabilistic"], default="greedy",
                        help="vLLM's draft_sample_method: the drafter's argmax, or drafts sampled from it with its probabilities "
                        "in the ratio test (what sampled acceptance needs)")
    mbench.set_defaults(func=cmd_models_bench)
    mtraces = models_sub.add_parser("traces", help="record acceptance traces through vLLM and score the estimators")
    mtraces.add_argument(
        "--out", default="replicas/models/weights/traces.npz", help="where the traces go (.npz; the default is what WCS engines fit on)"
    )
    mtraces.add_argument("--json", metavar="PATH", help="write the estimator comparison here")
    mtraces.add_argument("--prompts", type=int, default=64, help="prompts per domain")
    mtraces.add_argument("--repeats", type=int, default=1, help="generations per prompt")
    mtraces.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    mtraces.set_defaults(func=cmd_models_traces)
    mwork = models_sub.add_parser("workloads", help="rewrite replicas/models/workloads/*.jsonl from held-out text")
    mwork.add_argument("--per-domain", type=int, default=64)
    mwork.set_defaults(func=cmd_models_workloads)

    from cluster.sim.cli import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    res = sub.add_parser("results", help="docs/results.md against the JSON it cites")
    res_sub = res.add_subparsers(dest="results", required=True)
    rcheck = res_sub.add_parser("check", help="recompute every annotated table from its JSON; exit 1 on any mismatch or missing file")
    rcheck.add_argument("doc", nargs="?", default=None, help="the markdown file (default docs/results.md)")
    rcheck.set_defaults(func=cmd_results_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
