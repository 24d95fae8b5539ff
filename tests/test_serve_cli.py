"""`forespark serve` end to end: its own local Ray, a config file, a real completion over HTTP, SIGTERM."""


import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


@contextmanager
def forespark_serve(config, port: int, first_request: dict, args: tuple[str, ...] = ()):
    """`forespark serve --config` (and `args`) as a user runs it, until `first_request` (a completions body) is
    answered 200.

    Yields (process, that response); SIGTERM on exit. The process's output is `process.output` afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}, "PYTHONPATH": os.getcwd()},
    )
    try:
        deadline, r = time.time() + 600, None
        while time.time() < deadline:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=first_request, timeout=60)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(2)
        assert r is not None and r.status_code == 200, r
        yield proc, r
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.output, _ = proc.communicate(timeout=120)


def test_forespark_serve_starts_serves_and_stops_on_sigterm(tmp_path):
    """The CLI end to end: its own Ray, one replica, a completion, SIGTERM, clean exit."""
    config = tmp_path / "serve.yaml"
    config.write_text("replica:\n  num_replicas: 1\n  num_cpus: 1\n  served_model_name: embedded\n")
    with forespark_serve(config, 8766, {"model": "embedded", "prompt": "def f():", "max_tokens": 4}) as (proc, r):
        assert r.json()["usage"]["completion_tokens"] == 4
    out = proc.output
    assert proc.returncode == 0, out[-3000:]
    assert "serving the OpenAI API at http://127.0.0.1:8766/v1" in out and "stopping" in out
    # The CLI set Serve's throughput mode itself (cluster/serve_env.py): Serve's controller logs what it applied.
    assert "Throughput optimized Ray Serve enabled" in out and "gRPC communication enabled" in out
    assert "Direct ingress enabled" not in out


def test_serve_environment_sets_defaults_and_keeps_what_the_operator_set(monkeypatch):
    from cluster.serve_env import SERVE_ENV, serve_environment

    for key in SERVE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")
    applied = serve_environment()
    assert applied == {**SERVE_ENV, "RAY_SERVE_PROXY_USE_GRPC": "0"}


def test_serve_rejects_an_invalid_config(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "bad.yaml"
    config.write_text("num_replicas: 0\nno_such_key: 1\n")
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid configuration" in proc.stderr


def test_serve_run_of_the_shipped_local_manifest_serves_the_same_application(tmp_path):
    """`serve run manifests/serve-local.yaml` (Ray's own CLI): the same OpenAI app; here on another port, one replica."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx
    import yaml

    manifest = yaml.safe_load(Path("manifests/serve-local.yaml").read_text())
    manifest["http_options"]["port"] = 8767
    manifest["applications"][0]["args"]["replica"]["num_replicas"] = 1
    config = tmp_path / "serve-local.yaml"
    config.write_text(yaml.safe_dump(manifest))
    serve_cli = Path(sys.executable).parent / "serve"
    proc = subprocess.Popen(
        [str(serve_cli), "run", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": os.getcwd()},
    )
    try:
        deadline = time.time() + 600
        status = None
        while time.time() < deadline and status != 200:
            try:
                r = httpx.post(
                    "http://127.0.0.1:8767/v1/completions",
                    json={"model": "forespark", "prompt": "import os\n", "max_tokens": 4}, timeout=60,
                )
                status = r.status_code
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(2)
        assert status == 200 and r.json()["usage"]["completion_tokens"] == 4
        for _ in range(30):  # Ray exports the replicas' metrics every few seconds
            metrics = httpx.get("http://127.0.0.1:8767/metrics", timeout=30).text
            if "ray_forespark_replica_headroom_tokens" in metrics and "ray_vllm_generation_tokens" in metrics:
                break
            time.sleep(1)
        assert "ray_forespark_replica_headroom_tokens" in metrics and "ray_vllm_generation_tokens" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
