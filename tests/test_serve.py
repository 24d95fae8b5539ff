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
    # Small limits, so that overload is reachable from one test.
    config = ReplicaConfig(num_replicas=1, max_ongoing_requests=2, max_queued_requests=2)
    serve.run(build_deployment(config), name="forespark", route_prefix="/")
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



def test_overload_is_turned_away_with_429_and_retry_after(serve_url):
    import asyncio

    import httpx

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            body = {"model": "forespark", "prompt": "def f():", "max_tokens": 64, "ignore_eos": True}
            return await asyncio.gather(*(client.post(f"{serve_url}/v1/completions", json=body) for _ in range(12)))

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    assert all(r.headers.get("retry-after") == "1" for r in replies if r.status_code == 429)
    # Nothing was lost for the requests it took, and it keeps serving.
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in replies if r.status_code == 200)
    assert httpx.post(f"{serve_url}/v1/completions", json={"model": "forespark", "prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200
