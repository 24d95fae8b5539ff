"""A fleet of two tensor-parallel sizes on real Ray Serve: a deployment per size behind one ingress
(`cluster/app.py`, `cluster/fleet_backend.py`), real vLLM CPU engines at TP 1 and TP 2, real HTTP."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from cluster.serve_env import local_ray_environment, serve_environment
from replicas.engine import cpu_engine_environment

cpu_engine_environment()
serve_environment()
local_ray_environment()

PORT = 8766
URL = f"http://127.0.0.1:{PORT}"


def test_a_fleet_of_two_tensor_parallel_sizes_serves_from_a_deployment_per_size():
    import ray
    from ray import serve

    from cluster.admission import AdmissionConfig
    from cluster.app import AppConfig, RouterConfig, build_app
    from replicas.deployment import ReplicaConfig

    groups = [{"name": "tp1", "count": 1}, {"name": "tp2", "count": 1, "engine": {"tensor_parallel_size": 2}}]
    # Admission off: on two cores the TP 2 engine's ranks share them with the TP 1 engine, and on a slow host its
    # steps alone miss the default TPOT SLO, so it would refuse what this test needs served (tests/test_admission.py
    # covers admission).
    config = AppConfig(replica=ReplicaConfig(groups=groups, max_ongoing_requests=4, stats_period_s=0.5),
                       router=RouterConfig(admission=AdmissionConfig(enabled=False)))
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(config), name="forespark", route_prefix="/")

        async def ranks() -> dict[str, int]:
            out = {}
            for name in ("EngineReplica-tp1", "EngineReplica-tp2"):
                info = await serve.get_deployment_handle(name, app_name="forespark").runner_info.remote()
                out[name] = len(info["ranks"])
            return out

        loop = asyncio.new_event_loop()  # the handles' routers run on a loop that outlives them (as in test_serve.py)
        threading.Thread(target=loop.run_forever, daemon=True).start()
        assert asyncio.run_coroutine_threadsafe(ranks(), loop).result(timeout=300) == {"EngineReplica-tp1": 1, "EngineReplica-tp2": 2}

        def complete(i: int) -> httpx.Response:
            body = {"model": "forespark", "prompt": f"def f{i}(x):", "max_tokens": 24, "temperature": 0}
            return httpx.post(f"{URL}/v1/completions", json=body, timeout=300)

        with ThreadPoolExecutor(6) as pool:  # enough at once that one deployment's best replica fills up
            replies = list(pool.map(complete, range(24)))
        assert [r.status_code for r in replies] == [200] * 24
        assert all(r.json()["usage"]["completion_tokens"] == 24 for r in replies)

        def steps() -> dict[str, float]:
            """Engine steps per deployment, from ForeSpark's series on the ingress's /metrics."""
            from prometheus_client.parser import text_string_to_metric_families

            out: dict[str, float] = {}
            for fam in text_string_to_metric_families(httpx.get(f"{URL}/metrics", timeout=30).text):
                for sample in fam.samples:
                    if sample.name == "ray_forespark_wcs_steps_total":
                        out[sample.labels["deployment"]] = out.get(sample.labels["deployment"], 0.0) + sample.value
            return out

        deadline = time.time() + 60  # Ray exports metrics every 2 s
        while not (len(seen := steps()) == 2 and all(seen.values())) and time.time() < deadline:
            time.sleep(1.0)
        assert set(seen) == {"EngineReplica-tp1", "EngineReplica-tp2"} and all(seen.values()), seen  # both served
    finally:
        serve.shutdown()
        ray.shutdown()
