"""The profiled step-cost model, corrected online by what serving steps really take.

A profile is taken in an idle engine at start-up, while a serving engine's
step also carries what the profile never sees: prefill chunks mixed into
decode steps, output handling and streaming for the requests, other
processes on the same CPUs, and a drafter that stores the context of every
step it skipped before it drafts. Measured under load on this machine
(`forespark bench engine` workloads, step log against the profile): decode
steps without drafts ran 2-8 ms shorter than profiled, drafting steps 3-7 ms
longer at a dozen requests and 8-10 ms longer at 64 (there the drafter's
share of a step was 1.8 times its profile), and steps with prefill chunks
10-30 ms longer.

`OnlineCostModel` regresses the residual (measured period minus the
profile's prediction for that step's R, D and N) over the last `window`
steps on four columns: 1, [D > 0], the profile's per-token drafting time
g_draft(D) and the step's prefill tokens. What the step spent storing the
drafter context that earlier steps without drafts deferred is timed apart
and taken out of its residual.

- The constant moves the profiled intercept: to the planner it is work it
  cannot change, and it makes every drafted token cheaper relative to the
  step.
- [D > 0] moves the drafter's launch cost, which the planner weighs against
  a whole step's gain, so a drafter that costs more than profiled is run
  less often (putting it into the intercept instead made the planner draft
  more, the wrong way).
- g_draft(D) scales the drafted-token slopes: at 64 requests the launch
  alone could not price a step drafting 120 tokens, and the planner kept
  drafting at a loss (wcs 0.85x of `ar` in the engine bench).
- Stored context prices staying ready to draft: a step that drafts after a
  run of steps without drafts first stores all their context, at a measured
  cost per row (a decayed ratio of time to rows over such stores) that
  prices probe rounds (`StepController.context_ms`; replicas/wcs/controller.py says
  why plans leave it out). Regressing it on the step periods instead was
  ill-posed: in an engine at one request it priced a row at 0.5 ms, 25
  times what the timed stores show, and kept the planner from drafting
  where drafting paid 1.25x.
- The prefill term moves nothing: prefill is work per request, done once
  whatever the steps look like (fewer, longer steps carry more of it each),
  so counting it into every step's intercept makes drafting look cheaper
  than it is. In an engine at 12 requests of the mixed workload the planner
  with prefill in the intercept drafted in 37% of the steps at 2595
  tokens/s, without it in none at 2703 (`ar`: 2931).

Every coefficient but the constant is pulled towards zero, i.e. the profile,
by a ridge prior worth `prior_weight` typical steps of its column, so a
handful of drafting steps moves the drafting terms little. Drafting steps
are kept in a window of their own: a long stretch without drafts (the
controller holding, or another policy in the engine bench) does not hand
the drafting terms back to the profile, from which the planner would
return to drafting at a loss every `window` steps. They are revised by the next
drafting steps, which exploration's probes keep coming (without probes one
expensive flush could stop drafting for good: +19 ms on the launch from a
handful of steps in an engine run, then no drafting step to revise it). So
that a few outliers (a first call's warm-up) cannot do the same, residuals
are clipped to [-0.75, 2] times the step's prediction, and rows fade with a
half-life of `4 * window` steps: a drafter priced at 130 ms a launch from the
warm-up steps of an engine bench kept the planner from drafting for a whole
run where drafting paid 1.25x. Rows are also weighted by how close their
batch is to the current one (a Gaussian in log R, width ln 2): the
profile's error depends on the batch, and in the engine bench the drafting
steps of 1-16 requests priced drafting at 64 as if it cost its profile
(wcs 0.89x of `ar` there, 0.97-0.98x in an engine that served 64 only).
Fed only with timings and counts, never with draft tokens, so it keeps every
policy lossless.
"""

from __future__ import annotations

import numpy as np

from scheduling.cost_model import StepCostModel

