"""The engine's own step-cost model, profiled from real timed steps at engine start.

With random widths (chosen without looking at any draft, so outputs keep
their distribution) the engine decodes batches of 1, 2, 4, ... requests; each
decode step logs (requests R, drafted tokens D, target tokens N) and its
period, the time from its start to the next step's start (the whole engine
loop: scheduling, target, sampling, drafting, output handling). A monotone
piecewise-linear T(R, D, N) is fitted to the periods and stored beside the
engine's config, or in a cache keyed by the engine config and the machine.

One engine profiles at a time on a host (`profiling_lock`): a profile taken
while a second replica profiled beside it came out twice as slow, and the
router, which trusts each replica's profile, then starved that replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

from scheduling.cost_model import StepCostModel

PROFILE_TOKENS = 40  # tokens per request per batch; ~10-20 decode steps at random widths
PROFILE_VERSION = 5  # bump when what is profiled or how it is fitted changes: cached profiles are then redone


def cache_dir() -> Path:
    return Path(os.environ.get("FORESPARK_CACHE", Path.home() / ".cache" / "forespark"))


def gpu_names() -> list[str]:
    """The names of the GPUs this process may use (empty on a host without NVIDIA GPUs), from `nvidia-smi`,
    which neither needs CUDA initialised nor takes GPU memory."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = dict(line.split(", ", 1) for line in out.strip().splitlines() if ", " in line)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = [i.strip() for i in visible.split(",") if i.strip()] if visible is not None else sorted(names)
    return [names[i] for i in indices if i in names]


def machine() -> str:
    """The machine, its GPUs and the CPU threads the engine is given: Ray sets OMP_NUM_THREADS to an actor's
    `num_cpus`, a plain process leaves it unset and runs on all cores; step costs differ."""
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    # The kinds of GPU, not how many this process sees: a TP-1 replica under Ray sees one, a TP-2 replica's
    # actor (no GPU of its own) and `forespark calibrate` on the host see them all.
    gpus = ",".join(sorted(set(gpu_names()))) or "none"
    return f"{platform.machine()}|{cpu}|{os.cpu_count()}|gpus={gpus}|OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}"


def weights_fingerprint(path: Path | str) -> str:
    """What tells a model folder's weights apart, cheaply: each file's name and size and its first and last 64 KiB
    (a folder rebuilt in place with another model gets another fingerprint; a hub name stands for itself)."""
    folder, h = Path(path), hashlib.sha256()
    if not folder.is_dir():
        return str(path)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(folder)}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 16))
            if size > 1 << 16:
                fh.seek(max(size - (1 << 16), 1 << 16))
                h.update(fh.read())
    return h.hexdigest()[:16]


def profile_name(config) -> str:
    """The file name of the step-cost profile of an EngineConfig on this machine (WCS settings aside)."""
    # The executor backend is left out: a replica under Serve hands TP to Ray, `forespark calibrate` to vLLM's choice.
    key = config.model_dump(mode="json", exclude={"wcs", "seed", "distributed_executor_backend"})
    # The weights, not only their paths: a pair replaced in place (a new shipped pair) must not be priced by the old one's steps.
    weights = [weights_fingerprint(config.model)] + ([weights_fingerprint(config.drafter.path)] if config.drafter else [])
    digest = hashlib.sha256(json.dumps([key, weights, machine(), PROFILE_VERSION], sort_keys=True).encode()).hexdigest()[:16]
    return f"{digest}.json"


def with_cost_model(config):
    """`config` (an EngineConfig) with its WCS cost-model path filled in: its calibration's profile when that
    calibration was profiled with this engine config on this machine, else the cache's (profiled at start
    when missing)."""
    if config.wcs.cost_model is not None:
        return config
    name = profile_name(config)
    path = cache_dir() / "step_cost" / name
    if config.wcs.calibration is not None and (config.wcs.calibration / "step_cost" / name).exists():
        path = config.wcs.calibration / "step_cost" / name
    return config.model_copy(update={"wcs": config.wcs.model_copy(update={"cost_model": path})})


