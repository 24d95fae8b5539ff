"""Whether drafting paid where it was done: realised against predicted tokens per ms, of the steps that
drafted a plan and of those that drafted nothing, near the current load.

A `wcs` plan drafts only when it is predicted ahead of drafting nothing by the controller's margin. The
prediction rests on a step-cost model and survival estimates, each with its own correction
(`OnlineCostModel`, `RealisedGain`); what is left of their errors, and how they combine, shows only in what
the steps then realised. So per step this keeps realised over predicted tokens per ms: of a step that
drafted a plan, the tokens the next step emits (its drafts' verdicts) over its period, against the plan's
prediction; of a step that drafted nothing, the same against the cost model's plain step. The ratio of the
two means near a load is how far the model overstates drafting against not drafting there, and the
controller's margin is at least that overstatement (`StepController.margin`): the wcs engine bench lost
5-13% at 64 requests to plans predicted 5-10% ahead, with both corrections at work.

A common error (an intercept the profile missed, the host's speed) cancels in the ratio. Steps with
prefill, probe rounds and profiling steps are left out. Means are weighted by a Gaussian in log R (as the
cost correction's rows) and by age: entries halve every `half_life` steps, so where the margin has stopped
plans, the drafting entries fade, the overstatement relaxes towards the shrinkage prior (1: none), and plans
return to be measured again. Decisions use only earlier steps' outcomes: plans stay lossless.
"""

from __future__ import annotations

import numpy as np

DRAFT, PLAIN = 0, 1
LOAD_WIDTH = np.log(2.0)  # entries at twice or half the current requests weigh e^-1/2


class RealisedAdvantage:
    def __init__(self, window: int = 256, half_life: float = 512.0, prior_steps: float = 8.0) -> None:
        if window < 1 or half_life <= 0 or prior_steps <= 0:
            raise ValueError("need window >= 1, half_life > 0 and prior_steps > 0")
        self.half_life, self.prior_steps = half_life, prior_steps
        self._ratio = np.ones((2, window))  # realised / predicted tokens per ms
        self._r = np.ones((2, window))  # the step's requests
        self._t = np.zeros((2, window))  # when (in steps)
        self._seen = [0, 0]
        self.steps = 0
        self._pending: list | None = None  # [kind, requests, predicted tokens/ms, period ms or None]

    def planned(self, kind: int | None, requests: int, predicted_tokens_per_ms: float) -> None:
        """This step's decision: `DRAFT` (a plan that drafts), `PLAIN` (nothing drafted) or None (not counted)."""
        self.steps += 1
        ok = kind is not None and requests > 0 and predicted_tokens_per_ms > 0
        self._pending = [kind, requests, predicted_tokens_per_ms, None] if ok else None

    def ran(self, period_ms: float, prefill: int = 0) -> None:
        """The period of the step last planned (a step with prefill is not counted)."""
        if self._pending is not None:
            if prefill > 0 or period_ms <= 0:
                self._pending = None
            else:
                self._pending[3] = period_ms

    def emitted(self, tokens: int) -> None:
        """What the step after the one last planned emitted: that step's payoff."""
        pending, self._pending = self._pending, None
        if pending is None or pending[3] is None:
            return
        kind, requests, predicted, period = pending
        k = self._seen[kind] % self._ratio.shape[1]
        self._ratio[kind, k] = (tokens / period) / predicted
        self._r[kind, k], self._t[kind, k] = requests, self.steps
        self._seen[kind] += 1

    def _mean(self, kind: int, requests: int, prior: float) -> float:
        """The kind's weighted mean ratio near this load, shrunk towards `prior` by `prior_steps` steps."""
        n = min(self._seen[kind], self._ratio.shape[1])
        if n == 0:
            return prior
        w = np.exp(-0.5 * (np.log(self._r[kind, :n] / max(requests, 1)) / LOAD_WIDTH) ** 2)
        w *= 0.5 ** ((self.steps - self._t[kind, :n]) / self.half_life)
        return float((w @ self._ratio[kind, :n] + self.prior_steps * prior) / (w.sum() + self.prior_steps))

    def overstatement(self, requests: int) -> float:
        """How much more than not drafting the model promised drafting near this load, relative (0: none, also
        where drafting was not measured: its mean is shrunk towards the plain steps')."""
        plain = self._mean(PLAIN, requests, 1.0)
        return max(plain / self._mean(DRAFT, requests, plain) - 1.0, 0.0)
