"""An ingress over several engine deployments: a fleet that mixes tensor-parallel sizes.

Serve gives every replica of a deployment the same resources, so replicas at TP 1 and TP 2 need a deployment
each (`cluster/app.py`), and each deployment's handle has its own router (`cluster/router.py`), which places
within that deployment. Per request the ingress asks each deployment's router for the TPOT slack its best
replica would keep with the request (`AcceptanceHeadroomRouter.best_slack`: the same score it ranks by, each
replica priced by its own cost model) and calls the deployment with the most; that router then places it
(and admits it or not) as it always does. A deployment with as many of this ingress's requests outstanding as
its replicas run at once would queue the request, so it loses it to one with room: the ingress counts what it
sent to each deployment until its reply ends, since its router learns of a request only once Serve hands it
over, after the ingress has chosen. Until every deployment's replicas have reported stats, requests go to a
deployment at random in proportion to its replicas, as Serve's power-of-two fallback spreads them.
"""

from __future__ import annotations

import dataclasses
import random
import weakref
from collections.abc import AsyncIterator, Mapping

from cluster import router_registry
from replicas.openai_api import Reply


class FleetBackend:
    """`replicas.openai_api.Backend` over `HandleBackend`s of several engine deployments."""

    def __init__(self, backends: list, seed: int | None = None) -> None:
        self.backends = backends
        self.outstanding = [0] * len(backends)  # requests sent to each whose reply has not ended
        self.rng = random.Random(seed)

    def choose(self, body: dict | None) -> int:
        """The backend (its index) whose deployment's best replica keeps the most TPOT slack with `body` placed
        there, among those with room."""
        routers = [router_registry.ROUTERS.get(b.deployment_name) for b in self.backends]
        for i, router in enumerate(routers):
            if router is None:  # Serve makes a handle's router on its first request
                return i
        roomy = [i for i, router in enumerate(routers) if self.outstanding[i] < router.capacity()]
        candidates = roomy or list(range(len(routers)))
        slacks = [routers[i].best_slack(body) for i in candidates]
        if any(s is None for s in slacks):
            weights = [max(len(routers[i].curr_replicas), 1) for i in candidates]
            return self.rng.choices(candidates, weights)[0]
        return candidates[max(range(len(slacks)), key=slacks.__getitem__)]

    async def _serve(self, route: str, body: dict, raw_request) -> Reply:
        i = self.choose(body)
        self.outstanding[i] += 1
        try:
            reply = await getattr(self.backends[i], route)(body, raw_request)
        except BaseException:
            self.outstanding[i] -= 1
            raise
        if reply.stream is None:
            self.outstanding[i] -= 1
            return reply
        return dataclasses.replace(reply, stream=self._counted(reply.stream, i))

    def _counted(self, stream: AsyncIterator[str], i: int) -> AsyncIterator[str]:
        """`stream`, counted out of backend `i` once it ends, fails, or is dropped unread (a client that left
        before the first chunk: an async generator never started runs no `finally`)."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.outstanding[i] -= 1

        async def relay() -> AsyncIterator[str]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                release()

        counted = relay()
        weakref.finalize(counted, release)
        return counted

    async def completions(self, body: dict, raw_request=None) -> Reply:
        return await self._serve("completions", body, raw_request)

    async def chat_completions(self, body: dict, raw_request=None) -> Reply:
        return await self._serve("chat_completions", body, raw_request)

    def refusal_before_body(self, headers: Mapping[str, str] | None = None) -> Reply | None:
        """Refused only when every deployment would refuse any body (which one would serve the request depends on
        it): all their gates shut, or all their routers refusing."""
        if all(b.gate_closed() for b in self.backends):
            return self.backends[0].refusal_before_body(headers)
        decisions = [b.refusal_for_any_body(headers) for b in self.backends]
        if not all(d is not None for d in decisions):
            return None
        reply = self.backends[0].refuse(decisions[0])
        for b in self.backends:  # (the proxy refuses while every board does)
            b.post_board()
        return reply

    async def list_models(self) -> Reply:
        return await self.backends[0].list_models()

    async def check_health(self) -> None:
        pass  # Serve health-checks and replaces the engine replicas itself

    async def metrics(self) -> str:
        return await self.backends[0].metrics()  # one node's agent exports every deployment's series

    def shutdown(self) -> None:
        for b in self.backends:
            b.shutdown()
