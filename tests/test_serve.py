"""The replica deployment on real Ray Serve, over real HTTP, with the official `openai` client."""

import pytest

from replicas.engine import cpu_engine_environment

cpu_engine_environment()


@pytest.fixture(scope="module")
def serve_url():
    import ray
    from ray import serve

    from replicas.deployment import ReplicaConfig, build_deployment

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8765})
    serve.run(build_deployment(ReplicaConfig(num_replicas=1)), name="forespark", route_prefix="/")
    yield "http://127.0.0.1:8765"
    serve.shutdown()
    ray.shutdown()


def test_openai_client_through_serve(serve_url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{serve_url}/v1", api_key="none", max_retries=0)
    done = client.completions.create(model="forespark", prompt="def fib(n):", max_tokens=10, temperature=0)
    assert done.usage.completion_tokens == 10
    chunks = list(client.completions.create(model="forespark", prompt="import ", max_tokens=10, stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks)

