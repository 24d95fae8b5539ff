"""Offline validation of every manifest we ship: `forespark manifests check`.

Four kinds, told apart by their content:

- `ray up` cluster YAMLs (`provider:`): Ray's own `prepare_config` + `validate_config`
  (the JSON schema `ray up` applies; unknown keys are errors), and every `ray start` with
  Serve's settings (`cluster/serve_env.py`);
- Serve configs (`applications:`): `ServeDeploySchema`, then per application: its import
  path imports, its `args` are a valid `AppConfig` (unknown keys rejected), the request
  router's `RequestRouterConfig` builds (it imports the router class), and the bound application builds;
- KubeRay `RayService`s: the embedded `serveConfigV2` through the Serve checks, the Ray version
  pinned by this project, Serve's settings in every container's env, and GPU worker groups
  large enough for the replicas' tensor parallelism;
- Grafana dashboards (`panels:`, under `manifests/grafana/`): `cluster.dashboard.check_dashboard`
  (every panel queries ForeSpark's or vLLM's series as Ray exports them, through the datasource
  variable); `tests/test_metrics_ray.py` checks those series against a running application.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from cluster.serve_env import SERVE_ENV

MANIFESTS_DIR = Path(__file__).resolve().parent.parent / "manifests"


class ManifestError(ValueError):
    pass


def kind_of(doc: Any) -> str:
    if isinstance(doc, dict):
        if doc.get("kind") == "RayService":
            return "rayservice"
        if "panels" in doc:
            return "grafana"
        if "applications" in doc:
            return "serve"
        if "provider" in doc:
            return "cluster"
    raise ManifestError(
        "not a manifest this project ships: expected a ray up cluster config, a Serve config, a RayService or a Grafana dashboard"
    )


def check_cluster(doc: dict) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(doc)))
    except Exception as e:  # jsonschema.ValidationError, ValueError: Ray's own messages
        raise ManifestError(f"ray up config: {str(e).splitlines()[0]}") from None
    for group in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in doc.get(group) or [] if "ray start" in c]
        missing = [f"{k}={v}" for k, v in SERVE_ENV.items() if any(f"{k}={v}" not in c for c in starts)]
        if missing:
            raise ManifestError(f"ray up config: {group} start Ray without Serve's settings {missing} (cluster/serve_env.py)")


def _import(path: str) -> Any:
    from ray._common.utils import import_attr

    try:
        return import_attr(path)
    except Exception as e:
        raise ManifestError(f"import path {path!r} does not import: {e}") from None


def _no_unknown_keys(doc: Any, schema, where: str) -> None:
    fields = getattr(schema, "model_fields", None) or schema.__fields__
    unknown = sorted(set(doc) - set(fields)) if isinstance(doc, dict) else []
    if unknown:
        raise ManifestError(f"{where}: unknown keys {unknown}")


def check_serve(doc: dict) -> list:
    """Returns each application's validated `AppConfig`."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from ray.serve.schema import ServeApplicationSchema

    from cluster.app import AppConfig, build_app

    # Serve's schema lets unknown keys through; a typo there would be silently ignored on the cluster.
    _no_unknown_keys(doc, ServeDeploySchema, "Serve config")
    for app in doc.get("applications") or []:
        _no_unknown_keys(app, ServeApplicationSchema, f"application {app.get('name')!r}")
    try:
        schema = ServeDeploySchema.model_validate(doc) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(doc)
    except Exception as e:
        raise ManifestError(f"Serve config: {e}") from None
    configs = []
    for app in schema.applications:
        _import(app.import_path)
        if app.import_path != "cluster.app:app_builder":
            raise ManifestError(f"application {app.name!r}: import_path must be cluster.app:app_builder, not {app.import_path!r}")
        try:
            config = AppConfig.model_validate(app.args or {})
        except ValidationError as e:
            raise ManifestError(f"application {app.name!r} args: {e}") from None
        try:
            config.router.request_router_config(config.replica.stats_period_s)  # imports the router class
            build_app(config)
        except Exception as e:
            raise ManifestError(f"application {app.name!r} does not build: {e}") from None
        configs.append(config)
    return configs


def check_rayservice(doc: dict) -> None:
    import ray

    if doc.get("apiVersion") != "ray.io/v1":
        raise ManifestError(f"RayService apiVersion must be ray.io/v1, not {doc.get('apiVersion')!r}")
    spec = doc.get("spec") or {}
    serve_text = spec.get("serveConfigV2")
    if not isinstance(serve_text, str):
        raise ManifestError("RayService spec.serveConfigV2 must be the Serve config as a YAML string")
    try:
        configs = check_serve(yaml.safe_load(serve_text))
    except ManifestError as e:
        raise ManifestError(f"RayService serveConfigV2: {e}") from None
    cluster = spec.get("rayClusterConfig") or {}
    if cluster.get("rayVersion") != ray.__version__:
        raise ManifestError(f"RayService rayVersion {cluster.get('rayVersion')!r} is not this project's Ray {ray.__version__}")
    if "headGroupSpec" not in cluster:
        raise ManifestError("RayService rayClusterConfig has no headGroupSpec")
    for where, group in [("headGroupSpec", cluster["headGroupSpec"]), *(("workerGroupSpecs", g) for g in cluster.get("workerGroupSpecs") or [])]:
        for c in group.get("template", {}).get("spec", {}).get("containers", []):
            env = {e.get("name"): str(e.get("value")) for e in c.get("env") or []}
            missing = sorted(k for k, v in SERVE_ENV.items() if env.get(k) != v)
            if missing:
                raise ManifestError(f"RayService {where} container {c.get('name')!r} lacks Serve's settings {missing} (cluster/serve_env.py)")
    gpus = [
        int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        for group in cluster.get("workerGroupSpecs") or []
        for c in group.get("template", {}).get("spec", {}).get("containers", [])
    ]
    for config in configs:
        tp = config.replica.engine.tensor_parallel_size
        if config.replica.accelerator == "gpu" and not any(g >= tp for g in gpus):
            raise ManifestError(f"RayService: no worker group has {tp} GPUs per pod for tensor_parallel_size {tp} (groups: {gpus})")


def check_grafana(doc: dict) -> None:
    from cluster.dashboard import check_dashboard

    try:
        check_dashboard(doc)
    except ValueError as e:
        raise ManifestError(str(e)) from None


CHECKS = {"cluster": check_cluster, "serve": check_serve, "rayservice": check_rayservice, "grafana": check_grafana}


def check_file(path: Path) -> str:
    """The manifest's kind; raises `ManifestError` with the first problem found."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ManifestError(f"unreadable: {e}") from None
    kind = kind_of(doc)
    CHECKS[kind](doc)
    return kind


def shipped_manifests() -> list[Path]:
    return sorted(MANIFESTS_DIR.glob("*.yaml")) + sorted(MANIFESTS_DIR.glob("grafana/*.json"))
