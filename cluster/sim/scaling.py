"""`forespark simulate autoscale`: the headroom policy against Serve's default under one load shape.

Each variant runs the same arrivals (seeded) on the same fleet with its autoscaling policy; the report is
the load test's (SLO attainment, also over time) plus the replica-seconds the fleet used and its replica
count over time. Figures are simulated.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from cluster.sim.autoscaler import SimAutoscaling
from cluster.sim.fleet import Fleet, FleetConfig, LoadConfig
from loadtest.config import SLOConfig
from loadtest.report import build_report


class ScalingRow(BaseModel):
    variant: str
    policy: str
    target_ongoing_requests: float | None
    attainment: float
    goodput_rps: float
    worst_window_attainment: float  # the lowest attainment of the report's time windows
    replica_seconds: float
    most_replicas: int
    timeline: list[tuple[float, int, int]]  # (time, replicas serving, target)
    attainment_over_time: list[tuple[float, float, int]]


class SimScalingResult(BaseModel):
    simulated: bool = True
    profile: str
    acceptance: str
    slo: SLOConfig
    load: LoadConfig
    autoscaling: SimAutoscaling
    rows: list[ScalingRow]
    ratios: dict[str, float]  # replica-seconds of each default-policy variant over the headroom policy's
    wall_s: float


def variant_name(policy: str, target: float) -> str:
    return "headroom" if policy == "headroom" else f"ongoing_requests@{target:g}"


def simulate_scaling(base: FleetConfig, load: LoadConfig, slo: SLOConfig, scaling: SimAutoscaling, targets: list[float],
                     progress: bool = False, on_row=None) -> SimScalingResult:
    t0 = time.perf_counter()
    variants = [("headroom", scaling.target_ongoing_requests)] + [("ongoing_requests", t) for t in targets]
    rows = []
    for policy, target in variants:
        auto = scaling.model_copy(update={"policy": policy, "target_ongoing_requests": target})
        fleet = Fleet(base.model_copy(update={"autoscaling": auto}), seed=load.seed)
        report = build_report(fleet.run(load, progress=progress), slo, load.rate, load.duration_s)
        windows = [a for _, a, n in report.attainment_over_time if n > 0]
        row = ScalingRow(
            variant=variant_name(policy, target), policy=policy, target_ongoing_requests=None if policy == "headroom" else target,
            attainment=report.attainment, goodput_rps=report.goodput_rps, worst_window_attainment=min(windows, default=0.0),
            replica_seconds=fleet.autoscaler.replica_seconds, most_replicas=max(s for _, s, _ in fleet.autoscaler.timeline),
            timeline=fleet.autoscaler.timeline, attainment_over_time=report.attainment_over_time)
        rows.append(row)
        if on_row:
            on_row(row)
    head = rows[0].replica_seconds
    return SimScalingResult(
        profile=base.profile, acceptance=f"replay:{base.traces}" if base.traces else base.acceptance, slo=slo, load=load,
        autoscaling=scaling, rows=rows, ratios={f"{r.variant}_over_headroom": r.replica_seconds / head for r in rows[1:] if head > 0},
        wall_s=time.perf_counter() - t0)
