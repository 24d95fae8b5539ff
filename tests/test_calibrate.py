"""`forespark calibrate`: a model pair's traces, estimator quality and step cost in one folder that engines point to.

The command runs as a user runs it (a subprocess of the CLI). Its engine settings come from a small
config (8 sequences: a short step-cost profile); the shipped traces were recorded from the same prompts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replicas.engine import DrafterConfig, EngineConfig
from replicas.models.build import WEIGHTS_DIR
from replicas.wcs.calibration import Calibration
from replicas.wcs.config import WCSConfig

SMALL_ENGINE = "replica:\n  engine:\n    max_num_seqs: 8\n"


def run_calibrate(tmp: Path, *args: str) -> tuple[Calibration, Path]:
    config = tmp / "app.yaml"
    config.write_text(SMALL_ENGINE)
    out = tmp / "calibration"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "calibrate", "--config", str(config), "--out", str(out), *args],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.getcwd(), "FORESPARK_CACHE": str(tmp / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "serve the pair with engine.wcs.calibration" in proc.stdout
    return Calibration.load(out), out


EMBEDDED = ("--model", str(WEIGHTS_DIR / "target"), "--drafter", str(WEIGHTS_DIR / "drafter"))


@pytest.fixture(scope="module")
def embedded_k8(tmp_path_factory):
    return run_calibrate(tmp_path_factory.mktemp("cal8"), *EMBEDDED, "--prompts-per-domain", "64")


def test_calibrating_the_embedded_pair_reproduces_the_shipped_estimator_quality(embedded_k8):
    from scheduling.evaluation import compare_estimators
    from scheduling.traces import Traces

    summary, out = embedded_k8
    assert (summary.k, summary.causal, summary.draft_widths) == (8, True, "ragged")
    assert summary.truncation_gap == {}  # a causal drafter's truncated blocks are exact: nothing to measure
    recorded = Traces.load(out / "traces.npz")
    assert recorded.k == 8 and summary.rows > 1000
    assert set(recorded.mean_accepted_length()) == {"code", "prose"}  # each row knows its prompt's domain
    assert len(list((out / "step_cost").glob("*.json"))) == 1
    shipped = compare_estimators(Traces.load(WEIGHTS_DIR / "traces.npz"))["context"]
    ours = summary.estimators["context"]
    pairs = [(a.auc, b.auc) for a, b in zip(shipped.positions, ours.positions) if a.auc is not None and b.auc is not None]
    assert len(pairs) == 8
    # Two recordings of the same prompts differ where batching changes a greedy path; past position 4 each
    # AUC rests on 26-112 rows of the rarer outcome (held-out part), so those positions get a wider margin.
    gaps = np.abs(np.subtract(*zip(*pairs)))
    assert np.max(gaps[:4]) <= 0.03 and np.max(gaps) <= 0.1 and abs(shipped.mean_auc - ours.mean_auc) <= 0.03, pairs
    assert ours.mean_auc > summary.estimators["constant"].mean_auc + 0.2  # quality worth comparing


@pytest.fixture(scope="module")
def embedded_k4(tmp_path_factory):
    return run_calibrate(tmp_path_factory.mktemp("cal4"), *EMBEDDED, "--k", "4", "--prompts-per-domain", "16")


def test_a_k4_configuration_calibrates_and_serves_on_its_own_profile(embedded_k4, monkeypatch):
    from vllm import SamplingParams

    from replicas.engine import make_llm
    from replicas.models.workloads import load_workloads
    from replicas.wcs.profiler import with_cost_model
    from replicas.wcs.stats import WCSStats
    from scheduling.cost_model import StepCostModel
    from tests.test_wcs_engine import DRAFTING_PAYS

    summary, out = embedded_k4
    assert summary.k == 4
    # The replica's CPU threads, as calibrate profiled them (Ray's OMP_NUM_THREADS = the replica's num_cpus).
    monkeypatch.setenv("OMP_NUM_THREADS", summary.machine.rsplit("OMP_NUM_THREADS=", 1)[1])
    engine = EngineConfig(max_num_seqs=8, drafter=DrafterConfig(num_speculative_tokens=4), wcs=WCSConfig(calibration=out))
    profile = with_cost_model(engine).wcs.cost_model
    assert profile.parent == out / "step_cost"  # the calibration's own profile, not a new one in the cache
    llm = make_llm(engine)
    assert StepCostModel.model_validate_json(llm.collective_rpc("wcs_cost_model")[0]) == StepCostModel.load(profile)
    llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))
    llm.collective_rpc("wcs_set_online_cost", args=(False,))
    work = load_workloads()
    prompts = [p.prompt for d in work for p in work[d][:4]]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    runs = {}
    for policy in ("ar", "wcs"):
        llm.collective_rpc("wcs_set_policy", args=(policy,))
        runs[policy] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = WCSStats.model_validate(llm.collective_rpc("wcs_stats")[0])
    assert runs["wcs"] == runs["ar"]
    assert stats.k == 4 and stats.verified > 0 and stats.accepted > 0


def test_a_pair_without_traces_is_refused_naming_calibrate(tmp_path, embedded_k4):
    with pytest.raises(ValueError, match="forespark calibrate --model"):
        EngineConfig(model=tmp_path / "my-target", drafter=DrafterConfig(path=tmp_path / "my-drafter"))
    with pytest.raises(ValueError, match="forespark calibrate --model"):
        EngineConfig.model_validate({"model": str(tmp_path / "my-target"), "drafter": {"path": str(tmp_path / "d")}})
    constant = EngineConfig(model=tmp_path / "t", drafter=DrafterConfig(path=tmp_path / "d"), wcs=WCSConfig(estimator="constant"))
    assert constant.wcs_for_pair().traces is None  # the constant prior reads no traces
    _, k4 = embedded_k4
    with pytest.raises(ValueError, match="calibrate again with --k 8"):
        EngineConfig(wcs=WCSConfig(calibration=k4)).vllm_kwargs()  # read when the engine starts
    served = EngineConfig(drafter=DrafterConfig(num_speculative_tokens=4), wcs=WCSConfig(calibration=k4))
    assert served.wcs_for_pair().traces == k4 / "traces.npz"
    assert json.loads(json.dumps(served.vllm_kwargs()["additional_config"]))["forespark"]["traces"] == str(k4 / "traces.npz")


def test_step_cost_profiles_are_kept_apart_by_gpu_name(monkeypatch):
    """A stand-in for `nvidia-smi` (no GPU here): an H100's profile must not price an H200's steps."""
    from replicas.wcs import profiler

    monkeypatch.setattr(profiler, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    h100 = profiler.profile_name(EngineConfig())
    monkeypatch.setattr(profiler, "gpu_names", lambda: ["NVIDIA H200"])
    assert profiler.profile_name(EngineConfig()) != h100
    monkeypatch.setattr(profiler, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    assert profiler.profile_name(EngineConfig()) == h100


def test_step_cost_profiles_are_kept_apart_by_the_weights_in_a_folder(tmp_path):
    """A model folder rebuilt in place (a new shipped pair) gets another profile; the same bytes again, the same one."""
    from replicas.wcs import profiler

    model = tmp_path / "target"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 1024)
    (model / "config.json").write_text('{"hidden_size": 256}')
    config = EngineConfig(model=model, drafter=None, wcs=None)
    before = profiler.profile_name(config)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte: the tail of the file is read
    weights.write_bytes(bytes(data))
    assert profiler.profile_name(config) != before
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert profiler.profile_name(config) == before  # control: the bytes, not the write, decide
    (model / "config.json").write_text('{"hidden_size": 384}')
    assert profiler.profile_name(config) != before


def test_gpu_names_follow_cuda_visible_devices(monkeypatch, tmp_path):
    """A stand-in `nvidia-smi` on PATH (no GPU here) lists two GPUs; the process sees the one it is given."""
    from replicas.wcs import profiler

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H100 80GB HBM3'\necho '1, NVIDIA H200'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert profiler.gpu_names() == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert profiler.gpu_names() == ["NVIDIA H200"]
