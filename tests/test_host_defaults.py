"""GPU host defaults (cluster/host.py): what `forespark serve` fills in, as a pure function of a host description,
and `forespark serve --dry-run [--assume-gpus N]` end to end. Nothing here starts Ray or imports vLLM."""

import os
import sys
import warnings

import pytest
import yaml

from cluster.app import engine_deployment_options
from cluster.host import (
    GPU_MEMORY_UTILIZATION,
    HostDefaultsWarning,
    HostDescription,
    parse_nvidia_smi_list,
    resolve_app_config,
)
from replicas.engine import EngineConfig

TP2 = {"replica": {"engine": {"tensor_parallel_size": 2}}}


def host(gpus, cpus=32):
    return HostDescription(cpus=cpus, gpus=gpus, gpu_name="NVIDIA H200" if gpus else None)


def test_eight_gpus_tp2_give_four_bf16_gpu_replicas_with_placement_group_bundles():
    rc = resolve_app_config(TP2, host(8)).replica
    assert (rc.accelerator, rc.num_replicas, rc.engine.tensor_parallel_size) == ("gpu", 4, 2)
    assert rc.engine.dtype == "bfloat16" and rc.engine.enforce_eager is False
    assert rc.engine.gpu_memory_utilization == GPU_MEMORY_UTILIZATION and rc.engine.kv_cache_memory_bytes is None
    assert rc.num_cpus == 4.0  # min(4, 32 CPUs / 4 replicas)
    opts = engine_deployment_options(rc)
    assert opts["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1}, {"GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK" and opts["ray_actor_options"]["num_gpus"] == 0
    # vLLM is handed the memory share, not a byte count (exactly one of the two)
    kwargs = rc.engine.vllm_kwargs()
    assert kwargs["gpu_memory_utilization"] == GPU_MEMORY_UTILIZATION and "kv_cache_memory_bytes" not in kwargs
    assert kwargs["dtype"] == "bfloat16"


def test_tp1_gives_one_replica_per_gpu_each_holding_its_gpu():
    rc = resolve_app_config({}, host(4, cpus=8)).replica
    assert (rc.accelerator, rc.num_replicas, rc.num_cpus) == ("gpu", 4, 2.0)
    assert engine_deployment_options(rc) == {"ray_actor_options": {"num_cpus": 2.0, "num_gpus": 1}}


def test_no_gpu_gives_the_cpu_default_unchanged():
    for cpus, replicas in ((2, 2), (16, 8)):
        rc = resolve_app_config({}, host(0, cpus=cpus)).replica
        assert (rc.accelerator, rc.num_replicas, rc.num_cpus) == ("cpu", replicas, max(1.0, cpus / replicas))
        assert rc.engine == EngineConfig()  # float32, eager, 512 MiB of KV: the embedded CPU engine as before
        assert rc.engine.vllm_kwargs()["kv_cache_memory_bytes"] == 512 << 20
        assert "gpu_memory_utilization" not in rc.engine.vllm_kwargs()
    # the replica count the user gives keeps the CPU share rule
    assert resolve_app_config({}, host(0, cpus=16), {"replica": {"num_replicas": 4}}).replica.num_cpus == 4.0


def test_what_the_user_sets_is_never_overridden():
    raw = {
        "replica": {
            "accelerator": "gpu", "num_replicas": 3, "num_cpus": 6,
            "engine": {"tensor_parallel_size": 2, "dtype": "float16", "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30},
        }
    }
    rc = resolve_app_config(raw, host(8)).replica
    assert (rc.num_replicas, rc.num_cpus, rc.engine.dtype, rc.engine.enforce_eager) == (3, 6, "float16", True)
    assert rc.engine.kv_cache_memory_bytes == 1 << 30 and rc.engine.gpu_memory_utilization is None
    assert rc.engine.vllm_kwargs()["kv_cache_memory_bytes"] == 1 << 30
    # a memory share of their own replaces ours, and the byte default
    rc = resolve_app_config({"replica": {"engine": {"gpu_memory_utilization": 0.5}}}, host(2)).replica
    assert rc.engine.gpu_memory_utilization == 0.5 and rc.engine.kv_cache_memory_bytes is None
    # accelerator: cpu on a GPU host keeps every CPU default
    rc = resolve_app_config({"replica": {"accelerator": "cpu"}}, host(8, cpus=16)).replica
    assert (rc.accelerator, rc.num_replicas, rc.engine.dtype) == ("cpu", 8, "float32")
    # the command line counts as the user's (--replicas)
    assert resolve_app_config(TP2, host(8), {"replica": {"num_replicas": 1}}).replica.num_replicas == 1
    # and the input dict is not modified
    assert raw["replica"]["engine"] == {"tensor_parallel_size": 2, "dtype": "float16", "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}


def test_tp_that_does_not_divide_the_gpus_floors_with_a_warning_and_too_few_gpus_is_an_error():
    with pytest.warns(HostDefaultsWarning, match="1 GPU.s. left idle"):
        rc = resolve_app_config(TP2, host(3)).replica
    assert rc.num_replicas == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostDefaultsWarning)
        resolve_app_config(TP2, host(4))  # divides: no warning
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs 4 GPUs per replica"):
        resolve_app_config({"replica": {"engine": {"tensor_parallel_size": 4}}}, host(2))


def test_engine_kv_size_is_exactly_one_of_bytes_or_memory_share():
    assert EngineConfig().kv_cache_memory_bytes == 512 << 20
    share = EngineConfig(gpu_memory_utilization=0.8)
    assert share.kv_cache_memory_bytes is None
    assert EngineConfig.model_validate(share.model_dump()) == share  # round trip
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(gpu_memory_utilization=0.8, kv_cache_memory_bytes=1 << 30)
    with pytest.raises(ValueError, match="needs a size"):
        EngineConfig(kv_cache_memory_bytes=None)
    with pytest.raises(ValueError):
        EngineConfig(gpu_memory_utilization=1.5)


def test_the_draft_sampling_setting_reaches_vllm():
    argmax = EngineConfig(wcs=None, drafter={"draft_sample_method": "greedy"})
    assert argmax.vllm_kwargs()["speculative_config"]["draft_sample_method"] == "greedy"
    # the default: sampled requests draw drafts from the drafter (what acceptance at T=1 needs)
    assert EngineConfig(wcs=None).vllm_kwargs()["speculative_config"]["draft_sample_method"] == "probabilistic"


def test_nvidia_smi_listing_and_detection_never_fail(monkeypatch):
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-0a1b2c3d-0000-0000-0000-000000000000)\n"
        "  MIG 3g.71gb     Device  0: (UUID: MIG-11111111-0000-0000-0000-000000000000)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-0a1b2c3d-0000-0000-0000-000000000001)\n"
    )
    assert parse_nvidia_smi_list(listing) == (2, "NVIDIA H200")
    assert parse_nvidia_smi_list("") == (0, None)
    detected = HostDescription.detect()  # this machine, whatever it has
    assert detected.cpus == (os.cpu_count() or 1) and detected.gpus >= 0 and detected.source == "detected"
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi at all
    assert HostDescription.detect().gpus in (0, detected.gpus)  # (0 unless a driver without nvidia-smi lets torch see GPUs)


