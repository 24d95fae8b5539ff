"""Exploration: one-token probes for requests whose acceptance nobody has looked at lately.

A request the planner leaves undrafted yields no verdict, so a wrong belief
about it would never be corrected. After `interval` of its steps without a
verified draft, a request becomes due: a plan forces one draft slot for it (a
`lo` of 1, which the planner prices like any forced slot), and its verdict
reaches the estimator and `scheduling.recalibration`. A rejected probe doubles
that request's interval (up to `max_backoff` times the base), an accepted one
resets it, so requests that keep rejecting cost ever fewer probes.

A probe's price is mostly the drafter's launch (and storing the context that
steps without drafts deferred), paid once per step whoever drafts. Probes
therefore ride on steps that draft anyway, and otherwise wait for a probe
round: one step that drafts only to probe, for every request due then. Rounds
are paid from a budget: every step earns `budget` times its predicted time,
and a round runs when the credit covers its predicted extra cost. A round is
then paid at what it was measured to cost (`settle`), and later rounds are
priced up by the decayed ratio of measured to predicted cost (`overrun`): at
64 requests on this CPU the context store made rounds cost up to 3 times
their prediction, and rounds took 3.5% of step time on a 2% budget. An engine
probes as often as it can afford to: at one request on this CPU a round costs
about a step and runs every few dozen steps; at 64 a round that first stores
the context of the steps held since the last costs as much as three plain
steps and runs every hundred or more. (Per-request probes kept a loaded engine
drafting in nearly every step: 64 requests each due every 16 of its steps is
four probes a step, and with the launch paid the planner drafted more around
them, wcs 0.88-0.92x of `ar`. Rounds backed off by a step count instead left
an engine at one request holding while its drafts would have paid: a request
lives fewer steps than the backed-off interval.)

A round whose verdicts change nothing is itself evidence: where drafting is
priced out (at 64-128 requests on this CPU probes were accepted at 0.84 and the
next plan still drafted nothing), rounds only cost. So each round is judged at
the next plan: if that plan drafts nothing, the budget halves (down to
`MIN_BUDGET_SCALE` of itself); any plan that drafts restores it. (At 128
requests on this CPU a steady 2% budget was about 2% of `ar`'s throughput.)

A probe's width is chosen before drafting from earlier verdicts only:
exploration changes which drafts are verified, never how.
"""

from __future__ import annotations

import numpy as np

MAX_OVERRUN = 4.0  # rounds are never priced more than this many times their prediction (nor less than its inverse)
MIN_BUDGET_SCALE = 0.125  # fruitless rounds shrink the budget to no less than this share of it


class ProbeSchedule:
    def __init__(self, interval: int = 16, max_backoff: int = 8, budget: float = 0.02) -> None:
        if interval < 1 or max_backoff < 1 or not 0.0 < budget < 1.0:
            raise ValueError("need interval >= 1, max_backoff >= 1 and 0 < budget < 1")
        self.interval = interval
        self.max_backoff = max_backoff
        self.budget = budget  # share of step time probe rounds may cost
        self._since: dict[str, int] = {}  # request -> its steps since its last verified draft (or arrival)
        self._every: dict[str, int] = {}  # request -> its current interval
        self.credit_ms = 0.0  # what probe rounds may still spend
        self.round_ms = 0.0  # the last predicted cost of a round (0 until one was priced)
        self.overrun = 1.0  # measured over predicted cost of the rounds so far (decayed)
        self._charged: tuple[float, float] | None = None  # the running round's (predicted, charged) cost
        self.scale = 1.0  # the share of `budget` rounds earn now (halved by each fruitless round)
        self._judging = False  # a round ran since the last plan: the next plan judges it

    def observe(self, req_ids: list[str], verified: np.ndarray, accepted: np.ndarray) -> bool:
        """One step of these requests; True when some of them are due for a probe and a round is affordable."""
        due = False
        for r, v, a in zip(req_ids, np.asarray(verified).tolist(), np.asarray(accepted).tolist()):
            if v > 0:
                self._since[r] = 0
                if a > 0:
                    self._every[r] = self.interval
                elif v == 1:  # a rejected probe (or one-token draft): look again later
                    self._every[r] = min(self._every.get(r, self.interval) * 2, self.interval * self.max_backoff)
            else:
                since = self._since[r] = self._since.get(r, 0) + 1
                due = due or since >= self._every.get(r, self.interval)
        return due and self.affordable(self.round_ms)

    def earn(self, step_ms: float) -> None:
        """A step of `step_ms` (predicted) ran: the budget's share of it becomes credit, up to two rounds' worth
        (credit saved while drafting paid must not buy a burst of rounds when it stops)."""
        cap = 2.0 * self.round_ms * self.overrun if self.round_ms > 0 else float("inf")
        self.credit_ms = min(self.credit_ms + self.scale * self.budget * step_ms, cap)

    def affordable(self, cost_ms: float) -> bool:
        """Whether a round of predicted extra cost `cost_ms` (priced up by `overrun`) is covered."""
        return self.credit_ms >= cost_ms * self.overrun

    def probed(self, cost_ms: float) -> None:
        """A probe round of predicted extra cost `cost_ms` runs this step."""
        charged = cost_ms * self.overrun
        self.credit_ms -= charged
        self._charged = (cost_ms, charged)
        self._judging = True

    def planned(self, drafts: bool) -> None:
        """A plan other than a round's was made: it drafts (`drafts`), or not. One that does restores the budget;
        the first one after a round that does not halves it."""
        if drafts:
            self.scale = 1.0
        elif self._judging:
            self.scale = max(self.scale / 2, MIN_BUDGET_SCALE)
        self._judging = False

    def settle(self, measured_ms: float, decay: float = 0.5) -> None:
        """The running round cost `measured_ms`: it is paid in full, and `overrun` learns from it."""
        if self._charged is None:
            return
        (predicted, charged), self._charged = self._charged, None
        self.credit_ms -= measured_ms - charged
        ratio = measured_ms / max(predicted, 1e-3)
        self.overrun = float(min(max(decay * self.overrun + (1 - decay) * ratio, 1 / MAX_OVERRUN), MAX_OVERRUN))

    def due(self, req_ids: list[str]) -> np.ndarray:
        """(B,) int64: 1 for the requests due for a probe, else 0."""
        every, since = self._every, self._since
        return np.fromiter(
            (since.get(r, 0) >= every.get(r, self.interval) for r in req_ids), dtype=np.int64, count=len(req_ids)
        )

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self._since.pop(r, None)
            self._every.pop(r, None)
