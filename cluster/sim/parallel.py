"""The fleet's engines stepped in worker processes, with the same results as stepping them in the fleet's own.

Engines do not interact: a step depends only on its engine's state, the requests routed to it before the
step starts, and keyed acceptance draws (`cluster/sim/acceptance.py`). Only the router couples them, and it
needs a step's outcome (its duration, the requests it finished) only when the step ends, which is never
sooner than the engine's shortest step. So a step is sent to its engine's worker when it starts and
collected when the fleet's clock reaches its start plus that lower bound (`lower_bound_s`): meanwhile the
fleet goes on routing and starting other engines' steps, which the workers compute side by side (a
conservative parallel discrete-event simulation, with the shortest step as its lookahead). Commands reach a
worker in the fleet's event order, so each engine sees what it sees when the fleet steps it itself.

A host model (`HostModel`) makes every engine's speed depend on the others: such fleets step in one process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from typing import Any

from cluster.sim.engine import SimEngine, SimRequest, StepResult
from replicas.routing_stats import RoutingStats

_BOUND_SHARE = 0.9  # of the cheapest step (one request, one token), at eight noise deviations below its mean
_POLL_S, _SILENCE_S = 1.0, 600.0  # a worker silent this long while a step is awaited is taken as hung


def lower_bound_s(engine: SimEngine) -> float:
    """A duration no step of `engine` goes below (checked on every step)."""
    return _BOUND_SHARE * engine.true_cost.step_ms(1, 0, 1) * math.exp(-8.0 * engine.spec.noise_sd) / 1e3


def _serve(conn: Connection, engines: dict[int, SimEngine]) -> None:
    """A worker: run command batches in order, answer those that ask for something."""
    try:
        while True:
            replies: list[tuple] = []
            for op, *args in conn.recv():
                if op == "add":
                    engines[args[0]].add(args[1])
                elif op == "step":
                    i, now, token = args
                    replies.append(("step", token, engines[i].step(now)))
                elif op == "stats":
                    replies.append(("stats", {i: e.routing_stats(args[0]) for i, e in engines.items()}))
                elif op == "emitted":
                    replies.append(("emitted", sum(e.emitted for e in engines.values())))
                elif op == "close":
                    conn.send([("engines", engines)])
                    return
            if replies:
                conn.send(replies)
    except EOFError:  # the fleet went away
        return
    except BaseException:
        conn.send([("error", traceback.format_exc())])


class EngineShards:
    """`engines` split over `workers` processes (engine i in worker i % workers); `stop` ends them."""

    def __init__(self, engines: list[SimEngine], workers: int) -> None:
        if "fork" not in mp.get_all_start_methods():
            raise RuntimeError("stepping engines in workers needs the fork start method (Linux); use workers 0")
        ctx = mp.get_context("fork")  # the workers inherit the engines as built, without pickling them
        self.n, self.workers = len(engines), max(1, min(workers, len(engines)))
        self.lower_bound_s = [lower_bound_s(e) for e in engines]
        self._conns: list[Connection] = []
        self._procs = []
        for w in range(self.workers):
            mine, theirs = ctx.Pipe()
            shard = {i: e for i, e in enumerate(engines) if i % self.workers == w}
            p = ctx.Process(target=_serve, args=(theirs, shard), daemon=True, name=f"sim-engines-{w}")
            p.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(p)
        self._pending: list[list[tuple]] = [[] for _ in range(self.workers)]
        self._steps: dict[int, tuple[int, float, StepResult]] = {}  # token -> (engine, start, result)
        self._started: dict[int, tuple[int, float]] = {}  # token -> (engine, start), until its result is collected
        self._answers: list[dict[str, Any]] = [{} for _ in range(self.workers)]

    def stop(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join()

    def _send(self, w: int, command: tuple, now: bool = False) -> None:
        self._pending[w].append(command)
        if now:
            self._flush(w)

    def _flush(self, w: int) -> None:
        if self._pending[w]:
            self._conns[w].send(self._pending[w])
            self._pending[w] = []

    def _receive(self, w: int) -> None:
        self._flush(w)
        waited = 0.0
        while not self._conns[w].poll(_POLL_S):
            waited += _POLL_S
            if not self._procs[w].is_alive() or waited >= _SILENCE_S:
                raise RuntimeError(f"simulator worker {w} {'exited' if not self._procs[w].is_alive() else 'stopped answering'}"
                                   f" (exit code {self._procs[w].exitcode})")
        for kind, *rest in self._conns[w].recv():
            if kind == "error":
                raise RuntimeError(f"a simulator worker failed:\n{rest[0]}")
            if kind == "step":
                token, result = rest
                i, start = self._started.pop(token)
                self._steps[token] = (i, start, result)
            else:
                self._answers[w][kind] = rest[0]

    def _answer(self, w: int, kind: str) -> Any:
        while kind not in self._answers[w]:
            self._receive(w)
        return self._answers[w].pop(kind)

    def add(self, i: int, request: SimRequest) -> None:
        self._send(i % self.workers, ("add", i, request))

    def step(self, i: int, now: float, token: int) -> None:
        """Start engine i's step at `now`; collect it with `result(token)` from `now + lower_bound_s[i]`."""
        self._started[token] = (i, now)
        self._send(i % self.workers, ("step", i, now, token), now=True)

    def result(self, token: int) -> StepResult:
        i = self._started[token][0] if token in self._started else self._steps[token][0]
        while token not in self._steps:
            self._receive(i % self.workers)
        i, start, result = self._steps.pop(token)
        if result.duration_s <= self.lower_bound_s[i]:
            raise RuntimeError(
                f"replica {i}'s step at {start:.6f} s took {result.duration_s * 1e3:.4f} ms, not more than the "
                f"{self.lower_bound_s[i] * 1e3:.4f} ms its steps were bounded by: a step that schedules nothing, or "
                "a cost profile cheaper than its one-token step; simulate it with workers 0"
            )
        return result

    def routing_stats(self, now: float) -> list[RoutingStats]:
        for w in range(self.workers):
            self._send(w, ("stats", now), now=True)
        shards: dict[int, RoutingStats] = {}
        for w in range(self.workers):
            shards.update(self._answer(w, "stats"))
        return [shards[i] for i in range(self.n)]

    def emitted(self) -> int:
        for w in range(self.workers):
            self._send(w, ("emitted",), now=True)
        return sum(self._answer(w, "emitted") for w in range(self.workers))

    def close(self) -> list[SimEngine]:
        """The engines as the workers left them (after any steps still out); the workers exit."""
        engines: dict[int, SimEngine] = {}
        for w in range(self.workers):
            self._send(w, ("close",), now=True)
            engines.update(self._answer(w, "engines"))
        for p in self._procs:
            p.join()
        return [engines[i] for i in range(self.n)]
