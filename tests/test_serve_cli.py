"""`forespark serve` end to end: its own local Ray, a config file, a real completion over HTTP, SIGTERM."""


def test_forespark_serve_starts_serves_and_stops_on_sigterm(tmp_path):
    """The CLI end to end: its own Ray, one replica, a completion, SIGTERM, clean exit."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    config = tmp_path / "serve.yaml"
    config.write_text("num_replicas: 1\nnum_cpus: 1\nserved_model_name: embedded\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--port", "8766"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                r = httpx.post(
                    "http://127.0.0.1:8766/v1/completions",
                    json={"model": "embedded", "prompt": "def f():", "max_tokens": 4}, timeout=60,
                )
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(2)
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "serving the OpenAI API at http://127.0.0.1:8766/v1" in out and "stopping" in out


def test_serve_rejects_an_invalid_config(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "bad.yaml"
    config.write_text("num_replicas: 0\nno_such_key: 1\n")
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid configuration" in proc.stderr
