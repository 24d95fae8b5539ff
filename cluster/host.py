"""Host defaults: what `forespark serve` fills in for the settings a config leaves out, from a host description.

    HostDescription.detect()                 this machine: CPUs, and CUDA GPUs from `nvidia-smi -L`
    HostDescription.assume(gpus=N)           a GPU host described on the command line (`--assume-gpus N`)
    resolve_app_config(raw, host, overrides) the AppConfig a config file (raw dict) resolves to on that host

Only settings the user did not give (absent from the file and the command line) get a default:

| setting | CPU host (no GPU) | GPU host |
|---|---|---|
| replica.accelerator | cpu | gpu |
| replica.num_replicas | max(2, CPUs / 2) | GPUs // tensor_parallel_size (floor; leftover GPUs: a warning) |
| replica.num_cpus | max(1, CPUs / replicas) | min(4, CPUs / replicas) |
| engine.dtype | EngineConfig's (float32) | bfloat16 |
| engine.enforce_eager | EngineConfig's (true) | false |
| engine KV size | kv_cache_memory_bytes (512 MiB) | gpu_memory_utilization 0.9 (per GPU) |

On a GPU host each replica gets its GPUs through `engine_deployment_options` (cluster/app.py): one GPU for
TP 1, one placement-group bundle per tensor-parallel rank otherwise. A host with fewer GPUs than one
replica's tensor_parallel_size is an error. The resolution is a pure function of the host description, so
`forespark serve --dry-run [--assume-gpus N]` shows it without Ray, vLLM or a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from cluster.app import AppConfig

GPU_MEMORY_UTILIZATION = 0.9  # share of each GPU one engine may take (weights, activations, KV); vLLM 0.32 defaults to 0.92
GPU_DTYPE = "bfloat16"
MAX_CPUS_PER_GPU_REPLICA = 4.0


class HostDefaultsWarning(UserWarning):
    """A default that leaves part of the host unused."""


class HostDescription(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpus: int = Field(ge=1, description="logical CPUs")
    gpus: int = Field(default=0, ge=0, description="CUDA GPUs visible to this process")
    gpu_name: str | None = None
    source: Literal["detected", "assumed"] = "detected"

    @classmethod
    def detect(cls) -> HostDescription:
        """This machine. Never fails: a host without a working NVIDIA driver has 0 GPUs. Imports no vLLM."""
        gpus, name = detect_cuda_gpus()
        return cls(cpus=os.cpu_count() or 1, gpus=gpus, gpu_name=name)

    @classmethod
    def assume(cls, gpus: int, cpus: int | None = None, gpu_name: str | None = None) -> HostDescription:
        """A host as described on the command line (CPUs default to this machine's)."""
        return cls(cpus=cpus or os.cpu_count() or 1, gpus=gpus, gpu_name=gpu_name, source="assumed")

    def summary(self) -> str:
        gpu = f"{self.gpus} GPU(s)" + (f" ({self.gpu_name})" if self.gpu_name else "") if self.gpus else "no GPU"
        return f"{self.source} host: {self.cpus} CPUs, {gpu}"


def _visible_limit() -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES leaves visible (None: unset, all of them)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    ids = [v.strip() for v in value.split(",") if v.strip()]
    visible = []
    for v in ids:  # CUDA stops at the first invalid (e.g. "-1") entry
        if v.startswith("-"):
            break
        visible.append(v)
    return len(visible)


def parse_nvidia_smi_list(text: str) -> tuple[int, str | None]:
    """(GPU count, first GPU's name) from `nvidia-smi -L` (lines `GPU 0: NVIDIA H200 (UUID: ...)`; MIG lines skipped)."""
    names = [m.group(1).strip() for m in re.finditer(r"^GPU \d+: (.*?)(?: \(UUID: [^)]*\))?\s*$", text, re.MULTILINE)]
    return len(names), (names[0] if names else None)


def detect_cuda_gpus() -> tuple[int, str | None]:
    """(CUDA GPUs this process may use, the first one's name); (0, None) on any failure."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        if not Path("/proc/driver/nvidia").exists():
            return 0, None
        try:  # a driver but no nvidia-smi (some containers): ask torch, which applies CUDA_VISIBLE_DEVICES itself
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            return count, (torch.cuda.get_device_name(0) if count else None)
        except Exception:  # noqa: BLE001 - a broken CUDA install means no usable GPU, not a failed command
            return 0, None
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0, None
    if proc.returncode != 0:
        return 0, None
    count, name = parse_nvidia_smi_list(proc.stdout)
    limit = _visible_limit()  # nvidia-smi lists every GPU; CUDA (and Ray) see only the visible ones
    if limit is not None:
        count = min(count, limit)
    return count, (name if count else None)


def _given(raw: dict[str, Any], *path: str) -> bool:
    """Whether the user's config (file plus command line) sets this key, even to null."""
    node: Any = raw
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def merge_overrides(raw: dict[str, Any], overrides: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """A copy of `raw` with the command line's values (those not None) on top, section by section."""
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for section, values in (overrides or {}).items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            merged[section] = {**(merged.get(section) or {}), **given}
    return merged


def host_defaults(raw: dict[str, Any], host: HostDescription) -> tuple[dict[str, Any], list[str]]:
    """The defaults `host` implies for what `raw` leaves out, as a partial raw config, and warnings.

    `raw` is the user's config with the command line merged in; it must already validate as an AppConfig.
    """
    from cluster.app import AppConfig

    user = AppConfig.model_validate(raw).replica
    replica: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    notes: list[str] = []

    def default(section: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
        if not _given(raw, "replica", *path):
            section[path[-1]] = value

    gpu = user.accelerator == "gpu" if _given(raw, "replica", "accelerator") else host.gpus > 0
    default(replica, ("accelerator",), "gpu" if gpu else "cpu")
    num_replicas = user.num_replicas
    if not gpu:
        if not _given(raw, "replica", "num_replicas"):
            num_replicas = replica["num_replicas"] = max(2, host.cpus // 2)
        default(replica, ("num_cpus",), max(1.0, host.cpus / num_replicas))
    else:
        tp = user.engine.tensor_parallel_size
        if not _given(raw, "replica", "num_replicas") and host.gpus > 0:
            if host.gpus < tp:
                raise ValueError(
                    f"tensor_parallel_size {tp} needs {tp} GPUs per replica; the {host.source} host has {host.gpus}"
                )
            num_replicas = replica["num_replicas"] = host.gpus // tp
            if host.gpus % tp:
                notes.append(
                    f"{host.gpus} GPUs do not divide into replicas of tensor_parallel_size {tp}: "
                    f"{num_replicas} replica(s), {host.gpus % tp} GPU(s) left idle"
                )
        default(replica, ("num_cpus",), round(min(MAX_CPUS_PER_GPU_REPLICA, host.cpus / num_replicas), 3))
        default(engine, ("engine", "dtype"), GPU_DTYPE)
        default(engine, ("engine", "enforce_eager"), False)
        if not (_given(raw, "replica", "engine", "kv_cache_memory_bytes") or _given(raw, "replica", "engine", "gpu_memory_utilization")):
            engine["kv_cache_memory_bytes"] = None  # vLLM's KV bytes are per GPU; size it by memory share instead
            engine["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
    if engine:
        replica["engine"] = engine
    return {"replica": replica}, notes


def _under(defaults: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with `defaults` filled in where it has no key (nested dicts merged; raw always wins)."""
    out = dict(defaults)
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _under(out[key], value)
        else:
            out[key] = value
    return out


def resolve_app_config(
    raw: dict[str, Any] | None, host: HostDescription, overrides: dict[str, dict[str, Any]] | None = None
) -> AppConfig:
    """The AppConfig `forespark serve` runs: the user's config and command-line values, host defaults under them.

    Pure: depends only on its arguments. Raises ValueError (pydantic's ValidationError included) for a bad
    config or a host that cannot hold one replica; warns (HostDefaultsWarning) when GPUs are left idle.
    """
    from cluster.app import AppConfig

    merged = merge_overrides(raw or {}, overrides)
    AppConfig.model_validate(merged)  # the user's own errors first, reported against what they wrote
    defaults, notes = host_defaults(merged, host)
    for note in notes:
        warnings.warn(note, HostDefaultsWarning, stacklevel=2)
    return AppConfig.model_validate(_under(defaults, merged))


def load_app_config(path: str | Path | None, overrides: dict[str, dict[str, Any]] | None, host: HostDescription) -> AppConfig:
    """`forespark serve`'s config: the YAML/JSON file at `path` resolved on `host`; warnings go to stderr."""
    import sys

    import yaml

    raw = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HostDefaultsWarning)
        config = resolve_app_config(raw, host, overrides)
    for w in caught:
        if issubclass(w.category, HostDefaultsWarning):
            print(f"forespark serve: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return config


def _masked(app: dict[str, Any]) -> dict[str, Any]:
    if app.get("ingress", {}).get("api_key"):
        app["ingress"]["api_key"] = "***"  # printed configs end up in logs
    return app


def dry_run_report(config: AppConfig, host: HostDescription) -> dict[str, Any]:
    """What `forespark serve --dry-run` prints: the host, the resolved AppConfig, and the Serve options it implies."""
    from cluster.app import engine_deployment_options, replica_count_options

    return {
        "host": host.model_dump(),
        "app": _masked(config.model_dump(mode="json")),
        "engine_deployment": {**replica_count_options(config.replica), **engine_deployment_options(config.replica)},
    }


def print_dry_run(config: AppConfig, host: HostDescription) -> None:
    """`forespark serve --dry-run`: one YAML document (host, app: the resolved AppConfig, engine_deployment)."""
    import yaml

    rc = config.replica
    tp = rc.engine.tensor_parallel_size
    print(f"# {host.summary()}: {rc.num_replicas} {rc.accelerator.upper()} replica(s), tensor_parallel_size {tp}, {rc.engine.dtype}")
    print("# app: the AppConfig `forespark serve` would run (usable as --config); engine_deployment: its Serve options")
    print(yaml.safe_dump(dry_run_report(config, host), sort_keys=False), end="")
