"""The replica's OpenAI surface over real HTTP: a uvicorn server in a thread, a WCS AsyncLLM engine,
the official `openai` client, and raw requests for every bad-input case.
"""

import socket
import threading
import time

import httpx
import pytest

from replicas.engine import EngineConfig, cpu_engine_environment

cpu_engine_environment()

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    import uvicorn

    from replicas.http_app import engine_app

    port = free_port()
    config = uvicorn.Config(engine_app(EngineConfig(), api_key=API_KEY), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        pytest.fail("the server did not become healthy")
    yield url
    srv.should_exit = True
    thread.join(timeout=60)


def client(url, key=API_KEY):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_openai_client_completes_and_streams(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["forespark"]
    done = c.completions.create(model="forespark", prompt="def fib(n):", max_tokens=12, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 12
    chunks = list(c.chat.completions.create(
        model="forespark", messages=[{"role": "user", "content": "import os"}], max_tokens=12, stream=True, temperature=0
    ))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(chunks) > 2 and text


def test_streams_end_with_done(server):
    with httpx.stream(
        "POST", f"{server}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "forespark", "prompt": "x = ", "max_tokens": 5, "stream": True}, timeout=120,
    ) as r:
        lines = [l for l in r.iter_lines() if l]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


BAD = [
    ("malformed JSON", b"{not json", 400),
    ("not an object", b"[1, 2]", 400),
    ("unknown model", b'{"model": "nope", "prompt": "x", "max_tokens": 4}', 404),
    ("negative max_tokens", b'{"model": "forespark", "prompt": "x", "max_tokens": -1}', 400),
    ("oversized max_tokens", b'{"model": "forespark", "prompt": "x", "max_tokens": 100000}', 400),
    ("bad temperature", b'{"model": "forespark", "prompt": "x", "max_tokens": 4, "temperature": -3}', 400),
    ("bad top_p", b'{"model": "forespark", "prompt": "x", "max_tokens": 4, "top_p": 7}', 400),
    ("prompt longer than the context", b'{"model": "forespark", "prompt": "' + b"word " * 3000 + b'", "max_tokens": 4}', 400),
]


@pytest.mark.parametrize("case, payload, status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, case, payload, status):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/completions", content=payload, headers=headers, timeout=120)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    ok = client(server).completions.create(model="forespark", prompt="def f():", max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_without_the_key_401(server):
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        client(server, key="wrong").completions.create(model="forespark", prompt="x", max_tokens=2)
    assert httpx.get(f"{server}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200  # health is not guarded
