"""An ingress over several engine deployments: a fleet that mixes tensor-parallel sizes.

Serve gives every replica of a deployment the same resources, so replicas at TP 1 and TP 2 need a deployment
each (`cluster/app.py`), and each deployment's handle has its own router (`cluster/router.py`), which places
within that deployment. Per request the ingress asks each deployment's router for the TPOT slack its best
replica would keep with the request (`AcceptanceHeadroomRouter.best_slack`: the same score it ranks by, each
replica priced by its own cost model) and calls the deployment with the most; that router then places it
(and admits it or not) as it always does. A deployment whose every replica holds its `max_ongoing_requests`
would queue the request, so it loses it to one with room. Until every deployment's replicas have reported stats, requests
go to a deployment at random in proportion to its replicas, as Serve's power-of-two fallback spreads them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from cluster import router_registry
from replicas.openai_api import Reply


class FleetBackend:
    """`replicas.openai_api.Backend` over `HandleBackend`s of several engine deployments."""

    def __init__(self, backends: list, seed: int | None = None) -> None:
        self.backends = backends
        self.rng = random.Random(seed)

    def choose(self, body: dict | None):
        """The backend whose deployment's best replica keeps the most TPOT slack with `body` placed there."""
        routers = [router_registry.ROUTERS.get(b.deployment_name) for b in self.backends]
        for backend, router in zip(self.backends, routers):
            if router is None:  # Serve makes a handle's router on its first request
                return backend
        slacks = [router.best_slack(body) for router in routers]
        if any(s is None for s in slacks):
            weights = [max(len(router.curr_replicas), 1) for router in routers]
            return self.rng.choices(self.backends, weights)[0]
        return self.backends[max(range(len(slacks)), key=slacks.__getitem__)]

    async def completions(self, body: dict, raw_request=None) -> Reply:
        return await self.choose(body).completions(body, raw_request)

    async def chat_completions(self, body: dict, raw_request=None) -> Reply:
        return await self.choose(body).chat_completions(body, raw_request)

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