def test_detection_counts_only_visible_gpus(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(8)))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert HostDescription.detect().model_dump(include={"gpus", "gpu_name"}) == {"gpus": 8, "gpu_name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert HostDescription.detect().gpus == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert HostDescription.detect().model_dump(include={"gpus", "gpu_name"}) == {"gpus": 0, "gpu_name": None}
    failing = tmp_path / "nvidia-smi"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert HostDescription.detect().gpus == 0


@pytest.fixture
def cli(monkeypatch, capsys):
    """`cluster.cli.main([...])` in this process: (exit status, stdout, stderr); the environment it sets is undone."""
    from cluster import cli as cli_module

    saved = dict(os.environ)

    def run(*argv):
        try:
            code = cli_module.main(list(argv))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_serve_dry_run_assume_8_gpus_tp2_prints_the_resolved_config(cli, tmp_path):
    config = tmp_path / "tp2.yaml"
    config.write_text(yaml.safe_dump(TP2))
    code, out, _ = cli("serve", "--dry-run", "--assume-gpus", "8", "--config", str(config))
    assert code == 0
    report = yaml.safe_load(out)
    assert report["host"]["gpus"] == 8 and report["host"]["source"] == "assumed"
    replica = report["app"]["replica"]
    assert (replica["accelerator"], replica["num_replicas"], replica["engine"]["dtype"]) == ("gpu", 4, "bfloat16")
    assert replica["engine"]["gpu_memory_utilization"] == GPU_MEMORY_UTILIZATION and replica["engine"]["kv_cache_memory_bytes"] is None
    deployment = report["engine_deployment"]
    assert deployment["num_replicas"] == 4 and deployment["placement_group_strategy"] == "STRICT_PACK"
    assert [b["GPU"] for b in deployment["placement_group_bundles"]] == [1, 1]
    # the printed AppConfig is itself a valid config that resolves to the same thing
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(report["app"]))
    code, out2, _ = cli("serve", "--dry-run", "--assume-gpus", "8", "--config", str(again))
    assert code == 0 and yaml.safe_load(out2)["app"] == report["app"]
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_serve_dry_run_without_gpus_is_the_cpu_default(cli):
    code, out, _ = cli("serve", "--dry-run", "--assume-gpus", "0", "--replicas", "3", "--api-key", "secret")
    assert code == 0
    report = yaml.safe_load(out)
    replica = report["app"]["replica"]
    assert (replica["accelerator"], replica["num_replicas"], replica["engine"]["dtype"]) == ("cpu", 3, "float32")
    assert replica["engine"]["kv_cache_memory_bytes"] == 512 << 20 and replica["engine"]["gpu_memory_utilization"] is None
    assert report["engine_deployment"] == {"num_replicas": 3, "ray_actor_options": {"num_cpus": max(1.0, (os.cpu_count() or 1) / 3)}}
    assert "secret" not in out  # the API key is not printed


def test_serve_dry_run_errors_exit_2(cli, tmp_path):
    config = tmp_path / "tp4.yaml"
    config.write_text("replica:\n  engine:\n    tensor_parallel_size: 4\n")
    code, _, err = cli("serve", "--dry-run", "--assume-gpus", "2", "--config", str(config))
    assert code == 2 and "needs 4 GPUs per replica" in err
    code, out, err = cli("serve", "--dry-run", "--assume-gpus", "6", "--config", str(config))
    assert code == 0 and "warning: 6 GPUs do not divide" in err and yaml.safe_load(out)["app"]["replica"]["num_replicas"] == 1
    code, _, err = cli("serve", "--dry-run", "--assume-gpus", "-1")
    assert code == 2 and "invalid configuration" in err
