"""Per-request TPOT slack and the step-time cap it implies.

The planner maximises the batch's tokens per millisecond, which is the
batch's mean TPOT; a request it does not draft for still gets one token per
step, however long drafting for the others makes that step. Under a TPOT SLO
the step time a request can afford is its own: a request that has emitted
m tokens in t ms since its first token is on track while t <= SLO * m, and if
the rest of its r tokens are to bring it back to the SLO, its steps may take
on average

    budget_i = SLO + (SLO * m_i - t_i) / r_i

(one token per step, the worst case for it). The step cap is the smallest
budget over the requests that can still meet the SLO: those whose budget
leaves room for a plain decode step. A request past saving does not hold the
others back. The cap only bounds how much drafting is added to a step; the
inputs are timings and token counts, never a draft token, so it is a
pre-draft decision and the output distribution does not change.
"""

from __future__ import annotations

import numpy as np


class TPOTSlack:
    def __init__(self, slo_ms: float) -> None:
        if slo_ms <= 0:
            raise ValueError(f"the TPOT SLO must be positive, got {slo_ms}")
        self.slo_ms = slo_ms
        self._start: dict[str, tuple[float, int]] = {}  # request -> (time, tokens) when first planned

    def step_cap_ms(
        self, req_ids: list[str], generated: np.ndarray, left: np.ndarray, now_ms: float, plain_step_ms: float
    ) -> float | None:
        """The step-time cap for the next step, None when no request that can still meet the SLO binds it.

        `generated`: output tokens each request has so far (including this step's; 0 while it prefills, which
        leaves it out); `left`: how many it may still generate; `plain_step_ms`: the predicted step time
        without drafts.
        """
        start = self._start
        decoding = np.flatnonzero(np.asarray(generated) > 0)
        since = np.empty(len(decoding))
        emitted = np.empty(len(decoding))
        for n, i in enumerate(decoding.tolist()):
            tokens = int(generated[i])
            t0, m0 = start.setdefault(req_ids[i], (now_ms, tokens))
            since[n] = now_ms - t0
            emitted[n] = tokens - m0
        budget = self.slo_ms + (self.slo_ms * emitted - since) / np.maximum(np.asarray(left)[decoding], 1)
        saveable = budget[budget >= plain_step_ms]
        return float(saveable.min()) if len(saveable) else None

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self._start.pop(rid, None)
