"""The HTTP ingress deployment: the OpenAI app (`replicas/http_app.py`) over the engine replicas' handle.

The ingress parses each request and calls `EngineReplica.call(route, body)`
through a deployment handle, so the request router (which runs here, in the
handle's owner) sees the body. What the handle raises becomes an OpenAI
error: the callers' queue full, or admission (`cluster/admission.py`) predicting that
no replica meets the request's SLOs -> 429 (or 503) with Retry-After; a replica
that died before answering -> one retry on another replica, then 503; a
replica that dies mid-stream -> an error event and `data: [DONE]`. An
exception raised by the code of a live replica (bad input that only vLLM
rejects, such as `VLLMValidationError`) is the request's own outcome: a 400
with vLLM's message (500 for a server error), never retried elsewhere.
Disconnecting clients cancel their call, and with it the engine request.

With admission on, the ingress also closes admission's loop
(`cluster.admission.SLOFeedback`). It tags each request with a ticket, under
which the router keeps its prediction, and reports the TTFT (to the first
streamed chunk) and TPOT (over the rest, from the usage the stream ends with)
that it measured. While the router's last decision was a refusal for a full
fleet (`AdmissionGate`), it answers 429 without calling the handle; and before
it reads a request's body (behind Serve's proxy a call back to the proxy) it
asks the router whether admission would refuse any body now
(`AcceptanceHeadroomRouter.refusal_for_any_body`). What that look answers it
posts on admission's board (`cluster/admission_board.py`), from which the HTTP
proxy refuses requests itself: after each refusal it makes, each placement and
completion, and every `REFRESH_S` while the board refuses.

`GET /metrics` passes on ForeSpark's series from the Ray metrics agent of the
ingress's own node (`HandleBackend.metrics`); there is no central collector.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster import router_registry
from cluster.admission import (
    TPOT_HEADER,
    TTFT_HEADER,
    AdmissionConfig,
    AdmissionLoop,
    AdmissionRejected,
    Decision,
    RequestSLO,
    admission_loop,
)
from cluster.admission_board import Posted
from cluster.proxy_gate import GATE_HEADER
from cluster.router_metrics import DECISIONS
from replicas.openai_api import Reply, error_reply, exception_reply

logger = logging.getLogger("ray.serve")


class IngressConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key: str | None = Field(default=None, description="when set, /v1/* needs Authorization: Bearer <key>")
    num_replicas: int = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=2048, ge=1, description="HTTP requests in flight per ingress replica")
    overload_status: Literal[429, 503] = Field(default=429, description="status of requests turned away when queues are full")
    retry_after_s: int = Field(default=1, ge=1, description="their Retry-After header")


def _replica_gone(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


def raised_by_replica(e: BaseException) -> BaseException | None:
    """The exception a live replica's code raised, as the handle delivers it, or None for a failure of
    Ray or Serve (a dead or unreachable replica, a cancelled request).

    Through an actor call it arrives as a `RayTaskError` (an instance of the cause's class too, with
    `.cause`); through Serve's gRPC transport (the throughput mode) as the replica's exception itself.
    """
    from ray.exceptions import RayError, RayTaskError
    from ray.serve.exceptions import RayServeException

    if isinstance(e, RayTaskError):
        e = e.cause
    if isinstance(e, (RayError, RayServeException)):
        return None
    return e


def node_metrics_url(node_id: str | None = None) -> str:
    """The Prometheus endpoint of a node's Ray metrics agent (this process's node by default)."""
    import ray

    node_id = node_id or ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("Alive", True):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    raise LookupError(f"node {node_id} is not in the cluster")


def _fetch_text(url: str, timeout_s: float = 10.0) -> str:
    from urllib.request import urlopen

    with urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


GATED = DECISIONS.labels("acceptance_headroom", "gated")  # refused at the ingress's gate, before the router
BOARD = DECISIONS.labels("acceptance_headroom", "proxy")  # refused by the proxy from admission's board
GATE_MESSAGE = "no replica can serve the request within its SLOs now"
TTL_S, REFRESH_S = 0.05, 0.02  # a posted refusal's life; how often it is looked at again while posted
_COMPLETION_TOKENS = re.compile(r'"completion_tokens"\s*:\s*(\d+)')


class HandleBackend:
    """`replicas.openai_api.Backend` over the engine deployment's handle."""

    def __init__(self, handle, config: IngressConfig, loop: AdmissionLoop | None = None) -> None:
        self.handle = handle.options(stream=True)
        self.deployment_name = handle.deployment_name
        self.config = config
        self.loop = loop  # admission's, shared with the router (None: admission off)
        self._metrics_url: str | None = None  # this node's Ray metrics agent, found on the first GET /metrics
        self.board: Posted | None = None
        if loop is not None and loop.config.board:
            try:
                self.board = Posted(self.deployment_name, config.api_key)
                loop.listeners.append(self.post_board)
            except OSError as e:
                logger.warning("admission's board is off: %s", e)
        self._refreshing: asyncio.Task | None = None

    def gate_closed(self) -> bool:
        """Admission's gate: the router refused last and nothing finished since."""
        return self.loop is not None and self.loop.gate.closed()

    def refusal_before_body(self, headers: Mapping[str, str] | None = None) -> Reply | None:
        if self.gate_closed():
            reply = self._gated()
        else:
            decision = self.refusal_for_any_body(headers)
            reply = None if decision is None else self.refuse(decision)
        if reply is not None:
            self.post_board()
        return reply

    def post_board(self) -> None:
        """Post what admission answers any request with the application's SLOs now (`cluster/admission_board.py`),
        and count the refusals the proxy answered since the last post as this ingress's."""
        board, loop = self.board, self.loop
        if board is None:
            return
        answered = board.counted()
        if answered:
            BOARD.inc(answered)
            loop.decided(refused=True, count=answered)
        status, now = self.config.overload_status, time.monotonic()
        if loop.gate.closed(now):
            board.refuse(min(loop.gate.closed_until, now + TTL_S), status, loop.gate.retry_after_s, GATE_MESSAGE)
        elif (decision := self.refusal_for_any_body({})) is not None:
            rejected = AdmissionRejected(decision.retry_after_s, float(decision.ttft_ms.min()), float(decision.tpot_ms.min()))
            board.refuse(now + TTL_S, status, decision.retry_after_s, str(rejected))
        else:
            board.open()
        if board.refusing(now) and self._refreshing is None:
            try:
                self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
            except RuntimeError:  # no event loop here (a router's callback outside one): the next request starts it
                pass

    async def _refresh(self) -> None:
        """Look again every `REFRESH_S` while the board refuses: what changes with time alone (a replica's live
        TPOT, fresh routing stats) reopens it."""
        try:
            while self.board is not None and self.board.refusing():
                await asyncio.sleep(REFRESH_S)
                self.post_board()
        finally:
            self._refreshing = None

    def refusal_for_any_body(self, headers: Mapping[str, str] | None) -> Decision | None:
        """The router's refusal of any request with these headers now (looks only), or None."""
        router = router_registry.ROUTERS.get(self.deployment_name) if self.loop is not None and headers is not None else None
        if router is None:  # admission off, or Serve has not made the handle's router yet
            return None
        try:
            slo = RequestSLO.from_headers(headers)
        except ValueError:  # the request's own 400, once its body is read
            return None
        return router.refusal_for_any_body(slo.model_dump() if slo else None)

    def refuse(self, decision: Decision) -> Reply:
        refusal = router_registry.ROUTERS[self.deployment_name].refuse(decision)
        return self._refused(refusal.retry_after_s, str(refusal), self.loop if self.loop.gate.closed() else None)

    def _gated(self) -> Reply:
        GATED.inc()
        self.loop.decided(refused=True)
        return self._refused(self.loop.gate.retry_after_s, GATE_MESSAGE, self.loop)

    def _overloaded(self) -> Reply:
        return self._refused(self.config.retry_after_s, "the server is at capacity; retry later")

    async def _call(self, route: str, body: Any = None, raw_request=None) -> Reply:
        kwargs, start = {}, time.perf_counter()
        if raw_request is not None:
            try:
                slo = RequestSLO.from_headers(raw_request.headers)
            except ValueError as e:
                return error_reply(400, f"invalid SLO header ({TTFT_HEADER}, {TPOT_HEADER}): {e}")
            if slo is not None:
                kwargs["slo"] = slo.model_dump()
        loop = self.loop if route in ("completions", "chat_completions") else None
        if loop is None:
            return await self._dispatch(route, body, kwargs)
        if self.gate_closed():  # (it may have shut while the body was read)
            return self._gated()
        kwargs["ticket"] = ticket = loop.ticket()
        reply = await self._dispatch(route, body, kwargs, loop, start)
        if reply.stream is None:  # refused, failed, or a whole response (whose TTFT is not known here)
            loop.finished(ticket)
        return reply

    async def _dispatch(
        self, route: str, body: Any, kwargs: dict, loop: AdmissionLoop | None = None, start: float = 0.0
    ) -> Reply:
        from ray.serve.exceptions import BackPressureError

        for attempt in range(2):
            gen = self.handle.call.remote(route, body, **kwargs)
            try:
                status, first = await gen.__anext__()
            except BackPressureError:
                return self._overloaded()
            except AdmissionRejected as refusal:  # the router predicts no replica meets the SLOs: refused at once
                gated = loop if loop is not None and loop.gate.closed() else None  # (a full fleet shuts the gate)
                return self._refused(refusal.retry_after_s, str(refusal), gated)
            except Exception as e:
                raised = raised_by_replica(e)
                if raised is not None:  # the replica is alive and answered: never retried elsewhere
                    logger.warning("engine replica rejected the request: %s: %s", type(raised).__name__, raised)
                    return exception_reply(raised)
                if _replica_gone(e) and attempt == 0:
                    logger.warning("engine replica died before answering; retrying once: %s", e)
                    continue
                logger.exception("engine call failed")
                return error_reply(503, f"no engine replica could serve the request: {type(e).__name__}", "ServiceUnavailableError")
            if first is not None:
                return Reply(status, first)
            return Reply(status, stream=self._relay(gen, loop, kwargs.get("ticket", 0), start, measure=status == 200))
        raise AssertionError("unreachable")

    def _refused(self, retry_after_s: int, message: str, gated: AdmissionLoop | None = None) -> Reply:
        """`gated`: refused at the gate, which the reply tells the proxy (`cluster/proxy_gate.py`)."""
        headers = {"Retry-After": str(retry_after_s)}
        if gated is not None:
            headers[GATE_HEADER] = f"{gated.gate.remaining_s() * 1000.0:.0f}"
        return error_reply(
            self.config.overload_status,
            message,
            "RateLimitError" if self.config.overload_status == 429 else "ServiceUnavailableError",
            headers=headers,
        )

    async def _relay(
        self, gen, loop: AdmissionLoop | None = None, ticket: int = 0, start: float = 0.0, measure: bool = False
    ) -> AsyncIterator[str]:
        """`loop`: admission's, to which the request's measured TTFT and TPOT are reported (`ticket`) when
        `measure` (a response that streams tokens)."""
        measure = measure and loop is not None
        first, chunks, tokens = None, 0, 0
        try:
            async for lines in gen:
                text = "".join(lines)
                if measure:
                    first = first or time.perf_counter()
                    chunks += len(lines)
                    loop.streamed(ticket, len(lines))
                    if "completion_tokens" in text:
                        found = _COMPLETION_TOKENS.findall(text)
                        tokens = int(found[-1]) if found else tokens
                yield text  # one HTTP chunk, and one message to the proxy, per replica batch
            if measure and first is not None:
                # Without usage in the stream, its data events (at least one per token batch) stand in for tokens.
                n, end = tokens or chunks, time.perf_counter()
                tpot = (end - first) * 1000.0 / (n - 1) if n > 1 else None
                loop.finished(ticket, (first - start) * 1000.0, tpot, tokens=n, chunks=chunks)
        except Exception as e:  # the replica failed, or its code raised, mid-stream: end the stream properly
            logger.warning("engine stream failed: %s", e)
            raised = raised_by_replica(e)
            if raised is not None:
                err = exception_reply(raised)
            else:
                err = error_reply(503, f"the engine replica failed mid-stream: {type(e).__name__}", "ServiceUnavailableError")
            yield f"data: {json.dumps(err.body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if loop is not None:  # (a no-op after a report)
                loop.finished(ticket)
            gen.cancel()  # no-op when finished; aborts the engine request when the client went away

    async def completions(self, body: dict, raw_request=None) -> Reply:
        return await self._call("completions", body, raw_request)

    async def chat_completions(self, body: dict, raw_request=None) -> Reply:
        return await self._call("chat_completions", body, raw_request)

    async def list_models(self) -> Reply:
        return await self._call("list_models")

    async def check_health(self) -> None:
        pass  # Serve health-checks and replaces the engine replicas itself

    async def metrics(self) -> str:
        """ForeSpark's and vLLM's series as the Ray metrics agent of this ingress replica's node exports them.

        A single-node convenience that costs one local fetch per call and nothing otherwise: on a cluster it
        shows one node's replicas; Prometheus scrapes every node's agent instead (docs/deploy.md).
        """
        import asyncio

        from cluster.dashboard import filter_series

        try:
            self._metrics_url = self._metrics_url or await asyncio.to_thread(node_metrics_url)
            text = await asyncio.to_thread(_fetch_text, self._metrics_url)
        except Exception:  # the agent is restarting or unreachable: this scrape is empty
            logger.exception("reading this node's Ray metrics agent failed")
            return ""
        return filter_series(text)

    def shutdown(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


class Ingress:
    """Serve deployment class (`cluster/app.py` wraps it with `serve.ingress()`): builds the app at replica start."""

    def __init__(self, engine, config: IngressConfig, admission: AdmissionConfig | None = None) -> None:
        """`engine`: the engine deployment's handle, or a list of them (one per tensor-parallel size:
        `cluster/fleet_backend.py`); `admission`: the router's (None when it has none)."""
        on = admission is not None and admission.enabled
        backends = [HandleBackend(e, config, admission_loop(e.deployment_name, admission) if on else None)
                    for e in (engine if isinstance(engine, list) else [engine])]
        if len(backends) == 1:
            self.backend = backends[0]
        else:
            from cluster.fleet_backend import FleetBackend

            self.backend = FleetBackend(backends)
        self.config = config

    async def __serve_build_asgi_app__(self):
        from replicas.http_app import build_http_app

        async def start():
            return self.backend

        return build_http_app(start, api_key=self.config.api_key)