def _lock_path() -> Path:
    path = cache_dir() / "step_cost" / ".profiling.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def profiling_lock():
    """Held while an engine profiles: the other engines on this host (same cache) wait for it."""
    with open(_lock_path(), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.asynccontextmanager
async def profiling_lock_async():
    """`profiling_lock` for an event loop: the wait runs in a thread, so the replica's loop goes on."""
    with open(_lock_path(), "a") as f:
        await asyncio.to_thread(fcntl.flock, f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 <= max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes


def decode_samples(steps: list[dict]) -> np.ndarray:
    """(n, 4) rows of R, D, N, period-ms for decode steps followed directly by another step."""
    rows = []
    for step, nxt in zip(steps, steps[1:]):
        period = (nxt["start"] - step["start"]) * 1e3
        # A gap well beyond the step's own time is the engine idling between batches.
        if step["prefill"] or not step["requests"] or period > 2.0 * step["runner_ms"] + 20.0:
            continue
        rows.append((step["requests"], step["drafted_tokens"], step["target_tokens"], period))
    return np.array(rows, dtype=np.float64).reshape(-1, 4)


def profile(llm, max_num_seqs: int, seed: int = 0, progress: bool = True) -> StepCostModel:
    """Profile a built `vllm.LLM` with WCS and load the fitted model into its workers."""
    from tqdm import tqdm
    from vllm import SamplingParams

    from replicas.models.workloads import mixed_workload

    sizes = batch_sizes(max_num_seqs)
    prompts = [p.prompt for p in mixed_workload(sizes[-1], seed=seed)]
    params = SamplingParams(temperature=0.0, max_tokens=PROFILE_TOKENS, ignore_eos=True)
    llm.collective_rpc("wcs_profiling", args=(seed,))
    llm.collective_rpc("wcs_step_log", args=(True,))
    try:
        for size in tqdm(sizes, desc="profiling step cost (batch sizes)", disable=not progress):
            llm.generate(prompts[:size], params, use_tqdm=False)
    finally:
        steps = llm.collective_rpc("wcs_step_log", args=(False,))[0]
        llm.collective_rpc("wcs_profiling", args=(None,))
    cost = _fit(decode_samples(steps))
    llm.collective_rpc("wcs_set_cost_model", args=(cost.model_dump_json(),))
    return cost


async def profile_async(engine, max_num_seqs: int, seed: int = 0) -> StepCostModel:
    """`profile` for a running `AsyncLLM` (what a serving replica hosts)."""
    from vllm import SamplingParams

    from replicas.models.workloads import mixed_workload

    sizes = batch_sizes(max_num_seqs)
    prompts = [p.prompt for p in mixed_workload(sizes[-1], seed=seed)]
    params = SamplingParams(temperature=0.0, max_tokens=PROFILE_TOKENS, ignore_eos=True)

    async def run(n: int, rid: str) -> None:
        async for _ in engine.generate(prompts[n], params, request_id=rid):
            pass

    await engine.collective_rpc("wcs_profiling", args=(seed,))
    await engine.collective_rpc("wcs_step_log", args=(True,))
    try:
        for size in sizes:
            await asyncio.gather(*(run(n, f"profile-{size}-{n}") for n in range(size)))
    finally:
        steps = (await engine.collective_rpc("wcs_step_log", args=(False,)))[0]
        await engine.collective_rpc("wcs_profiling", args=(None,))
    cost = _fit(decode_samples(steps))
    await engine.collective_rpc("wcs_set_cost_model", args=(cost.model_dump_json(),))
    return cost


def _fit(samples: np.ndarray) -> StepCostModel:
    if len(samples) < 8:
        raise RuntimeError(f"profiling logged only {len(samples)} decode steps")
    return StepCostModel.fit(*samples.T)


async def ensure_profiled_async(engine, config) -> StepCostModel:
    """`ensure_profiled` for a running `AsyncLLM`."""
    stored = (await engine.collective_rpc("wcs_cost_model"))[0]
    if stored is not None:
        return StepCostModel.model_validate_json(stored)
    path = config.wcs.cost_model
    async with profiling_lock_async():
        if path.exists():  # profiled by a replica of the same config while this one waited
            cost = StepCostModel.load(path)
            await engine.collective_rpc("wcs_set_cost_model", args=(cost.model_dump_json(),))
            return cost
        cost = await profile_async(engine, config.max_num_seqs, seed=config.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        cost.save(path)
    return cost


def ensure_profiled(llm, config) -> StepCostModel:
    """Load the stored cost model for this engine config, or profile now (alone on this host) and store it."""
    path = config.wcs.cost_model
    stored = llm.collective_rpc("wcs_cost_model")[0]
    if stored is not None:
        return StepCostModel.model_validate_json(stored)
    with profiling_lock():
        if path.exists():  # profiled by another engine of the same config while this one waited
            cost = StepCostModel.load(path)
            llm.collective_rpc("wcs_set_cost_model", args=(cost.model_dump_json(),))
            return cost
        cost = profile(llm, config.max_num_seqs, seed=config.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        cost.save(path)
    return cost
