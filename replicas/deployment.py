"""The Ray Serve deployment of one replica: a WCS engine behind its OpenAI HTTP app (`replicas/http_app.py`).

Serve runs the app's lifespan in each replica, which starts the engine there
(its core in a child process of the replica actor). The router and the
routing stats come with the cluster layer; until then Serve's default
router spreads requests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replicas.engine import EngineConfig


class ReplicaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str = "forespark"
    api_key: str | None = Field(default=None, description="when set, /v1/* needs Authorization: Bearer <key>")
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs reserved per replica actor")
    max_ongoing_requests: int = Field(default=64, ge=1, description="requests in flight per replica")
    max_queued_requests: int = Field(default=256, ge=1, description="requests waiting at each caller beyond those")
    overload_status: Literal[429, 503] = Field(default=429, description="status of requests turned away beyond both")
    retry_after_s: int = Field(default=1, ge=1, description="their Retry-After header")


def build_deployment(config: ReplicaConfig):
    """A bound Serve application serving `config` on `num_replicas` replicas."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    from replicas.http_app import engine_app

    app = engine_app(config.engine, config.api_key, config.served_model_name)

    @serve.deployment(
        name="EngineReplica",
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=config.overload_status, retry_after_s=config.retry_after_s),
        ray_actor_options={"num_cpus": config.num_cpus},
        health_check_period_s=10,
        health_check_timeout_s=60,
    )
    @serve.ingress(app)
    class EngineReplica:
        pass

    return EngineReplica.bind()
