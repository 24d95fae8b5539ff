"""One engine replica as a Ray Serve deployment class: a WCS engine answering handle calls.

The HTTP ingress (`cluster/ingress.py`) parses each request and calls
`EngineReplica.call` through a deployment handle, so the cluster router sees
the request body. A call streams its answer back: first `(status, body)`
(`body` is None when SSE lines follow), then lists of SSE lines, batched for
`stream_batch_ms` so a fast stream does not cost one Ray message per token.
Cancelling the call (the client went away) cancels the generator here, which
aborts the request in the engine.

Every `stats_period_s` the replica refreshes what it tells the router
(`record_routing_stats`) and exports its WCS series through Ray's metrics
system (`replicas.metrics.RayExport`); vLLM's own go there through
`RayPrometheusStatLogger`. Nothing the router needs goes through metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.engine import EngineConfig, cpu_engine_environment, lower_priority
from replicas.metrics import LatestSchedulerStats, RayExport, measured_step_ms, process_cpu_seconds, replica_families
from replicas.openai_api import exception_reply
from replicas.overrides import merged
from replicas.routing_stats import RoutingStats, StepMix, autoscaling_metrics, routing_stats, step_mix

logger = logging.getLogger("ray.serve")

ROUTES = ("completions", "chat_completions", "list_models")


class AutoscalingBounds(BaseModel):
    """Serve autoscaling of the engine replicas (replaces `num_replicas` when set)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    policy: Literal["headroom", "ongoing_requests"] = Field(
        default="headroom", description="headroom: replicas to keep the TPOT SLO from each replica's cost model and acceptance "
        "(cluster/autoscale.py); ongoing_requests: Serve's default, requests in flight against target_ongoing_requests")
    headroom: dict[str, float] = Field(default_factory=dict, description="the headroom policy's settings (cluster.autoscale.HeadroomScaling)")
    target_ongoing_requests: float = Field(default=32.0, gt=0, description="requests in flight per replica Serve aims for "
                                           "(ongoing_requests policy)")
    upscale_delay_s: float = Field(default=10.0, ge=0, description="a scale-up must be wanted this long")
    downscale_delay_s: float = Field(default=60.0, ge=0, description="a scale-down must be wanted this long (hysteresis)")

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingBounds":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class EngineGroup(BaseModel):
    """`count` replicas of the deployment that run its `engine` with these overrides: a heterogeneous fleet
    whose replicas share their resources (some without a drafter, another batch size). A replica takes its
    group by its Serve rank (0..N-1 in the order of the groups); Serve keeps ranks compact, so a replacement
    takes the rank, and the group, of the replica it replaces. Replicas that differ in resources (GPU kind,
    tensor parallelism) need a deployment each: groups at another `tensor_parallel_size` become one
    (`ReplicaConfig.by_tensor_parallel`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    count: int = Field(ge=1)
    engine: dict[str, Any] = Field(default_factory=dict, description="overrides of the replica's `engine`, merged key "
                                   "by key (`drafter: null`: no drafter, autoregressive decoding)")


class ReplicaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str = "forespark"
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs reserved per replica actor")
    accelerator: Literal["cpu", "gpu"] = Field(
        default="cpu", description="gpu: one GPU per tensor-parallel rank, placed as one placement-group bundle each"
    )
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica (pins replicas to node types)")
    autoscaling: AutoscalingBounds | None = Field(default=None, description="Serve autoscaling bounds; None: num_replicas fixed")
    max_ongoing_requests: int = Field(default=64, ge=1, description="requests in flight per replica")
    max_queued_requests: int = Field(default=256, ge=1, description="requests waiting at each caller beyond those")
    tpot_slo_ms: float = Field(default=20.0, gt=0, description="TPOT SLO: defines the router's headroom")
    stats_period_s: float = Field(default=1.0, gt=0, description="routing stats and metrics refresh period")
    stream_batch_ms: float = Field(default=50.0, ge=0, description="SSE lines after a stream's first are sent to the ingress "
                                   "in batches this old (as Ray Serve LLM's stream batching, 50 ms by default): each batch is "
                                   "one Ray message through the ingress and the proxy")
    niceness: int = Field(default=15, ge=0, le=19, description="the replica's process (and its engine core's) runs at this "
                          "niceness or lower priority: below the serving path's (HTTP proxy, ingress), whose latency is a "
                          "request's, while an engine's work is a batch's (Ray's own worker niceness is 15; a Ray that "
                          "`forespark serve` starts runs its workers at 0, `cluster/serve_env.py`)")
    groups: list[EngineGroup] = Field(default_factory=list, description="replicas with other engine settings, by rank "
                                      "(EngineGroup); num_replicas becomes their total")

    @model_validator(mode="after")
    def _groups(self) -> "ReplicaConfig":
        if self.groups:
            if self.autoscaling is not None:
                raise ValueError("groups fix each replica's engine by its rank: they cannot be autoscaled")
            names = [g.name for g in self.groups]
            if len(set(names)) < len(names):
                raise ValueError(f"group names repeat: {names}")
            self.num_replicas = sum(g.count for g in self.groups)
            for group in self.groups:
                self.group_engine(group)  # overrides checked at load, not at a replica's start
        return self

    def by_tensor_parallel(self) -> list["ReplicaConfig"]:
        """A config per tensor-parallel size among the groups, in their order: each becomes a deployment of its own
        (Serve gives a deployment's replicas the same resources; `cluster/app.py`). Without groups, or with one size,
        this config alone."""
        sizes = list(dict.fromkeys(self.group_engine(g).tensor_parallel_size for g in self.groups))
        if len(sizes) <= 1:
            return [self]
        base = self.model_dump()
        out = []
        for tp in sizes:
            groups = [{**g.model_dump(), "engine": {k: v for k, v in g.engine.items() if k != "tensor_parallel_size"}}
                      for g in self.groups if self.group_engine(g).tensor_parallel_size == tp]
            out.append(ReplicaConfig.model_validate({**base, "engine": {**base["engine"], "tensor_parallel_size": tp},
                                                     "groups": groups}))
        return out

    def group_of(self, rank: int) -> EngineGroup | None:
        """The group of the replica of this rank (None without groups; past the last, the last)."""
        end = 0
        for group in self.groups:
            end += group.count
            if rank < end:
                return group
        return self.groups[-1] if self.groups else None

    def group_engine(self, group: EngineGroup | None) -> EngineConfig:
        if group is None or not group.engine:
            return self.engine
        return EngineConfig.model_validate(merged(self.engine.model_dump(), group.engine))

    def replica_engine(self, rank: int = 0) -> EngineConfig:
        """The engine config as the replica of this rank runs it: its group's, with tensor parallelism over GPUs
        through Ray (the replica's placement group)."""
        engine = self.group_engine(self.group_of(rank))
        if self.accelerator == "gpu" and engine.tensor_parallel_size > 1 and engine.distributed_executor_backend is None:
            engine = engine.model_copy(update={"distributed_executor_backend": "ray"})
        return engine


def replica_rank() -> int:
    """This replica's rank in its deployment (0 outside a Serve replica)."""
    from ray import serve

    try:
        rank = serve.get_replica_context().rank
    except RuntimeError:
        return 0
    return int(getattr(rank, "rank", rank))


async def batched(lines: AsyncIterator[str], window_s: float) -> AsyncIterator[list[str]]:
    """Lines from `lines` in lists: the first line alone, at once (the client's time to first token), then each
    list holds what arrived within `window_s` of its first line, and the stream's end goes at once, not at the
    window's (a request's last tokens are its end-to-end latency).

    The source is drained by its own task; closing this generator cancels that task (and so the request).
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    ended = asyncio.Event()

    async def pump() -> None:
        try:
            async for line in lines:
                queue.put_nowait(line)
        except Exception as e:  # delivered to the consumer below
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)
            ended.set()

    task = asyncio.create_task(pump())
    started = False
    try:
        while True:
            batch = [await queue.get()]
            if started and window_s > 0 and isinstance(batch[0], str):
                try:
                    await asyncio.wait_for(ended.wait(), window_s)
                except asyncio.TimeoutError:
                    pass
            started = True
            while not queue.empty() and isinstance(batch[-1], str):
                batch.append(queue.get_nowait())
            out = [x for x in batch if isinstance(x, str)]
            if out:
                yield out
            for x in batch:
                if isinstance(x, Exception):
                    raise x
            if done in batch:
                return
    finally:
        task.cancel()


class EngineReplica:
    """A Serve deployment class (`cluster/app.py` deploys it): one WCS engine per replica."""

    async def __init__(self, config: ReplicaConfig) -> None:
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from replicas.openai_api import OpenAIEngine

        cpu_engine_environment()
        lower_priority(config.niceness)  # (before the engine core starts: it inherits it)
        self.config = config
        self.rank = replica_rank()
        self.group = config.group_of(self.rank)
        if self.group is not None:
            logger.info("replica of rank %d runs group %r", self.rank, self.group.name)
        self.scheduler = LatestSchedulerStats()
        self.engine = await OpenAIEngine.start(
            config.replica_engine(self.rank), config.served_model_name, stat_loggers=[self.scheduler.factory(), RayPrometheusStatLogger]
        )
        self._stats: RoutingStats | None = None
        self.aborted = 0
        self._mix = StepMix()
        self._wcs: dict | None = None
        self._step_ms: float | None = None  # measured over the last stats period that ran steps
        self._export = RayExport()
        self._decoded: tuple[float, int] = (0.0, 0)  # the engine's decode totals at the last refresh
        await self._refresh()
        self._loop = asyncio.create_task(self._refresh_forever())

    async def call(self, route: str, body: dict | None = None, slo: dict | None = None, ticket: int | None = None) -> AsyncIterator:
        """`slo` (the request's own SLOs) and `ticket` (the ingress's tag for admission's feedback) are read by
        the cluster router; the engine ignores them."""
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}")
        fn = getattr(self.engine, route)
        try:
            reply = await (fn() if route == "list_models" else fn(body))
        except Exception as e:  # answered here: an exception through the handle would read as a failed replica
            logger.warning("request failed in the replica: %s: %s", type(e).__name__, e)
            reply = exception_reply(e)
        yield (reply.status, reply.body)
        if reply.stream is None:
            return
        finished = False
        try:
            async for lines in batched(reply.stream, self.config.stream_batch_ms / 1000.0):
                yield lines
            finished = True
        finally:
            if not finished:  # the caller went away: closing the stream aborted the engine request
                self.aborted += 1

    async def runner_info(self) -> dict:
        """This replica's process and, per engine rank, its process and model runner (`WCSWorker.wcs_runner_info`)."""
        import os

        ranks = await self.engine.engine.collective_rpc("wcs_runner_info") if self.engine.has_wcs else []
        return {"pid": os.getpid(), "ranks": ranks}

    async def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        await self.engine.check_health()

    def record_routing_stats(self) -> dict:
        return {} if self._stats is None else self._stats.model_dump()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the same stats, for `cluster.autoscale.HeadroomPolicy`."""
        return {} if self._stats is None else autoscaling_metrics(self._stats)

    async def _refresh(self) -> None:
        engine = self.engine
        before, accept_len = self._wcs, 1.0
        if engine.has_wcs:
            self._wcs = await engine.wcs_stats()
            self._step_ms = measured_step_ms(self._wcs, before) or self._step_ms
            accept_len = (await engine.engine.collective_rpc("wcs_batch_acceptance"))[0]
            # An idle period says nothing about the mix: keep the last one measured.
            self._mix = step_mix(self._wcs, before) or self._mix
        # The engine's own count is current; the scheduler's is as of the last step (stale when idle).
        unfinished = engine.engine.get_num_unfinished_requests()
        waiting = self.scheduler.waiting if unfinished else 0
        realised, self._decoded = self.scheduler.realised_tpot_ms(self._decoded)
        self._stats = routing_stats(
            cost=engine.cost,
            running=max(0, unfinished - waiting),
            waiting=waiting,
            kv_usage=self.scheduler.kv_usage,
            max_num_seqs=engine.config.max_num_seqs,
            token_budget=engine.engine.vllm_config.scheduler_config.max_num_batched_tokens,
            cap_ms=self.config.tpot_slo_ms,
            mix=self._mix,
            predicted_accept_len=accept_len,
            realised_tpot_ms=realised,
        )

    def _export_metrics(self) -> None:
        self._export.export(
            replica_families(self._wcs, self._stats, self.aborted, process_cpu_seconds(), self.scheduler, self._step_ms)
        )

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_period_s)
            try:
                await asyncio.wait_for(self._refresh(), timeout=max(10.0, 5 * self.config.stats_period_s))
                self._export_metrics()
            except Exception:  # an engine that died is reported by check_health; keep the loop alive
                if self.engine.engine.errored:
                    logger.warning("engine is dead; routing stats not refreshed")
                else:
                    logger.exception("refreshing routing stats failed")

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.cancel()  # before the engine goes: the loop would report a dead engine
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
