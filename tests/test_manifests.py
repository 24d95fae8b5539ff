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
