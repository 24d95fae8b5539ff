"""Autoscaling in the simulated fleet: Serve's own decision code on the simulator's clock.

Every `control_period_s` the autoscaler builds a real `ray.serve.config.AutoscalingContext` from the
replicas' routing stats (as `record_autoscaling_stats` reports them) and asks the configured policy:
`cluster.autoscale.HeadroomPolicy` (`headroom`) or Serve's default, `_core_replica_queue_length_policy`
(`ongoing_requests`, requests in flight against `target_ongoing_requests`). Serve's scaling factors and
delay logic (`_apply_scaling_factors`, `_apply_delay_logic`, called with the simulated time) and the
bounds turn that into a target. A replica started takes `startup_s` before it serves; one stopped
stops taking requests at once and leaves when its last request finishes (Serve's graceful shutdown).
Replica-seconds count every replica from its start to its end, starting and draining included.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cluster.autoscale import HeadroomPolicy, HeadroomScaling
from replicas.routing_stats import RoutingStats, autoscaling_metrics


class SimAutoscaling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["headroom", "ongoing_requests"] = "headroom"
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int | None = Field(default=None, ge=1, description="default: every replica the fleet describes")
    initial_replicas: int | None = Field(default=None, ge=1, description="default: min_replicas")
    target_ongoing_requests: float = Field(default=32.0, gt=0, description="ongoing_requests policy")
    headroom: HeadroomScaling = Field(default_factory=HeadroomScaling)
    upscale_delay_s: float = Field(default=10.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    control_period_s: float = Field(default=1.0, gt=0)
    startup_s: float = Field(default=30.0, ge=0, description="from start to serving (engine start, weights, warm-up)")


class State(IntEnum):
    STOPPED = 0
    STARTING = 1
    ACTIVE = 2
    DRAINING = 3


class SimAutoscaler:
    def __init__(self, config: SimAutoscaling, replicas: int) -> None:
        from ray.serve.autoscaling_policy import _core_replica_queue_length_policy
        from ray.serve.config import AutoscalingConfig

        self.config = config
        self.most = min(config.max_replicas or replicas, replicas)
        initial = min(max(config.initial_replicas or config.min_replicas, config.min_replicas), self.most)
        self.state = np.full(replicas, State.STOPPED, dtype=np.int8)
        self.state[:initial] = State.ACTIVE
        self.ready_at = np.full(replicas, np.inf)
        self.target = initial
        self.serve_config = AutoscalingConfig(
            min_replicas=config.min_replicas, max_replicas=self.most, target_ongoing_requests=config.target_ongoing_requests,
            upscale_delay_s=config.upscale_delay_s, downscale_delay_s=config.downscale_delay_s)
        self.policy = (HeadroomPolicy(**config.headroom.model_dump()) if config.policy == "headroom"
                       else _core_replica_queue_length_policy)
        self.policy_state: dict = {}
        self.replica_seconds = 0.0
        self._accounted_at = 0.0
        self.timeline: list[tuple[float, int, int]] = [(0.0, initial, initial)]  # (time, serving, target)

    @property
    def routable(self) -> np.ndarray:
        return self.state == State.ACTIVE

    def settle_accounts(self, now: float) -> None:
        """Count replica-seconds up to `now` (the end of a run)."""
        self._account(now)

    def _account(self, now: float) -> None:
        self.replica_seconds += int((self.state != State.STOPPED).sum()) * max(now - self._accounted_at, 0.0)
        self._accounted_at = now

    def tick(self, now: float, stats: list[RoutingStats], in_flight: np.ndarray, queued: int = 0) -> bool:
        """One control-loop pass (`queued`: requests waiting at the ingress); True when the set of replicas taking
        requests changed."""
        from ray.serve._private.common import DeploymentID, ReplicaID
        from ray.serve.autoscaling_policy import _apply_delay_logic, _apply_scaling_factors
        from ray.serve.config import AutoscalingContext

        self._account(now)
        changed = self._settle(now, in_flight)
        active = np.flatnonzero(self.routable)
        dep = DeploymentID(name="EngineReplica", app_name="sim")
        ids = [ReplicaID(unique_id=f"replica-{i}", deployment_id=dep) for i in active]
        reports = [autoscaling_metrics(stats[i]) for i in active]
        metrics = {name: {rid: r[name] for rid, r in zip(ids, reports)} for name in (reports[0] if reports else {})}
        ctx = AutoscalingContext(
            deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=len(active),
            target_num_replicas=self.target, running_replicas=ids, total_num_requests=float(in_flight[active].sum() + queued),
            total_queued_requests=float(queued), aggregated_metrics=metrics, raw_metrics=None,
            capacity_adjusted_min_replicas=self.config.min_replicas, capacity_adjusted_max_replicas=self.most,
            policy_state=self.policy_state, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
            config=self.serve_config)
        desired, _ = self.policy(ctx)
        desired = _apply_scaling_factors(desired, len(active), self.serve_config) if len(active) else desired
        decided, self.policy_state = _apply_delay_logic(max(0, int(np.ceil(desired))), self.target, self.serve_config,
                                                        self.policy_state, _now=now)
        target = int(min(max(decided, self.config.min_replicas), self.most))
        if target != self.target:
            self.target = target
            changed |= self._reconcile(now, in_flight)
        entry = (now, int(self.routable.sum()), self.target)
        if entry[1:] != self.timeline[-1][1:]:
            self.timeline.append(entry)
        return changed

    def _settle(self, now: float, in_flight: np.ndarray) -> bool:
        """Started replicas that are ready serve; draining ones with nothing left stop."""
        ready = (self.state == State.STARTING) & (self.ready_at <= now)
        self.state[ready] = State.ACTIVE
        self.state[(self.state == State.DRAINING) & (in_flight <= 0)] = State.STOPPED
        return bool(ready.any())

    def next_ready(self) -> float:
        return float(self.ready_at[self.state == State.STARTING].min(initial=np.inf))

    def _reconcile(self, now: float, in_flight: np.ndarray) -> bool:
        live = np.flatnonzero((self.state == State.ACTIVE) | (self.state == State.STARTING))
        if self.target > len(live):
            for i in np.flatnonzero(self.state == State.STOPPED)[: self.target - len(live)]:
                self.state[i], self.ready_at[i] = State.STARTING, now + self.config.startup_s
            return False
        excess = len(live) - self.target
        starting = np.flatnonzero(self.state == State.STARTING)[::-1][:excess]
        self.state[starting] = State.STOPPED
        excess -= len(starting)
        active = np.flatnonzero(self.state == State.ACTIVE)
        drain = active[np.argsort(in_flight[active], kind="stable")][:excess]
        self.state[drain] = State.DRAINING
        return len(drain) > 0
