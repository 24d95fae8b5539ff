"""The Serve application: an HTTP ingress in front of the engine replicas, with the cluster router between.

    client --HTTP--> Ingress (OpenAI app, router) --handle--> EngineReplica x N (WCS engine each)

A fleet whose replica groups mix tensor-parallel sizes gets an engine deployment per size
(`EngineReplica-tp1`, `EngineReplica-tp2`, ...), and the ingress picks one per request (`cluster/fleet_backend.py`).

`AppConfig` is the whole application's configuration (what `forespark serve
--config` and `manifests/serve-local.yaml` hold). `build_app` turns it into a
bound Serve application; `app_builder` is the same for `serve run` /
`serve deploy` import paths (`cluster.app:app_builder`, the config as args).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.admission import AdmissionConfig
from cluster.ingress import Ingress, IngressConfig
from replicas.deployment import EngineReplica, ReplicaConfig

ROUTER_CLASSES = {
    "acceptance_headroom": "cluster.router:AcceptanceHeadroomRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default, for comparisons
}


HOLD_RETRY_S = 0.02


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["acceptance_headroom", "pow2"] = "acceptance_headroom"
    stale_after_s: float = Field(default=10.0, gt=0, description="replica stats older than this count as missing")
    tie_ms: float = Field(default=1.0, ge=0, description="TPOT-slack differences treated as ties (ms)")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="SLO-aware admission (this router only)")
    extrapolate_in_flight: bool = Field(default=True, description="each ingress replica counts what it routed since the "
                                        "replicas' stats times the number of ingress replicas (they share the traffic)")

    def request_router_config(self, stats_period_s: float, ingresses: int = 1):
        from ray.serve.config import RequestRouterConfig

        kwargs = (
            {}
            if self.kind == "pow2"
            else {"stale_after_s": self.stale_after_s, "tie_ms": self.tie_ms, "admission": self.admission.model_dump(),
                  "ingresses": ingresses if self.extrapolate_in_flight else 1}
        )
        # A request admission holds (`AdmissionLoop.hold`) is decided again at each of Serve's routing attempts:
        # at a steady HOLD_RETRY_S rather than Serve's doubling backoff (25, 50, 100, ... ms), which would leave it
        # waiting past the moment a replica comes back under its TPOT limit.
        holds = self.kind != "pow2" and self.admission.enabled and self.admission.hold_ms > 0
        backoff = {"initial_backoff_s": HOLD_RETRY_S, "backoff_multiplier": 1.0, "max_backoff_s": HOLD_RETRY_S} if holds else {}
        return RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[self.kind],
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=max(2.0 * stats_period_s, 5.0),
            **backoff,
        )


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)


def engine_deployment_options(config: ReplicaConfig) -> dict[str, Any]:
    """Resources of one engine replica: CPUs, or GPUs as one placement-group bundle per tensor-parallel rank."""
    tp = config.engine.tensor_parallel_size
    extra = {"resources": dict(config.resources)} if config.resources else {}
    if config.accelerator == "cpu":
        return {"ray_actor_options": {"num_cpus": config.num_cpus, **extra}}
    if tp == 1:
        return {"ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": 1, **extra}}
    # The replica actor takes only CPU; vLLM's Ray executor places one worker per GPU bundle.
    return {
        "ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": 0, **extra},
        "placement_group_bundles": [{"CPU": config.num_cpus, "GPU": 1, **config.resources}] + [{"GPU": 1}] * (tp - 1),
        "placement_group_strategy": "STRICT_PACK",
    }


def replica_count_options(config: ReplicaConfig) -> dict[str, Any]:
    if config.autoscaling is None:
        return {"num_replicas": config.num_replicas}
    a = config.autoscaling
    serve_config = a.model_dump(include={"min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"})
    if a.policy == "headroom":
        from cluster.autoscale import HeadroomScaling

        kwargs = HeadroomScaling.model_validate(a.headroom).model_dump()
        serve_config["policy"] = {"policy_function": "cluster.autoscale:HeadroomPolicy", "policy_kwargs": kwargs}
    return {"autoscaling_config": serve_config}


def build_app(config: AppConfig):
    from ray import serve

    parts = config.replica.by_tensor_parallel()  # a deployment per tensor-parallel size (cluster/fleet_backend.py)
    router = config.router
    if router.kind == "acceptance_headroom" and router.admission.chars_per_token is None:
        from cluster.prompt_model import chars_per_token

        measured = chars_per_token(parts[0].engine.model)
        router = router.model_copy(update={"admission": router.admission.model_copy(update={"chars_per_token": measured})})
    engines = [
        serve.deployment(EngineReplica).options(
            name="EngineReplica" if len(parts) == 1 else f"EngineReplica-tp{rc.engine.tensor_parallel_size}",
            **replica_count_options(rc),
            max_ongoing_requests=rc.max_ongoing_requests,
            max_queued_requests=rc.max_queued_requests,
            request_router_config=router.request_router_config(rc.stats_period_s, config.ingress.num_replicas),
            health_check_period_s=10,
            health_check_timeout_s=60,
            **engine_deployment_options(rc),
        ).bind(rc)
        for rc in parts
    ]
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="Ingress",
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    admission = router.admission if router.kind == "acceptance_headroom" else None
    return ingress.bind(engines[0] if len(engines) == 1 else engines, config.ingress, admission)


def app_builder(args: dict[str, Any]):
    """`serve run` / Serve config entry point: `import_path: cluster.app:app_builder`, `args:` an AppConfig."""
    return build_app(AppConfig.model_validate(args or {}))
