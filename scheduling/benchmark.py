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


class _Config:
    """One (batch, K) configuration: its inputs, and the samples timed so far."""

    def __init__(self, batch: int, k: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.batch, self.k = batch, k
        self.cases = [_inputs(batch, k, rng) for _ in range(16)]
        self.times: list[float] = []
        self.drafted = self.verified = 0

    def time(self, reps: int, cost, budget: int = 8192, warmup: int = 20) -> None:
        for n in range(warmup + reps):
            pre, post = self.cases[n % len(self.cases)]
            t0 = time.perf_counter()
            plan = plan_step(pre, cost, token_budget=budget, validate=False)
            verify = distribute_verify_budget(
                post, plan.draft, cost, verify_cap=plan.verify_cap, token_budget=budget, validate=False,
                drafted_slots=plan.slots,
            )
            t1 = time.perf_counter()
            if n >= warmup:
                self.times.append(t1 - t0)
                self.drafted += int(plan.draft.sum())
                self.verified += int(verify.sum())

    def timing(self) -> PlannerTiming:
        us = np.array(self.times) * 1e6
        n = len(self.times) * self.batch
        return PlannerTiming(
            batch=self.batch,
            k=self.k,
            p50_us=float(np.median(us)),
            p99_us=float(np.percentile(us, 99)),
            mean_drafted=self.drafted / n,
            mean_verified=self.verified / n,
        )


def run(
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    ks: tuple[int, ...] = DEFAULT_KS,
    reps: int = 2000,
    rounds: int = 5,
    progress=None,
) -> PlannerBenchResult:
    """Configurations are timed in interleaved rounds, so a burst of load on a shared machine
    spreads over all of them instead of landing on one."""
    cost = gpu_like_cost()
    configs = [_Config(b, k, seed=b * 100 + k) for b in batches for k in ks]
    per_round = max(1, reps // rounds)
    for _ in range(rounds):
        for config in configs:
            config.time(per_round, cost)
            if progress is not None:
                progress(config)
    return PlannerBenchResult(results=[c.timing() for c in configs])


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