PREFILL_UNIT = 100.0  # prefill tokens per regression unit (keeps the columns on one scale)
MIN_INTERCEPT_MS = 0.01
MIN_DRAFT_SCALE = 0.25  # the served drafted-token slopes never fall below this share of the profile's
STORE_DECAY = 0.95  # per timed context store, in the time-per-row ratio
LOAD_WIDTH = np.log(2.0)  # rows at twice or half the current requests weigh e^-1/2 in the correction
PRIOR_ERROR_STEPS = 4.0  # drafting steps' worth of a zero error, where `drafting_error` has measured few


class OnlineCostModel:
    def __init__(
        self,
        profiled: StepCostModel,
        window: int = 128,
        refresh_every: int = 16,
        min_change_ms: float = 0.5,
        prior_weight: float = 8.0,
        half_life_steps: int | None = None,
    ) -> None:
        if window < 1 or refresh_every < 1 or prior_weight <= 0:
            raise ValueError("need window >= 1, refresh_every >= 1 and prior_weight > 0")
        self.profiled = profiled
        self.model = profiled
        self.refresh_every = refresh_every
        self.min_change_ms = min_change_ms
        self.prior_weight = prior_weight  # steps' worth of evidence that the profile's launch cost is right
        # The last `window` steps without drafts and, apart, the last `window` drafting steps, so a long run
        # without drafting (or another policy's) does not wash out what drafting was seen to cost.
        # Columns: 1, drafted at all, profiled g_draft(D), prefill tokens.
        self._x = np.zeros((2, window, 4))
        self._y = np.zeros((2, window))
        self._t = np.zeros((2, window))  # when each row was observed (`seen`)
        self._r = np.ones((2, window))  # its requests
        self._recent_r = np.ones(refresh_every)  # requests of the last steps: the load the model is corrected for
        self.half_life = half_life_steps or 4 * window  # rows weigh half as much this many steps later
        self._seen = [0, 0]  # steps observed without drafts, drafting
        self.seen = 0  # steps observed
        self.draft_scale = 1.0  # served drafted-token slopes over the profile's
        self.context_ms_per_row = 0.0  # what storing one deferred context row adds to a drafting step
        # Relative errors of the served model's predictions for the last `window` drafting steps, made before
        # each step was seen (out of sample), and those steps' requests (`drafting_error`).
        self._err = np.zeros(window)
        self._err_r = np.ones(window)
        self._err_seen = 0
        self._stored = np.zeros(2)  # decayed (ms, rows) of the context stores timed

    @property
    def offset_ms(self) -> float:
        """What the served model adds to the profiled intercept."""
        return self.model.intercept_ms - self.profiled.intercept_ms

    @property
    def launch_offset_ms(self) -> float:
        """What the served model adds to the profiled drafter launch cost."""
        return self.model.draft_launch_ms - self.profiled.draft_launch_ms

    def observe(
        self,
        requests: int,
        drafted: int,
        target: int,
        period_ms: float,
        prefill: int = 0,
        context_rows: int = 0,
        context_ms: float = 0.0,
    ) -> None:
        """One step with `requests` planned requests, `drafted` draft tokens, `target` tokens as the
        planner counts them (requests + verified drafts) and `prefill` more target tokens of prefill
        chunks took `period_ms` from its start to the next's, of which `context_ms` went into storing
        `context_rows` rows of drafter context deferred by earlier steps."""
        if context_rows > 0:
            self._stored = STORE_DECAY * self._stored + (context_ms, context_rows)
            self.context_ms_per_row = float(self._stored[0] / self._stored[1])
        period_ms -= context_ms
        drafting = int(drafted > 0)  # (an int: numpy reads a bool index as a mask)
        if drafting and not prefill:
            served = self.model.step_ms(requests, drafted, target)
            k = self._err_seen % len(self._err)
            self._err[k], self._err_r[k] = (period_ms - served) / max(served, 1e-3), max(requests, 1)
            self._err_seen += 1
        j = self._seen[drafting] % self._y.shape[1]
        self._seen[drafting] += 1
        self._x[drafting, j] = (1.0, float(drafting), float(self.profiled.drafted(float(drafted))), prefill / PREFILL_UNIT)
        predicted = self.profiled.step_ms(requests, drafted, target)
        # A step far off its prediction (a first call's warm-up, a pause of the host) says little about the next:
        # its residual is clipped so that a few such steps cannot price drafting out for good.
        self._y[drafting, j] = min(max(period_ms - predicted, -0.75 * predicted), 2.0 * predicted)
        self._t[drafting, j] = self.seen
        self._r[drafting, j] = self._recent_r[self.seen % self.refresh_every] = max(requests, 1)
        self.seen += 1
        if self.seen % self.refresh_every == 0:
            self._refresh()

    def drafting_error(self, requests: int) -> float:
        """How much longer than the served model predicted drafting steps near this load have run (relative, mean,
        0 when they ran shorter): their errors weighted by a Gaussian in log R (as the correction's rows), shrunk
        towards zero by `PRIOR_ERROR_STEPS` steps. Each error is taken before its step reaches the correction, so
        a bias the ridge-held correction keeps missing stays visible; timing noise averages out (its root mean
        square, about 10% at one request on this CPU, would have stopped drafting where it paid 1.1-1.2x)."""
        n = min(self._err_seen, len(self._err))
        w = np.exp(-0.5 * (np.log(self._err_r[:n] / max(requests, 1)) / LOAD_WIDTH) ** 2)
        return max(float(w @ self._err[:n]) / (PRIOR_ERROR_STEPS + float(w.sum())), 0.0)

    def _refresh(self) -> None:
        n = [min(seen, self._y.shape[1]) for seen in self._seen]
        x = np.concatenate([self._x[0, : n[0]], self._x[1, : n[1]]])
        y = np.concatenate([self._y[0, : n[0]], self._y[1, : n[1]]])
        # Older rows weigh less: drafting steps kept through a long hold fade towards the profile, slowly.
        w = 0.5 ** ((self.seen - np.concatenate([self._t[0, : n[0]], self._t[1, : n[1]]])) / self.half_life)
        # ... and rows taken at another load weigh less: the profile's error depends on the batch (drafting at 64
        # requests cost 1.8x its profile, at 4 as profiled), so the correction is local in log R.
        r = np.concatenate([self._r[0, : n[0]], self._r[1, : n[1]]])
        w = w * np.exp(-0.5 * (np.log(r / self._recent_r.mean()) / LOAD_WIDTH) ** 2)
        # Each column's prior is worth `prior_weight` steps of its typical (mean square over drafting steps) size.
        drafting = x[:, 1] > 0
        typical = (x[drafting] ** 2).mean(axis=0) if drafting.any() else np.ones(4)
        typical[3] = 1.0
        prior = np.diag(np.concatenate([[0.0], self.prior_weight * np.maximum(typical[1:], 1e-6)]))
        xw = x * w[:, None]
        coef = np.linalg.solve(xw.T @ x + prior, xw.T @ y)  # positive definite: n > 0 on the constant, the prior on the rest
        fixed = float(coef[0])  # the prefill coefficient only keeps prefill out of the constant
        # The served model must stay a step-cost model: a non-negative intercept and launch cost. Plain floats:
        # the offsets travel in the engine's stats, and vLLM's serialiser refuses numpy scalars.
        # (A floor above zero: a profile taken on a loaded machine may be corrected down by nearly all of its
        # intercept, and a step predicted to cost nothing at all breaks every tokens-per-ms ratio.)
        intercept = max(self.profiled.intercept_ms + fixed, MIN_INTERCEPT_MS)
        launch = max(self.profiled.draft_launch_ms + float(coef[1]), 0.0)
        scale = max(1.0 + float(coef[2]), MIN_DRAFT_SCALE)
        reference = float(self.profiled.drafted(64.0))  # how far a new scale moves a typical step's drafting
        if (
            abs(intercept - self.model.intercept_ms) >= self.min_change_ms
            or abs(launch - self.model.draft_launch_ms) >= self.min_change_ms
            or abs(scale - self.draft_scale) * reference >= self.min_change_ms
        ):
            drafted = self.profiled.drafted
            if scale != 1.0:
                drafted = drafted.model_copy(update={"slopes": [scale * v for v in drafted.slopes]})
            self.draft_scale = scale
            self.model = self.profiled.model_copy(
                update={"intercept_ms": intercept, "draft_launch_ms": launch, "drafted": drafted}
            )
