"""Goodput under overload, simulated: `forespark overload`'s runs over a simulated fleet, seed by seed.

Per seed, one run with admission off at the capacity, then one run per multiple with admission on (each from a
fresh fleet, as the real command's runs start from a drained server), reported as `forespark overload` reports
them (`loadtest.overload.OverloadResult`, `admission_cost_1x` against the off run). With several seeds, the
medians of admission's cost at 1x and of each multiple's goodput (over 1x) and admitted attainment.
"""

from __future__ import annotations

import statistics

from pydantic import BaseModel

from cluster.sim.fleet import Fleet, FleetConfig, LoadConfig
from loadtest.config import SLOConfig
from loadtest.overload import OverloadResult, overload_row, with_off
from loadtest.report import build_report


class SeedRun(OverloadResult):
    seed: int


class SimOverload(BaseModel):
    simulated: bool = True
    capacity: float
    admission: dict
    host: dict | None = None  # the host model the engines shared their CPUs under (`HostModel`), if any
    runs: list[SeedRun]
    median: dict[str, dict[str, float | None] | float | None]


def _row(fleet: FleetConfig, load: LoadConfig, slo: SLOConfig, multiple: float, capacity: float, seed: int):
    rate = multiple * capacity
    run_load = load.model_copy(update={"rate": rate, "seed": seed})
    rows = Fleet(fleet, seed=seed).run(run_load)
    return overload_row(multiple, rate, rows, build_report(rows, slo, rate, run_load.duration_s), slo)


def simulate_overload(fleet: FleetConfig, load: LoadConfig, slo: SLOConfig, capacity: float, multiples: list[float],
                      seeds: list[int], progress=None) -> SimOverload:
    """`fleet` with admission on (`fleet.admission`); its 1x row is compared with the same fleet without it."""
    if fleet.admission is None:
        raise ValueError("simulate overload needs admission on (`--admission`)")
    if 1.0 not in multiples:
        raise ValueError("the multiples must include 1 (admission's cost is measured there)")
    runs = []
    for seed in seeds:
        off = _row(fleet.model_copy(update={"admission": None}), load, slo, 1.0, capacity, seed)
        rows = []
        for m in multiples:
            rows.append(_row(fleet, load, slo, m, capacity, seed))
            if progress is not None:
                progress()
        result = with_off(OverloadResult(capacity=capacity, rows=rows), off, "same run")
        runs.append(SeedRun(seed=seed, **result.model_dump()))

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    def of_1x(run: SeedRun, m: float) -> float | None:
        one = next(r for r in run.rows if r.multiple == 1.0).goodput
        row = next(r for r in run.rows if r.multiple == m)
        return row.goodput / one if one > 0 else None

    return SimOverload(
        capacity=capacity,
        admission=fleet.admission.model_dump(),
        host=fleet.host.model_dump() if fleet.host is not None else None,
        runs=runs,
        median={
            "admission_cost_1x": median([r.admission_cost_1x for r in runs]),
            "goodput_of_1x": {f"{m:g}": median([of_1x(r, m) for r in runs]) for m in multiples},
            "attainment_admitted": {f"{m:g}": median([next(x for x in r.rows if x.multiple == m).attainment_admitted
                                                      for r in runs]) for m in multiples},
        },
    )
