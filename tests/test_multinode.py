"""Multi-node rehearsal on one machine: a head node and a worker node with a custom resource (Ray's own
`cluster_utils.Cluster`, real raylets on loopback), the local Serve config deployed with `serve deploy`
(as the deployment guide does) and the engine replicas placed on the worker node by their resource request."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from loadtest.run import free_port

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"


@pytest.fixture
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    dashboard_port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": True, "dashboard_port": dashboard_port, "dashboard_host": "127.0.0.1"},
    )
    worker = cluster.add_node(num_cpus=2, resources={"forespark_engine_node": 2})
    cluster.wait_for_nodes()
    try:
        yield cluster, worker, f"http://127.0.0.1:{dashboard_port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_replicas_land_on_the_node_their_resources_name_and_serve(two_nodes, tmp_path):
    import ray
    from ray.util.state import list_actors

    cluster, worker, dashboard = two_nodes
    port = free_port()
    config = yaml.safe_load((MANIFESTS / "serve-local.yaml").read_text())
    config["http_options"]["port"] = port
    replica = config["applications"][0]["args"]["replica"]
    replica.update(num_replicas=2, num_cpus=1, resources={"forespark_engine_node": 1})
    path = tmp_path / "serve-two-nodes.yaml"
    path.write_text(yaml.safe_dump(config))

    deploy = subprocess.run(
        [str(Path(sys.executable).parent / "serve"), "deploy", str(path), "--address", dashboard],
        capture_output=True, text=True, timeout=300,
    )
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr[-3000:]

    deadline, status = time.time() + 600, None
    while time.time() < deadline and status != 200:
        try:
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "forespark", "prompt": "def main():", "max_tokens": 4}, timeout=60,
            )
            status = r.status_code
        except httpx.HTTPError:
            pass
        time.sleep(2)
    assert status == 200 and r.json()["usage"]["completion_tokens"] == 4

    ray.init(address=cluster.address)
    engines = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if "EngineReplica" in a.class_name]
    assert len(engines) == 2
    assert {a.node_id for a in engines} == {worker.node_id}
    assert cluster.head_node.node_id != worker.node_id
