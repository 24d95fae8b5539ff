"""WCS engines run vLLM's V1 model runner: the setting is made before vLLM reads it, and a V2 setting is refused.

The engine-core process and TP workers are checked where they run: tests/test_wcs_tp.py (two ranks) and
tests/test_serve.py (a served replica).
"""

import os
import subprocess
import sys
import textwrap

from replicas.engine import EngineConfig, engine_environment
from replicas.wcs.config import RUNNER_ENV


def test_a_wcs_engine_sets_the_v1_runner_and_keeps_what_the_operator_set(monkeypatch):
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    engine_environment(EngineConfig(wcs=None))
    assert RUNNER_ENV not in os.environ  # vLLM's own speculation (the dspark baseline lives on V2 on GPUs)
    engine_environment(EngineConfig())
    assert os.environ[RUNNER_ENV] == "0"
    monkeypatch.setenv(RUNNER_ENV, "1")
    engine_environment(EngineConfig())
    assert os.environ[RUNNER_ENV] == "1"  # kept: the worker refuses it with its reason (below)


# On this CPU build vLLM's own config check refuses Model Runner V2 (no Triton) before any worker exists, so the
# V2 setting is planted after a real V1 engine config is built: what a CUDA host with V2 selected hands the worker.
PLANTED = textwrap.dedent(
    """
    import os

    from vllm.engine.arg_utils import EngineArgs

    from replicas.engine import EngineConfig, engine_environment
    from replicas.wcs.config import RUNNER_ENV
    from replicas.wcs.worker import WCSWorker

    if __name__ == "__main__":
        config = EngineConfig()
        engine_environment(config)
        vllm_config = EngineArgs(**config.vllm_kwargs()).create_engine_config()
        assert not vllm_config.use_v2_model_runner
        os.environ[RUNNER_ENV] = "1"
        worker = WCSWorker.__new__(WCSWorker)
        worker.vllm_config = vllm_config
        try:
            worker.init_device()
        except RuntimeError as e:
            print("REFUSED", e)
    """
)


def test_a_planted_v2_setting_makes_the_wcs_worker_refuse_with_its_reason(tmp_path):
    script = tmp_path / "planted_v2.py"
    script.write_text(PLANTED)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop(RUNNER_ENV, None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED ")]
    assert refused, proc.stdout[-2000:]
    assert "WCS runs on vLLM's V1 model runner, but this engine selected Model Runner V2" in refused[0]
    assert f"{RUNNER_ENV}=1" in refused[0]
