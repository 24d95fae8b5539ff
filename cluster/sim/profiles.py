"""Step-cost profiles the simulator prices engine steps with, by name (`forespark simulate profiles`).

- `cpu-embedded`: the real CPU engine's profiled `StepCostModel` (the embedded pair served by
  `forespark serve` on this project's 2-core host, one CPU per replica), committed as profiled.
- `<gpu>-8b-tp<N>`: an 8B dense target (Qwen3-8B shape) with a 5-layer DFlash drafter (block 16) on A100,
  H100 or H200 at tensor parallelism 1 or 2, built from roofline terms below. Each parameter carries its source.

A roofline step of the target over N tokens for R requests is

    T = overhead + max(weight bytes / (HBM bandwidth * bw_eff), 2 * params * N / (peak FLOPs * mfu))
        + R * mean context * KV bytes per token / (HBM bandwidth * bw_eff)           (attention reads)
        + (TP > 1) * all-reduces per step * all-reduce latency

which is piecewise linear in N (flat to the knee where compute passes the weight read, then the compute
slope): exactly the form of `StepCostModel`. The drafter adds its own weight read when it runs (the launch),
its compute per drafted token past its own knee, and a context store per request in the batch.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from scheduling.cost_model import PiecewiseLinear, StepCostModel

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "h100-8b-tp1"


class GPUSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    hbm_tb_s: float = Field(description="HBM bandwidth, TB/s")
    bf16_tflops: float = Field(description="dense BF16 tensor-core peak, TFLOP/s")
    source: str


class TargetSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    params_b: float = Field(description="parameters, billions (BF16 weights)")
    layers: int
    kv_heads: int
    head_dim: int
    source: str

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2.0  # K and V, BF16


class DrafterSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    params_b: float = Field(description="parameters the drafter reads per pass, billions (its layers and the shared LM head)")
    block: int = Field(description="widest draft (K)")
    context_bytes_per_token: float = Field(description="drafter K/V written per context token")
    source: str


class Efficiency(BaseModel):
    """What the roofline's peaks are discounted by, and the per-step costs outside the model's kernels."""

    model_config = ConfigDict(frozen=True)

    bw_eff: float = Field(default=0.8, description="achieved share of HBM bandwidth in decode GEMVs")
    mfu: float = Field(default=0.55, description="achieved share of peak FLOPs in prefill-sized GEMMs")
    step_overhead_ms: float = Field(default=1.5, description="scheduler, sampling, input preparation per step")
    drafter_overhead_ms: float = Field(default=0.3, description="launching the drafter's pass")
    all_reduce_us: float = Field(default=12.0, description="one small all-reduce over NVLink (TP > 1)")
    mean_context: int = Field(default=1024, description="mean tokens in a request's KV cache (prompt + output so far)")
    source: str = (
        "bw_eff and mfu: Vidur (MLSys'24) profiled H100 decode/prefill GEMMs and BLIS's H100 coefficients fall at "
        "0.7-0.85 of HBM and 0.5-0.65 of peak; step overhead: vLLM V1 CPU overhead per step with CUDA graphs, "
        "1-2 ms (vLLM V1 blog); all-reduce: NCCL small-message latency on NVLink 4, 8-15 us"
    )


GPUS = {
    # The generation before: real fleets keep serving on it beside newer GPUs (its efficiencies taken as the
    # H100's; Vidur profiles A100 operators in the same ranges).
    "a100": GPUSpec(name="A100 SXM 80GB", hbm_tb_s=2.039, bf16_tflops=312.0, source="NVIDIA A100 datasheet (SXM4 80GB)"),
    "h100": GPUSpec(name="H100 SXM", hbm_tb_s=3.35, bf16_tflops=989.0, source="NVIDIA H100 datasheet (SXM5)"),
    "h200": GPUSpec(name="H200 SXM", hbm_tb_s=4.8, bf16_tflops=989.0, source="NVIDIA H200 datasheet (SXM)"),
}
TARGET_8B = TargetSpec(
    params_b=8.2, layers=36, kv_heads=8, head_dim=128, source="Qwen3-8B config.json (36 layers, 8 KV heads of 128)"
)
DRAFTER_DFLASH_5L = DrafterSpec(
    params_b=1.6,
    block=16,
    context_bytes_per_token=2 * 5 * 8 * 128 * 2.0,
    source="DFlash drafter for Qwen3-8B: 5 decoder layers of the target's width (~1.0B) and the shared LM head (0.6B)",
)


def roofline_profile(gpu: GPUSpec, tp: int, target: TargetSpec = TARGET_8B, drafter: DrafterSpec = DRAFTER_DFLASH_5L,
                     eff: Efficiency = Efficiency()) -> StepCostModel:
    """The step-cost model of `target` + `drafter` on `tp` GPUs of `gpu` (see the module docstring)."""
    bw = gpu.hbm_tb_s * 1e12 * eff.bw_eff * tp  # bytes/s over the TP group
    flops = gpu.bf16_tflops * 1e12 * eff.mfu * tp
    weights_ms = target.params_b * 1e9 * 2.0 / bw * 1e3
    per_token_ms = 2.0 * target.params_b * 1e9 / flops * 1e3
    knee = weights_ms / per_token_ms  # target tokens where compute passes the weight read
    kv_ms = eff.mean_context * target.kv_bytes_per_token / bw * 1e3
    all_reduce_ms = (2 * target.layers * eff.all_reduce_us / 1e3) if tp > 1 else 0.0
    d_weights_ms = drafter.params_b * 1e9 * 2.0 / bw * 1e3
    d_per_token_ms = 2.0 * drafter.params_b * 1e9 / flops * 1e3
    d_knee = d_weights_ms / d_per_token_ms
    small = 0.02 * per_token_ms  # below the knee a token still costs a little (attention, sampling)
    return StepCostModel(
        intercept_ms=eff.step_overhead_ms + weights_ms + all_reduce_ms,
        draft_launch_ms=eff.drafter_overhead_ms + d_weights_ms,
        launch_per_request_ms=drafter.context_bytes_per_token / bw * 1e3,
        requests=PiecewiseLinear(knots=[0.0, 1.0], slopes=[kv_ms]),
        drafted=PiecewiseLinear(knots=[0.0, d_knee, d_knee + 1.0], slopes=[0.02 * d_per_token_ms, d_per_token_ms]),
        target=PiecewiseLinear(knots=[0.0, knee, knee + 1.0], slopes=[small, per_token_ms]),
    )


class Profile(BaseModel):
    """A named cost profile: the step-cost model, the drafter's block, and where it came from."""

    name: str
    cost: StepCostModel
    k: int
    context_ms_per_row: float = Field(description="storing one deferred drafter context row (a held step's token)")
    source: str


