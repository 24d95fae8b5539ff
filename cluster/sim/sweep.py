"""Throughput at matched per-request rate over concurrency, as `forespark bench engine` measures the real
engine: each variant keeps `c` requests in flight per replica (closed loop) for a window, and is compared
with the others at the lowest per-request generation rate both reach (`replicas.wcs.bench.matched_ratio`)."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from cluster.sim.compare import VARIANTS, variant_fleet
from cluster.sim.fleet import Fleet, FleetConfig, LoadConfig
from loadtest.config import SLOConfig
from replicas.wcs.bench import EngineRun, matched_ratio


class SimSweep(BaseModel):
    simulated: bool = True
    profile: str
    acceptance: str
    replicas: int
    ratios: dict[str, float | None]  # wcs over each other variant, at matched per-request rate
    matched_rate: dict[str, float | None]  # the per-request rate (tokens/s) each ratio is taken at
    wcs_vs_best: dict[int, float | None]  # per concurrency: wcs's throughput over the best other variant's
    rows: list[EngineRun]


def sweep_run(base: FleetConfig, name: str, users: int, duration_s: float, seed: int) -> EngineRun:
    fleet = Fleet(variant_fleet(base, VARIANTS[name], SLOConfig()), seed=seed)
    load = LoadConfig(rate=1.0, duration_s=duration_s, drain_s=0.0, arrivals="closed", users=users * base.replicas, seed=seed)
    rows = fleet.run(load)
    done = [r for r in rows if r.status == 200 and r.tpot_ms]
    stats = [e.ctl.stats for e in fleet.engines]
    drafted, verified, accepted = (sum(getattr(s, a) for s in stats) for a in ("drafted", "verified", "accepted"))
    planned = sum(s.planned_requests for s in stats)
    return EngineRun(
        policy=name, concurrency=users, finished=len(done), output_tokens=fleet.emitted_by_end, seconds=duration_s,
        tokens_per_s=fleet.emitted_by_end / duration_s / base.replicas,
        per_request_rate=float(np.median([1000.0 / r.tpot_ms for r in done])) if done else 0.0,
        mean_accepted_length=1.0 + accepted / max(planned, 1), draft_waste=1.0 - verified / drafted if drafted else 0.0,
        draft_share=0.0, planner_share=0.0, steps=sum(e.steps for e in fleet.engines), reps=1,
    )


def simulate_sweep(base: FleetConfig, names: list[str], concurrency: list[int], duration_s: float, seed: int = 0,
                   on_row=None) -> SimSweep:
    rows = []
    for c in concurrency:
        for name in names:
            rows.append(sweep_run(base, name, c, duration_s, seed))
            if on_row:
                on_row(rows[-1])
    others = [n for n in names if n != "wcs"]
    ratios, rates = {}, {}
    for other in others if "wcs" in names else []:
        key = f"wcs_vs_{other}".replace("-", "_")
        ratios[key], rates[key] = matched_ratio(rows, "wcs", other)
    best = {}
    for c in concurrency:
        at = {r.policy: r.tokens_per_s for r in rows if r.concurrency == c}
        rest = [v for k, v in at.items() if k != "wcs"]
        best[c] = at["wcs"] / max(rest) if "wcs" in at and rest and max(rest) > 0 else None
    return SimSweep(profile=base.profile, acceptance=f"replay:{base.traces}" if base.traces else base.acceptance, replicas=base.replicas, ratios=ratios,
                    matched_rate=rates, wcs_vs_best=best, rows=rows)
