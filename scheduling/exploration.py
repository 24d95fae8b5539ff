"""Exploration: one-token probes for requests whose acceptance nobody has looked at lately.

A request the planner leaves undrafted yields no verdict, so a wrong belief
about it would never be corrected. After `interval` of its steps without a
verified draft, a request becomes due: the next plan forces one draft slot
for it (a `lo` of 1, which the planner prices like any forced slot), and its
verdict reaches the estimator and `scheduling.recalibration`. A rejected
probe doubles that request's interval (up to `max_backoff` times the base),
an accepted one resets it, so requests that keep rejecting cost ever fewer
probes. A probe's width is chosen before drafting from earlier verdicts
only: exploration changes which drafts are verified, never how.
"""

from __future__ import annotations

import numpy as np


class ProbeSchedule:
    def __init__(self, interval: int = 16, max_backoff: int = 8) -> None:
        if interval < 1 or max_backoff < 1:
            raise ValueError("need interval >= 1 and max_backoff >= 1")
        self.interval = interval
        self.max_backoff = max_backoff
        self._since: dict[str, int] = {}  # request -> its steps since its last verified draft (or arrival)
        self._every: dict[str, int] = {}  # request -> its current interval
        self._step = 0  # engine steps observed
        self._last_round = -interval  # the step of the last probe round (a round is open at once)
        self.round_every = interval  # engine steps from one probe round to the next

    def observe(self, req_ids: list[str], verified: np.ndarray, accepted: np.ndarray) -> bool:
        """One step of these requests; True when some of them are due for a probe next and a probe round is open."""
        self._step += 1
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
        return due and self.round_open()

    def round_open(self) -> bool:
        """A step that drafts only to probe may run now."""
        return self._step - self._last_round >= self.round_every

    def probed(self) -> None:
        """This step was a probe round (the planner alone would have drafted nothing): the next opens later."""
        self._last_round = self._step
        self.round_every = min(2 * self.round_every, self.interval * self.max_backoff)

    def drafting(self) -> None:
        """The planner drafted on its own this step: probe rounds are back to their base interval."""
        self.round_every = self.interval

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
