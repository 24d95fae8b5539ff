"""The `forespark` command line.

    forespark demo                       offline planner demo (no server; what `make serve` runs for now)
    forespark bench planner [--json P]   decision time of the WCS planner per engine step
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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

    with tqdm(total=len(args.batches) * len(args.ks), desc="planner bench", unit="config") as bar:
        result = benchmark.run(args.batches, args.ks, reps=args.reps, progress=lambda _row: bar.update())
    print(benchmark.format_table(result))
    _write_json(args.json, result.model_dump())
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forespark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
