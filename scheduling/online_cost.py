"""The profiled step-cost model, corrected online by what serving steps really take.

A profile is taken in an idle engine at start-up, while a serving engine's
step also carries what the profile never sees: prefill chunks mixed into
decode steps, output handling and streaming for the requests, other
processes on the same CPUs, and a drafter that stores the context of every
step it skipped before it drafts. Measured under load on this machine
(`forespark bench engine` workloads, step log against the profile): decode
steps without drafts ran 2-8 ms shorter than profiled, drafting steps 3-7 ms
longer, and steps with prefill chunks 10-30 ms longer.

`OnlineCostModel` regresses the residual (measured period minus the
profile's prediction for that step's R, D and N) over the last `window`
steps on three columns: 1, [D > 0] and the step's prefill tokens. The
constant moves the profiled intercept: to the planner it is work it cannot
change, and it makes every drafted token cheaper relative to the step. The
prefill term moves nothing: prefill is work per request, done once whatever
the steps look like (fewer, longer steps carry more of it each), so counting
it into every step's intercept makes drafting look cheaper than it is. In
an engine at 12 requests of the mixed workload (three interleaved runs
each) the planner with prefill in the intercept drafted in 37% of the steps
at 2595 tokens/s, without it in none at 2703 (`ar`: 2931). The [D > 0] part
moves the drafter's launch cost, which the planner weighs against a whole
step's gain, so a drafter that costs more than profiled is run less often
(putting it into the intercept instead made the planner draft more, the
wrong way). The two extra coefficients are pulled towards zero, i.e. the
profile, by a ridge prior worth `prior_weight` steps: a window with few
drafting steps moves the launch cost little, and a window with none hands it
back to the profile, so one expensive flush cannot stop drafting for good
(keeping the last estimate instead did exactly that in an engine run: +19 ms
on the launch from a handful of steps, then no drafting step to revise it).
No throughput change showed in engine runs at 32 requests (code, prose and
mixed batches against `ar`, within this machine's 5-10% run-to-run spread);
what it removes is a bias. Slopes stay the profile's: scaling them
by the runner's slow-down was tried under serving load here and priced
drafts too high. Fed only with timings and counts, never with draft tokens,
so it keeps every policy lossless.
"""

from __future__ import annotations

import numpy as np

from scheduling.cost_model import StepCostModel

PREFILL_UNIT = 100.0  # prefill tokens per regression unit (keeps the columns on one scale)
MIN_INTERCEPT_MS = 0.01


class OnlineCostModel:
    def __init__(
        self,
        profiled: StepCostModel,
        window: int = 128,
        refresh_every: int = 16,
        min_change_ms: float = 0.5,
        prior_weight: float = 8.0,
    ) -> None:
        if window < 1 or refresh_every < 1 or prior_weight <= 0:
            raise ValueError("need window >= 1, refresh_every >= 1 and prior_weight > 0")
        self.profiled = profiled
        self.model = profiled
        self.refresh_every = refresh_every
        self.min_change_ms = min_change_ms
        self.prior_weight = prior_weight  # steps' worth of evidence that the profile's launch cost is right
        self._x = np.zeros((window, 3))  # 1, drafted at all, prefill tokens / PREFILL_UNIT
        self._y = np.zeros(window)
        self.seen = 0  # steps observed

    @property
    def offset_ms(self) -> float:
        """What the served model adds to the profiled intercept."""
        return self.model.intercept_ms - self.profiled.intercept_ms

    @property
    def launch_offset_ms(self) -> float:
        """What the served model adds to the profiled drafter launch cost."""
        return self.model.draft_launch_ms - self.profiled.draft_launch_ms

    def observe(self, requests: int, drafted: int, target: int, period_ms: float, prefill: int = 0) -> None:
        """One step with `requests` planned requests, `drafted` draft tokens, `target` tokens as the
        planner counts them (requests + verified drafts) and `prefill` more target tokens of prefill
        chunks took `period_ms` from its start to the next's."""
        i = self.seen % len(self._y)
        self._x[i] = (1.0, float(drafted > 0), prefill / PREFILL_UNIT)
        self._y[i] = period_ms - self.profiled.step_ms(requests, drafted, target)
        self.seen += 1
        if self.seen % self.refresh_every == 0:
            self._refresh()

    def _refresh(self) -> None:
        n = min(self.seen, len(self._y))
        x, y = self._x[:n], self._y[:n]
        prior = np.diag([0.0, self.prior_weight, self.prior_weight])
        coef = np.linalg.solve(x.T @ x + prior, x.T @ y)  # positive definite: n > 0 on the constant, the prior on the rest
        fixed = float(coef[0])  # the prefill coefficient only keeps prefill out of the constant
        # The served model must stay a step-cost model: a non-negative intercept and launch cost. Plain floats:
        # the offsets travel in the engine's stats, and vLLM's serialiser refuses numpy scalars.
        # (A floor above zero: a profile taken on a loaded machine may be corrected down by nearly all of its
        # intercept, and a step predicted to cost nothing at all breaks every tokens-per-ms ratio.)
        intercept = max(self.profiled.intercept_ms + fixed, MIN_INTERCEPT_MS)
        launch = max(self.profiled.draft_launch_ms + float(coef[1]), 0.0)
        if abs(intercept - self.model.intercept_ms) >= self.min_change_ms or abs(launch - self.model.draft_launch_ms) >= self.min_change_ms:
            self.model = self.profiled.model_copy(update={"intercept_ms": intercept, "draft_launch_ms": launch})
