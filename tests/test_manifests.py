"""Every shipped manifest validates offline, and a planted error of each kind is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.manifests import ManifestError, check_file, shipped_manifests

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"


def test_forespark_manifests_check_passes_on_everything_shipped():
    kinds = {p.name: check_file(p) for p in shipped_manifests()}
    assert kinds == {
        "ray-cluster-aws.yaml": "cluster", "ray-cluster-gcp.yaml": "cluster", "rayservice.yaml": "rayservice",
        "serve-gpu.yaml": "serve", "serve-local.yaml": "serve", "forespark.json": "grafana",
    }
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "manifests", "check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "6 of 6 manifests valid" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_the_rayservice_embeds_the_gpu_serve_config():
    service = yaml.safe_load((MANIFESTS / "rayservice.yaml").read_text())
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == yaml.safe_load((MANIFESTS / "serve-gpu.yaml").read_text())


def _load(name: str) -> dict:
    return yaml.safe_load((MANIFESTS / name).read_text())


def _cluster_unknown_key(d):
    d["available_node_types"]["gpu-tp1"]["node_confg"] = d["available_node_types"]["gpu-tp1"].pop("node_config")


def _cluster_bad_head(d):
    d["head_node_type"] = "no-such-type"


def _serve_unknown_arg(d):
    d["applications"][0]["args"]["replica"]["num_replica"] = 2


def _serve_bad_import(d):
    d["applications"][0]["import_path"] = "cluster.app:no_such_builder"


def _serve_bad_router(d):
    d["applications"][0]["args"]["router"]["kind"] = "round_robin"


def _serve_unknown_top_level(d):
    d["http_option"] = d.pop("http_options")


def _rayservice_embedded_error(d):
    serve = yaml.safe_load(d["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["replica"]["engine"]["tensor_parallel"] = 2
    d["spec"]["serveConfigV2"] = yaml.safe_dump(serve)


def _rayservice_too_few_gpus(d):
    for group in d["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        for c in group["template"]["spec"]["containers"]:
            c["resources"]["limits"]["nvidia.com/gpu"] = "1"


def _rayservice_other_ray(d):
    d["spec"]["rayClusterConfig"]["rayVersion"] = "2.9.0"


def _cluster_worker_without_serve_env(d):
    d["worker_start_ray_commands"] = [c.replace("RAY_SERVE_PROXY_USE_GRPC=1", "") for c in d["worker_start_ray_commands"]]


def _rayservice_head_without_serve_env(d):
    d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("env")


PLANTED = [
    ("ray-cluster-gcp.yaml", _cluster_worker_without_serve_env, "RAY_SERVE_PROXY_USE_GRPC"),
    ("rayservice.yaml", _rayservice_head_without_serve_env, "RAY_SERVE_THROUGHPUT_OPTIMIZED"),
    ("ray-cluster-aws.yaml", _cluster_unknown_key, "node_conf"),
    ("ray-cluster-gcp.yaml", _cluster_unknown_key, "node_conf"),
    ("ray-cluster-aws.yaml", _cluster_bad_head, "head_node_type"),
    ("serve-local.yaml", _serve_unknown_arg, "num_replica"),
    ("serve-gpu.yaml", _serve_unknown_arg, "num_replica"),
    ("serve-gpu.yaml", _serve_bad_import, "no_such_builder"),
    ("serve-gpu.yaml", _serve_bad_router, "round_robin"),
    ("serve-local.yaml", _serve_unknown_top_level, "http_option"),
    ("rayservice.yaml", _rayservice_embedded_error, "tensor_parallel"),
    ("rayservice.yaml", _rayservice_too_few_gpus, "GPUs"),
    ("rayservice.yaml", _rayservice_other_ray, "2.9.0"),
]


@pytest.mark.parametrize("name, plant, needle", PLANTED, ids=[f"{n}-{p.__name__}" for n, p, _ in PLANTED])
def test_a_planted_error_is_caught(tmp_path, name, plant, needle):
    doc = _load(name)
    plant(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError, match=needle):
        check_file(path)


def test_manifests_check_exits_nonzero_on_a_planted_error(tmp_path):
    doc = _load("serve-local.yaml")
    _serve_unknown_arg(doc)
    bad = tmp_path / "serve-bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "manifests", "check", str(MANIFESTS / "serve-local.yaml"), str(bad)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1 and "1 of 2 manifests valid" in proc.stdout and "FAIL" in proc.stdout


def test_a_fleet_file_becomes_a_serve_config_whose_replicas_take_their_group_by_rank(tmp_path):
    from cluster.app import build_app, engine_deployment_options
    from cluster.fleets import FleetDescription, serve_config
    from cluster.manifests import check_serve
    from cluster.sim.fleet import FleetConfig

    fleet = FleetDescription.load(MANIFESTS / "fleets" / "quarter-no-drafter.yaml")
    doc = serve_config(fleet, _load("serve-gpu.yaml"))
    (config,) = check_serve(doc)  # Serve's schema, AppConfig, the router, the bound application
    replica = config.replica
    assert replica.num_replicas == 64 and replica.autoscaling is None
    assert [replica.replica_engine(r).wcs.policy for r in (0, 47, 48, 63)] == ["wcs", "wcs", "ar", "ar"]
    assert replica.replica_engine(48).wcs.estimator == replica.engine.wcs.estimator  # overrides merge key by key
    # The same file in the simulator: 64 replicas, 16 of them without a drafter.
    sim = FleetConfig(groups=fleet.groups)
    assert sim.replicas == 64 and sum(g.count for g in sim.replica_groups() if not g.drafter) == 16
    # Through the command, and back through `manifests check`.
    out = tmp_path / "fleet.yaml"
    made = subprocess.run([sys.executable, "-m", "cluster.cli", "manifests", "fleet", str(MANIFESTS / "fleets" / "quarter-no-drafter.yaml"),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and check_file(out) == "serve", made.stderr[-2000:]
    # A fleet of two tensor-parallel sizes: a deployment per size, each with its groups by rank and its own
    # GPUs per replica, behind one ingress.
    mixed = tmp_path / "mixed.yaml"
    made = subprocess.run([sys.executable, "-m", "cluster.cli", "manifests", "fleet", str(MANIFESTS / "fleets" / "mixed-h100-h200.yaml"),
                           "--out", str(mixed)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and check_file(mixed) == "serve", made.stderr[-2000:]
    (mixed_config,) = check_serve(yaml.safe_load(mixed.read_text()))
    parts = mixed_config.replica.by_tensor_parallel()
    assert [(p.engine.tensor_parallel_size, p.num_replicas, [g.name for g in p.groups]) for p in parts] == [
        (1, 48, ["0-h100-8b-tp1", "2-h200-8b-tp1"]), (2, 16, ["1-h100-8b-tp2", "3-h200-8b-tp2"])]
    assert [len(engine_deployment_options(p).get("placement_group_bundles", [{}])) for p in parts] == [1, 2]
    assert [d.name for d in _deployments(build_app(mixed_config))] == ["Ingress", "EngineReplica-tp1", "EngineReplica-tp2"]
    assert [d.name for d in _deployments(build_app(config))] == ["Ingress", "EngineReplica"]  # control: one size, one deployment
    # Control: a group's unknown engine key is caught by the check.
    # The CPU fleet as the application config `forespark compare --config` takes: one replica drafts, one not.
    from cluster.app import AppConfig
    from cluster.cli import main

    assert main(["manifests", "fleet", str(MANIFESTS / "fleets" / "cpu-drafter-and-not.yaml"), "--base",
                 str(MANIFESTS / "serve-local.yaml"), "--args-only", "--out", str(tmp_path / "app.yaml")]) == 0
    app = AppConfig.model_validate(yaml.safe_load((tmp_path / "app.yaml").read_text()))
    assert app.replica.accelerator == "cpu" and [app.replica.replica_engine(r).wcs.policy for r in (0, 1)] == ["wcs", "ar"]
    doc["applications"][0]["args"]["replica"]["groups"][1]["engine"] = {"wcs": {"polcy": "ar"}}
    with pytest.raises(ManifestError, match="polcy"):
        check_serve(doc)


def _deployments(app) -> list:
    """The deployments of a bound application: its own, then those bound into its arguments (as Serve builds it)."""
    from ray.dag.py_obj_scanner import _PyObjScanner
    from ray.serve.deployment import Application

    deployment = app._bound_deployment
    scanner = _PyObjScanner(source_type=Application)
    try:
        children = scanner.find_nodes((deployment.init_args, deployment.init_kwargs))
    finally:
        scanner.clear()
    return [deployment, *(c._bound_deployment for c in children)]


def test_serve_gives_each_replica_a_rank_and_so_its_group():
    """Real Serve, a small deployment resolving its group the way `EngineReplica` does (`replica_rank`). Control:
    without groups every replica has none."""
    import ray
    from ray import serve

    from replicas.deployment import ReplicaConfig, replica_rank

    grouped = ReplicaConfig.model_validate({"groups": [{"name": "spec", "count": 2}, {"name": "ar", "count": 1, "engine": {"wcs": {"policy": "ar"}}}]})

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Which:
        def __init__(self, config: ReplicaConfig) -> None:
            self.rank = replica_rank()
            group = config.group_of(self.rank)
            self.group = None if group is None else group.name
            self.policy = config.replica_engine(self.rank).wcs.policy

        def __call__(self) -> tuple:
            return self.rank, self.group, self.policy

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8531})

        def answers(config: ReplicaConfig, name: str) -> set:
            handle = serve.run(Which.options(num_replicas=config.num_replicas).bind(config), name=name, route_prefix=f"/{name}")
            seen = set()
            for _ in range(200):
                seen.add(handle.remote().result(timeout_s=60))
                if len(seen) == config.num_replicas:
                    break
            return seen

        assert answers(grouped, "grouped") == {(0, "spec", "wcs"), (1, "spec", "wcs"), (2, "ar", "ar")}
        assert answers(ReplicaConfig(num_replicas=2), "plain") == {(0, None, "wcs"), (1, None, "wcs")}
    finally:
        serve.shutdown()
        ray.shutdown()


def test_admission_and_the_router_count_prompt_tokens_with_the_served_models_tokenizer(tmp_path):
    """Left unset, `chars_per_token` is measured on the engine's tokenizer when the application is built: the
    embedded pair's 1,024-token vocabulary takes about 2.5 characters a token, not the 3.5 of large vocabularies
    (prompt tokens were underestimated by 30%). Controls: a model without a tokenizer here gives None (the default
    applies), and a value set in the config is kept."""
    from cluster.admission import AdmissionConfig, estimated_prompt_tokens
    from cluster.app import AppConfig, build_app
    from cluster.prompt_model import chars_per_token

    def router_admission(config: AppConfig) -> dict:
        engine = next(d for d in _deployments(build_app(config)) if d.name == "EngineReplica")
        return engine._deployment_config.request_router_config.request_router_kwargs["admission"]

    measured = router_admission(AppConfig())["chars_per_token"]
    assert 2.2 < measured < 2.8
    assert chars_per_token(tmp_path) is None
    assert estimated_prompt_tokens(350, AdmissionConfig()) == 100.0
    kept = AppConfig.model_validate({"router": {"admission": {"chars_per_token": 4.0}}})
    assert router_admission(kept)["chars_per_token"] == 4.0
