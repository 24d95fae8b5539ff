"""Simulated runs, capacity searches and comparisons, with the load test's reports and `forespark compare`'s
JSON shape. Every figure they produce is simulated: it carries the cost profile and acceptance model."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel

from cluster.sim.fleet import Fleet, FleetConfig, LoadConfig, RouterName
from loadtest.capacity import CapacityResult, search
from loadtest.compare import VariantResult, ratio
from loadtest.config import SLOConfig
from loadtest.report import LoadTestReport, build_report
from scheduling.policies import PolicyName


class SimVariant(BaseModel):
    policy: PolicyName | Literal["vllm-adaptive"]
    router: RouterName
    online_cost: bool = True
    extrapolate_in_flight: bool = True


VARIANTS = {
    "wcs": SimVariant(policy=PolicyName.WCS, router="headroom"),
    "dspark": SimVariant(policy=PolicyName.DSPARK, router="headroom", online_cost=False),
    "ar": SimVariant(policy=PolicyName.AR, router="headroom"),
    "vllm-adaptive": SimVariant(policy="vllm-adaptive", router="headroom", online_cost=False),
    "static": SimVariant(policy=PolicyName.STATIC, router="headroom"),
    "wcs-pow2": SimVariant(policy=PolicyName.WCS, router="pow2"),
    "wcs-lor": SimVariant(policy=PolicyName.WCS, router="lor"),
    "wcs-local-count": SimVariant(policy=PolicyName.WCS, router="headroom", extrapolate_in_flight=False),
}
RATIOS = {"wcs_vs_dspark": ("wcs", "dspark"), "wcs_vs_ar": ("wcs", "ar"), "router_vs_pow2": ("wcs", "wcs-pow2"),
          "router_vs_lor": ("wcs", "wcs-lor"), "wcs_vs_vllm_adaptive": ("wcs", "vllm-adaptive"),
          "extrapolated_vs_local_count": ("wcs", "wcs-local-count")}


def variant_fleet(base: FleetConfig, variant: SimVariant, slo: SLOConfig) -> FleetConfig:
    engine = base.engine.model_copy(update={"tpot_slo_ms": slo.tpot_ms or base.engine.tpot_slo_ms})
    return base.model_copy(update={"policy": variant.policy, "router": variant.router, "engine": engine,
                                   "online_cost": variant.online_cost, "extrapolate_in_flight": variant.extrapolate_in_flight})


def simulate_load(fleet: FleetConfig, load: LoadConfig, slo: SLOConfig, seed: int = 0, progress: bool = False) -> LoadTestReport:
    rows = Fleet(fleet, seed=seed).run(load, progress=progress)
    return build_report(rows, slo, load.rate, load.duration_s)


def simulate_capacity(fleet: FleetConfig, load: LoadConfig, slo: SLOConfig, start_rate: float, seed: int = 0,
                      bisect_steps: int = 3) -> CapacityResult:
    def measure(rate: float) -> LoadTestReport:
        return simulate_load(fleet, load.model_copy(update={"rate": rate}), slo, seed)

    return search(measure, slo, start_rate=start_rate, bisect_steps=bisect_steps)


class SimCompareResult(BaseModel):
    simulated: bool = True
    profile: str  # (a heterogeneous fleet's first group's; `groups` has them all)
    groups: list[dict] | None = None  # a heterogeneous fleet's replica groups (`--fleet`)
    acceptance: str
    replicas: int
    slo: SLOConfig
    variants: dict[str, VariantResult]
    ratios: dict[str, float | None]
    crossing_ratios: dict[str, float | None]
    wall_s: float


def simulate_compare(base: FleetConfig, load: LoadConfig, slo: SLOConfig, names: list[str], start_rate: float,
                     seeds: list[int], on_result=None) -> SimCompareResult:
    """Each variant's capacity search per seed (the same arrivals for every variant at a seed), medians and ratios."""
    import numpy as np

    t0 = time.perf_counter()
    results: dict[str, VariantResult] = {}
    for name in names:
        v = VARIANTS[name]
        rounds = [simulate_capacity(variant_fleet(base, v, slo), load.model_copy(update={"seed": s}), slo, start_rate, seed=s)
                  for s in seeds]
        rates, crossings = [r.max_rate for r in rounds], [r.crossing_rate for r in rounds]
        results[name] = VariantResult(policy=str(v.policy), router=v.router, capacity=rounds[-1],
                                      max_rate=float(np.median(rates)), max_rates=rates,
                                      crossing_rate=float(np.median(crossings)), crossing_rates=crossings)
        if on_result:
            on_result(name, results[name])
    present = {k: ab for k, ab in RATIOS.items() if all(x in results for x in ab)}
    return SimCompareResult(
        profile=base.profile, groups=[g.model_dump() for g in base.groups] if base.groups else None,
        acceptance=f"replay:{base.traces}" if base.traces else base.acceptance, replicas=base.replicas, slo=slo, variants=results,
        ratios={k: ratio(results, a, b) for k, (a, b) in present.items()},
        crossing_ratios={k: ratio(results, a, b, "crossing_rate") for k, (a, b) in present.items()},
        wall_s=time.perf_counter() - t0,
    )
