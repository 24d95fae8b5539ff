"""vLLM engine configuration for a replica: the embedded CPU default and what vLLM is handed.

The same pydantic object goes from the serving layer's config file to the
engine, so every setting has one home and one default.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.models import WEIGHTS_DIR
from replicas.wcs.config import RUNNER_ENV, WORKER_CLS, WCSConfig


def cpu_engine_environment() -> None:
    """Process settings the CPU build needs (set before vLLM is imported). A host with NVIDIA's driver tools
    (what `make` installs the GPU build on) keeps vLLM's own: TP workers there may span nodes."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if shutil.which("nvidia-smi") is None:
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def lower_priority(niceness: int) -> int:
    """Run this process at `niceness` or lower priority: every thread now, and so the threads and processes they
    start (the engine core). Linux keeps a niceness per thread, so `os.nice` alone would leave the other threads
    where they were. Never raises a priority (that needs privileges); returns the niceness in effect."""
    tasks = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tasks:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)


class DrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Path = WEIGHTS_DIR / "drafter"
    method: str = "dflash"
    num_speculative_tokens: int = Field(default=8, ge=1, description="widest draft (the drafter's block)")
    draft_sample_method: Literal["greedy", "probabilistic"] = Field(
        default="probabilistic", description="vLLM's: drafts are the drafter's argmax (sampled verification then accepts a draft "
        "with the target's probability of it), or sampled from the drafter with its probabilities in the ratio test "
        "(accepts the overlap of the two distributions)",
    )


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Path = WEIGHTS_DIR / "target"
    drafter: DrafterConfig | None = Field(default_factory=DrafterConfig)
    dtype: str = "float32"
    max_model_len: int = 1024
    max_num_seqs: int = 64
    kv_cache_memory_bytes: int | None = Field(
        default=512 << 20, gt=0,
        description="KV cache bytes per worker (per GPU under tensor parallelism); the CPU build needs it, else it takes most of RAM",
    )
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1,
        description="instead of kv_cache_memory_bytes: share of each GPU's memory the engine takes (weights + KV); setting it "
        "drops the byte default (vLLM ignores this share when bytes are set, except for its start-up free-memory check)",
    )
    enforce_eager: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = Field(default=None, description="None: vLLM's choice; ray: TP workers in the replica's placement group")
    wcs: WCSConfig | None = Field(default_factory=WCSConfig, description="None: vLLM's own speculation, no WCS")

    @model_validator(mode="after")
    def _one_kv_size(self) -> "EngineConfig":
        """Exactly one KV size reaches vLLM: gpu_memory_utilization replaces the default byte count."""
        if self.gpu_memory_utilization is not None:
            if self.kv_cache_memory_bytes is not None and "kv_cache_memory_bytes" in self.model_fields_set:
                raise ValueError("set kv_cache_memory_bytes or gpu_memory_utilization, not both")
            self.kv_cache_memory_bytes = None
        elif self.kv_cache_memory_bytes is None:
            raise ValueError("the KV cache needs a size: kv_cache_memory_bytes or gpu_memory_utilization")
        return self

    @model_validator(mode="after")
    def _wcs_has_traces(self) -> "EngineConfig":
        if self.wcs is not None and self.drafter is not None:
            self.wcs.check_pair(self.model, self.drafter.path)  # an error naming `forespark calibrate`, at config load
        return self

    def wcs_for_pair(self) -> WCSConfig | None:
        """The WCS settings as the engine runs them: traces and draft widths resolved for this model pair."""
        if self.wcs is None or self.drafter is None:
            return self.wcs
        return self.wcs.for_pair(self.model, self.drafter.path, self.drafter.num_speculative_tokens)

    def vllm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": str(self.model),
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "tensor_parallel_size": self.tensor_parallel_size,
            "disable_log_stats": False,
        }
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = self.distributed_executor_backend
        if self.drafter is not None:
            kwargs["speculative_config"] = {
                "method": self.drafter.method,
                "model": str(self.drafter.path),
                "num_speculative_tokens": self.drafter.num_speculative_tokens,
                "draft_sample_method": self.drafter.draft_sample_method,
            }
            if self.wcs is not None:
                kwargs["worker_cls"] = WORKER_CLS
                kwargs["additional_config"] = self.wcs_for_pair().additional_config()
                # WCS hands the scheduler each step's drafts synchronously (the CPU build is always sync).
                kwargs["async_scheduling"] = False
        return kwargs


def engine_environment(config: EngineConfig) -> None:
    """Process settings for an engine of this config, set before vLLM reads them: the CPU build's, and
    for WCS engines the V1 model runner (`RUNNER_ENV`; a value the operator set is kept, and a V2 one is
    refused by the WCS worker with its reason)."""
    cpu_engine_environment()
    if config.wcs is not None and config.drafter is not None:
        os.environ.setdefault(RUNNER_ENV, "0")
    if shutil.which("nvidia-smi") is None and config.tensor_parallel_size > 1:
        # The CPU build binds each rank's threads to a NUMA node of its own unless told otherwise, and refuses
        # a host with fewer nodes than ranks: one core per rank instead (an operator's setting is kept).
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(config.tensor_parallel_size)))


def make_llm(config: EngineConfig):
    """An offline `vllm.LLM` for this config, its engine core in this process (`model_runner` reaches into it)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_environment(config)
    from vllm import LLM

    if config.wcs is not None and config.drafter is not None:
        from replicas.wcs.profiler import with_cost_model

        config = with_cost_model(config)
        llm = LLM(**config.vllm_kwargs())
        from replicas.wcs.profiler import ensure_profiled

        ensure_profiled(llm, config)
        return llm
    return LLM(**config.vllm_kwargs())


def model_runner(llm):
    """The in-process engine's model runner (offline tools and tests hook into it)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