def _gpu_profile(gpu: str, tp: int, eff: Efficiency = Efficiency()) -> Profile:
    spec = GPUS[gpu]
    bw = spec.hbm_tb_s * 1e12 * eff.bw_eff * tp
    return Profile(
        name=f"{gpu}-8b-tp{tp}",
        cost=roofline_profile(spec, tp, eff=eff),
        k=DRAFTER_DFLASH_5L.block,
        context_ms_per_row=DRAFTER_DFLASH_5L.context_bytes_per_token / bw * 1e3,
        source=f"roofline: {spec.source}; {TARGET_8B.source}; {DRAFTER_DFLASH_5L.source}; {eff.source}",
    )


# The uncertain roofline parameters and their plausible ranges (the sources in `Efficiency`): a sensitivity run
# repeats a result at every corner of this box.
SENSITIVITY = {"bw_eff": (0.7, 0.85), "mfu": (0.5, 0.65), "step_overhead_ms": (1.0, 2.0)}


def sensitivity_corners() -> list[dict[str, float]]:
    import itertools

    names = list(SENSITIVITY)
    return [dict(zip(names, values)) for values in itertools.product(*(SENSITIVITY[n] for n in names))]


@cache
def profiles() -> dict[str, Profile]:
    out = {
        "cpu-embedded": Profile(
            name="cpu-embedded",
            cost=StepCostModel.load(PROFILE_DIR / "cpu-embedded.json"),
            k=8,
            context_ms_per_row=0.03,
            source="profiled: the shipped embedded pair's engine under `forespark serve` on this project's 2-core host "
            "(replicas/wcs/profiler.py, one CPU per replica; results/sim/validate-pair2-real/profile.json); context "
            "store per row an estimate from the first pair (probe rounds at 64 requests stored 1,000-4,000 deferred "
            "rows in 30-80 ms; this pair stored 789 rows in 9 ms at 4 requests)",
        )
    }
    for gpu in GPUS:
        for tp in (1, 2):
            p = _gpu_profile(gpu, tp)
            out[p.name] = p
    return out


def load_profile(name: str, k: int = 8, efficiency: dict[str, float] | None = None) -> Profile:
    """A named profile, or a profiled `StepCostModel` JSON file (an engine's cache entry) for a drafter of block `k`.
    `efficiency`: for a roofline profile, `Efficiency` fields that replace the defaults (a sensitivity run)."""
    known = profiles()
    if efficiency:
        gpu, _, tp = name.partition("-8b-tp")
        if gpu not in GPUS or not tp.isdigit():
            raise ValueError(f"efficiency overrides apply to the roofline profiles only, not {name!r}")
        return _gpu_profile(gpu, int(tp), Efficiency(**efficiency))
    if name in known:
        return known[name]
    if name.endswith(".json") and Path(name).exists():
        return Profile(name=name, cost=StepCostModel.load(name), k=k, context_ms_per_row=known["cpu-embedded"].context_ms_per_row,
                       source=f"profiled: {name}")
    raise ValueError(f"unknown cost profile {name!r}; known: {', '.join(sorted(known))}, or a profiled JSON file")
