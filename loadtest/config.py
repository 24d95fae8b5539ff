"""What a load test is: the target, the arrival process, the workload and the SLOs.

`LoadTestConfig` travels to the Locust processes as a JSON file (path in
`$FORESPARK_LOADTEST_CONFIG`); `SLOConfig` is what the user writes (YAML,
`--slo PATH`) and what every report is scored against.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CONFIG_ENV = "FORESPARK_LOADTEST_CONFIG"
DEFAULT_SLO = Path(__file__).parent / "slo.yaml"


class SLOConfig(BaseModel):
    """Per-request latency thresholds (unset: not checked) and the share of requests that must meet all of them."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0, description="time to first token")
    tpot_ms: float | None = Field(default=None, gt=0, description="(E2E - TTFT) / (output tokens - 1)")
    e2e_ms: float | None = Field(default=None, gt=0, description="whole request")
    attainment_target: float = Field(default=0.9, gt=0, le=1, description="a rate is sustainable when this share meets every SLO")

    @classmethod
    def load(cls, path: str | Path | None = None) -> "SLOConfig":
        import yaml

        return cls.model_validate(yaml.safe_load(Path(path or DEFAULT_SLO).read_text()) or {})

    def describe(self) -> str:
        """e.g. `TTFT 1000 ms, TPOT 20 ms, attainment >= 90%` (thresholds not set are left out)."""
        set_ = [f"{name} {value:g} ms" for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("E2E", self.e2e_ms)) if value]
        return ", ".join([*set_, f"attainment >= {self.attainment_target:.0%}"])


class Shape(BaseModel):
    """Request rate over time: constant, steps up every `step_s`, or a burst of `burst_rate` for `burst_s`."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["constant", "step", "burst"] = "constant"
    step_s: float = Field(default=10.0, gt=0)
    step_rate: float = Field(default=1.0, ge=0, description="added every step_s (step shape)")
    burst_at_s: float = Field(default=10.0, ge=0)
    burst_s: float = Field(default=5.0, gt=0)
    burst_rate: float = Field(default=0.0, ge=0, description="request rate during the burst (burst shape)")

    def rate_at(self, base: float, t: float) -> float:
        if self.kind == "step":
            return base + self.step_rate * math.floor(t / self.step_s)
        if self.kind == "burst" and self.burst_at_s <= t < self.burst_at_s + self.burst_s:
            return self.burst_rate
        return base


class LongPrompts(BaseModel):
    """Skewed prompt lengths: a share of requests carry a long context (a document, files, a chat history) before
    their prompt, its length in tokens lognormal (most a little under the median, a few many times it), so that
    prefill cost differs by orders of magnitude between requests as it does in production traffic."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(ge=0, le=1, description="share of requests with a long context")
    median_tokens: int = Field(ge=1, description="median context length in tokens")
    sigma: float = Field(default=1.0, ge=0, description="spread of the context length (standard deviation of its log)")
    max_tokens: int = Field(default=16000, ge=1, description="no context is longer than this")
    chars_per_token: float = Field(default=3.5, gt=0, description="characters of text per token of context")

    @classmethod
    def parse(cls, text: str) -> "LongPrompts":
        """`SHARE:MEDIAN_TOKENS[:SIGMA]`, e.g. `0.1:2000:1.0` (the command-line form)."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 3:
            raise ValueError(f"expected SHARE:MEDIAN_TOKENS[:SIGMA], e.g. 0.1:2000:1.0, got {text!r}")
        return cls(share=float(parts[0]), median_tokens=int(parts[1]), **({"sigma": float(parts[2])} if len(parts) == 3 else {}))

    @classmethod
    def argument(cls, text: str) -> "LongPrompts":
        """`parse` as an argparse `type` (its error as the option's message)."""
        import argparse

        try:
            return cls.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None

    def tokens(self, rng) -> int:
        """A context length for one request (0: none); `rng` is a `random.Random`."""
        if self.share <= 0 or rng.random() >= self.share:
            return 0
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(self.median_tokens), self.sigma))))


class LoadTestConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="server root, e.g. http://127.0.0.1:8000")
    model: str = "forespark"
    api_key: str | None = None
    rate: float = Field(gt=0, description="requests per second (the shape's base rate)")
    duration_s: float = Field(gt=0, description="arrivals stop after this; requests in flight then finish")
    drain_s: float = Field(default=60.0, ge=0, description="how long requests in flight may still run after the arrivals stop")
    arrivals: Literal["poisson", "closed"] = Field(
        default="poisson",
        description="poisson: open loop, independent of the server; closed: users wait for replies (Locust's constant_throughput)",
    )
    shape: Shape = Field(default_factory=Shape)
    users: int = Field(default=0, ge=0, description="Poisson sources the rate is split over (0: 8 per process); closed: concurrent users")
    domains: dict[str, float] = Field(default_factory=lambda: {"code": 1.0, "prose": 1.0}, description="workload mix weights")
    max_tokens: int | None = Field(default=None, ge=1, description="output tokens per request (default: each domain's setting)")
    long_prompts: LongPrompts | None = Field(default=None, description="a share of requests with a long context (None: the "
                                             "shipped prompts as they are)")
    ignore_eos: bool = Field(default=True, description="every request produces exactly max_tokens (comparable runs)")
    temperature: float = Field(default=0.0, ge=0)
    seed: int = Field(default=0, description="arrival times and prompts: the same seed and settings give the same load")
    processes: int = Field(default=1, ge=1, description="Locust worker processes")
    out_dir: Path = Field(default=Path("results/loadtest"))

    @model_validator(mode="after")
    def _check(self) -> "LoadTestConfig":
        if not any(w > 0 for w in self.domains.values()):
            raise ValueError("domains: at least one weight must be positive")
        return self

    def source_count(self) -> int:
        return self.users or 8 * self.processes

    def users_at(self, t: float) -> int:
        """Locust users at time t: each is a Poisson source of `rate / users` requests per second, so the
        shape moves the total rate in steps of that (a superposition of Poisson processes is Poisson)."""
        if self.arrivals == "closed":
            return self.source_count()
        return max(0, round(self.shape.rate_at(self.rate, t) / self.rate_per_user()))

    def rate_per_user(self) -> float:
        return self.rate / self.source_count()
