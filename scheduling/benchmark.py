"""Decision-time benchmark of the WCS planner: `plan_step` + `distribute_verify_budget` per engine step.

Inputs are shaped like a serving step: survival curves from per-request
acceptance rates drawn around a typical parallel drafter's (0.55-0.95 per
token, decaying with position), post-draft curves that perturb them, and a
step-cost model with a GPU decode step's proportions (fixed cost dominating,
per-token costs small), scaled so the planner admits a realistic share of
slots. Curves come from `survival_from_hazards`, so the planner runs
without re-validating them, as the engine does. Times are wall-clock medians over many repetitions after a warm-up.
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import BaseModel

from scheduling.allocator import distribute_verify_budget
from scheduling.planner import plan_step
from scheduling.simulate import gpu_like_cost
from scheduling.survival import survival_from_hazards

DEFAULT_BATCHES = (16, 64, 256, 1024)
DEFAULT_KS = (4, 8, 16)


class PlannerTiming(BaseModel):
    batch: int
    k: int
    p50_us: float
    p99_us: float
    mean_drafted: float  # mean draft width the plans chose
    mean_verified: float


class PlannerBenchResult(BaseModel):
    results: list[PlannerTiming]
    target_p50_us: float = 100.0
    target_batch: int = 256
    target_k: int = 16

    def meets_target(self) -> bool | None:
        row = next((r for r in self.results if r.batch == self.target_batch and r.k == self.target_k), None)
        return None if row is None else row.p50_us <= self.target_p50_us


def _inputs(batch: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    rate = rng.uniform(0.55, 0.95, (batch, 1))
    decay = rng.uniform(0.0, 0.02, (batch, 1))
    hazards = np.clip(rate - decay * np.arange(k)[None, :], 0.0, 1.0)
    noisy = np.clip(hazards + rng.normal(0.0, 0.08, hazards.shape), 0.0, 1.0)
    return survival_from_hazards(hazards), survival_from_hazards(noisy)


def time_planner(batch: int, k: int, reps: int, seed: int = 0) -> PlannerTiming:
    rng = np.random.default_rng(seed)
    cost = gpu_like_cost()
    cases = [_inputs(batch, k, rng) for _ in range(16)]
    budget = 8192
    times = np.empty(reps)
    drafted = verified = 0
    for n in range(reps + reps // 10):
        pre, post = cases[n % len(cases)]
        t0 = time.perf_counter()
        plan = plan_step(pre, cost, token_budget=budget, validate=False)
        verify = distribute_verify_budget(
            post, plan.draft, cost, verify_cap=plan.verify_cap, token_budget=budget, validate=False,
            drafted_slots=plan.slots,
        )
        t1 = time.perf_counter()
        warm = n - reps // 10
        if warm >= 0:
            times[warm] = t1 - t0
            drafted += int(plan.draft.sum())
            verified += int(verify.sum())
    us = times * 1e6
    return PlannerTiming(
        batch=batch,
        k=k,
        p50_us=float(np.median(us)),
        p99_us=float(np.percentile(us, 99)),
        mean_drafted=drafted / (reps * batch),
        mean_verified=verified / (reps * batch),
    )


def run(
    batches: tuple[int, ...] = DEFAULT_BATCHES, ks: tuple[int, ...] = DEFAULT_KS, reps: int = 2000, progress=None
) -> PlannerBenchResult:
    rows = []
    for b in batches:
        for k in ks:
            rows.append(time_planner(b, k, reps))
            if progress is not None:
                progress(rows[-1])
    return PlannerBenchResult(results=rows)


def format_table(result: PlannerBenchResult) -> str:
    lines = [f"{'batch':>6} {'K':>3} {'p50 us':>9} {'p99 us':>9} {'draft/req':>10} {'verify/req':>11}"]
    for r in result.results:
        lines.append(
            f"{r.batch:>6} {r.k:>3} {r.p50_us:>9.1f} {r.p99_us:>9.1f} {r.mean_drafted:>10.2f} {r.mean_verified:>11.2f}"
        )
    verdict = result.meets_target()
    if verdict is not None:
        lines.append(
            f"target p50 <= {result.target_p50_us:.0f} us at B={result.target_batch}, K={result.target_k}: "
            + ("met" if verdict else "MISSED")
        )
    return "\n".join(lines)
