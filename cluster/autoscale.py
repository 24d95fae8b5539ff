"""Autoscaling on budget headroom: how many engine replicas keep the TPOT SLO, from their own cost models.

Serve's default policy scales on requests in flight against a fixed `target_ongoing_requests`, a number
that says nothing about the SLO: the requests a replica can carry within its TPOT cap depend on its
GPU, its drafter's acceptance and the workload, and requests in flight are no measure of load when
latency depends on it (at light load requests finish fast, so few are in flight: a fleet scaled down
on that count collapses). This policy measures load as decode work per millisecond, from each
replica's routing stats (the numbers the router scores with, `replicas/routing_stats.py`) and the
router's forecast (`cluster.placement.placement_forecast`):

    capacity_i   = requests replica i can carry before its forecast TPOT passes tpot_share of the cap
    demand       = sum over replicas of (running + waiting) / forecast TPOT now      (tokens per ms)
    supply       = sum over replicas of the best n / forecast TPOT(n), n up to capacity   (tokens per ms within the SLO)
    utilisation  = demand / supply
    desired      = current * utilisation / target      (outside the band [scale_down_below, scale_up_above])

Inside the band the count stays (hysteresis on the signal); Serve adds its own in time
(`upscale_delay_s`, `downscale_delay_s`) and the replica bounds. Requests waiting past a replica's batch
count as load, and so do requests queued at Serve's handles before any replica took them.

`HeadroomPolicy` is Serve's custom autoscaling policy (`AutoscalingPolicy(policy_function=
"cluster.autoscale:HeadroomPolicy")`); the replicas report their stats to it through
`record_autoscaling_stats`. The fleet simulator calls `desired_replicas` with the same stats.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from cluster.placement import FleetArrays, expected_tokens_per_step, placement_forecast
from replicas.routing_stats import RoutingStats

MAX_EXTRA = 4096  # the most requests the capacity search adds to one replica
SUPPLY_POINTS = 16  # batch sizes tried per replica for its best decode rate within the SLO


class HeadroomScaling(BaseModel):
    target: float = Field(default=0.6, gt=0, le=1, description="share of the fleet's SLO capacity to run at")
    scale_up_above: float = Field(default=0.75, gt=0, description="scale up when utilisation passes this")
    scale_down_below: float = Field(default=0.4, ge=0, description="scale down when utilisation falls under this")
    tpot_share: float = Field(default=0.9, gt=0, le=1, description="a replica is full when its forecast TPOT passes this share of the cap")


def replica_capacity(fleet: FleetArrays, tpot_share: float = 0.9) -> np.ndarray:
    """Requests each replica can carry with its forecast TPOT within `tpot_share` of its cap (running ones included),
    bounded by its batch: past it requests queue."""
    tokens = expected_tokens_per_step(fleet, 1.0)
    n = len(fleet.running)
    lo, hi = np.zeros(n), np.full(n, float(MAX_EXTRA))
    # Bisection on the added count, every replica at once (the forecast's TPOT grows with it).
    for _ in range(13):
        mid = np.floor((lo + hi) / 2.0)
        fits = placement_forecast(fleet, mid - 1.0, tokens).tpot <= tpot_share * fleet.cap_ms
        lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
    capacity = np.minimum(fleet.running + lo, fleet.max_num_seqs)
    return np.where(fleet.has_cost, capacity, fleet.max_num_seqs)


def utilisation(stats: list[RoutingStats], config: HeadroomScaling, queued: float = 0.0) -> float:
    """Decode work the fleet is asked for over what it can do within the SLO (0 for an empty fleet); `queued`:
    requests waiting before any replica took them."""
    if not stats:
        return 0.0
    fleet = FleetArrays(stats)
    tokens = expected_tokens_per_step(fleet, 1.0)
    capacity = np.maximum(replica_capacity(fleet, config.tpot_share), 1.0)
    # The most decode work each replica does within the SLO: the best n / TPOT(n) up to its capacity (with WCS
    # it flattens early: more requests then only share the speculation budget, and wait longer).
    best = np.zeros(len(stats))
    for k in range(1, SUPPLY_POINTS + 1):
        n = np.maximum(np.round(capacity * k / SUPPLY_POINTS), 1.0)
        tpot = placement_forecast(fleet, n - fleet.running - 1.0, tokens).tpot
        best = np.maximum(best, n / np.maximum(tpot, 1e-6))
    best = np.where(fleet.has_cost, best, capacity / (config.tpot_share * fleet.cap_ms))
    now = placement_forecast(fleet, np.full(len(stats), -1.0), tokens).tpot
    now = np.where(fleet.has_cost & (now > 0), now, config.tpot_share * fleet.cap_ms)
    demand = float((fleet.load / now).sum()) + queued / float(np.mean(now))
    return demand / float(best.sum())


def desired_replicas(current: int, stats: list[RoutingStats], config: HeadroomScaling, queued: float = 0.0) -> float:
    """Replicas to run: unchanged inside the hysteresis band, else scaled to bring utilisation to the target.
    `queued`: requests waiting before any replica (at Serve's handles)."""
    if current <= 0 or not stats:
        return float(current)
    u = utilisation(stats, config, queued)
    if config.scale_down_below <= u <= config.scale_up_above:
        return float(current)
    return current * u / config.target


def stats_from_metrics(metrics: dict[str, dict[Any, float]]) -> list[RoutingStats]:
    """Per-replica `RoutingStats` from Serve's aggregated custom metrics (a replica missing a field is left out)."""
    names = [name for name in RoutingStats.model_fields if name in metrics]
    replicas = set.intersection(*(set(metrics[name]) for name in names)) if names else set()
    out = []
    for replica in replicas:
        values = {name: metrics[name][replica] for name in names}
        try:
            out.append(RoutingStats.model_validate(
                {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}
                | {"running": round(values.get("running", 0)), "waiting": round(values.get("waiting", 0)),
                   "max_num_seqs": round(values.get("max_num_seqs", 1)), "mix_measured": bool(values.get("mix_measured", 0))}))
        except ValueError:
            continue
    return out


class HeadroomPolicy:
    """Serve's custom autoscaling policy (a class: Serve builds it once with `policy_kwargs`, a `HeadroomScaling`,
    and calls it with a `ray.serve.config.AutoscalingContext` every tick); Serve applies the bounds, scaling
    factors and delays to what it returns."""

    def __init__(self, **kwargs: Any) -> None:
        self.config = HeadroomScaling.model_validate(kwargs)

    def __call__(self, ctx) -> tuple[float, dict]:
        stats = stats_from_metrics(ctx.aggregated_metrics or {})
        if not stats:  # nothing reported yet: keep the count
            return ctx.target_num_replicas, {}
        return desired_replicas(ctx.current_num_replicas, stats, self.config, ctx.total_queued_requests or 0.0), {}
