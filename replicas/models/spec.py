"""Configuration of the embedded models and of their build (pydantic, with the shipped defaults)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from replicas.overrides import merged

SPECS_DIR = Path(__file__).parent / "specs"


class TargetSpec(BaseModel):
    """A small Llama in Hugging Face format."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 1024
    rope_theta: float = 10000.0


class DrafterSpec(BaseModel):
    """A DFlash parallel drafter (vLLM's `DFlashDraftModel`) sharing the target's embeddings and head.

    `causal` makes block position j attend only to positions before it, so drafting
    the first w positions gives exactly the first w drafts of the full block: any
    width 1..block works without retraining.
    """

    block: int = Field(default=8, ge=1, description="draft positions per pass (vLLM num_speculative_tokens)")
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 704
    target_layer_ids: list[int] = Field(default_factory=lambda: [1, 3], description="0-based target layers fused")
    causal: bool = True
    rope_theta: float = 10000.0
    init_from_target: bool = Field(default=False, description="start the drafter's output norm from the target's final norm, "
                                   "so that its logits start at the target's scale (a trained target's embeddings are large: "
                                   "from a unit norm the first logits were ~40 nats off)")


class CorpusSpec(BaseModel):
    """The training text. The default is the shipped corpus: the standard library only."""

    stdlib: bool = True
    max_stdlib_code_chars: int = 8_000_000
    packages: list[str] = Field(
        default_factory=list, description="installed distributions read as name==version, in this order"
    )
    max_package_code_chars: int = Field(default=8_000_000, description="code characters read per package at most")
    max_file_chars: int = Field(default=400_000, description="package files longer than this are skipped (generated)")
    max_line_chars: int = Field(default=1_000, description="package sources with a longer line are skipped (data)")
    on_version_mismatch: Literal["fail", "skip"] = Field(
        default="fail", description="a pinned package installed at another version: stop, or skip it with a note"
    )


class TrainSpec(BaseModel):
    seed: int = 0
    seq_len: int = 256
    target_steps: int = 600
    target_batch: int = 16
    target_lr: float = 2e-3
    code_share: float = Field(default=0.65, ge=0.0, le=1.0, description="share of code windows in target training")
    distill_prompts: int = 768
    distill_prompt_len: int = 96
    distill_new_tokens: int = 160
    distill_code_share: float = Field(default=0.75, ge=0.0, le=1.0, description="share of code prompts the drafter learns from")
    drafter_steps: int = 1200
    drafter_batch: int = 8
    drafter_anchors: int = 24
    drafter_lr: float = 2e-3
    kl_weight: float = 0.5
    # Added for the larger pair; the defaults keep the shipped build as it was.
    tokenizer_train_chars: int = Field(default=0, ge=0, description="train the tokenizer on this many characters (0: all)")
    lr_schedule: Literal["cosine", "wsd"] = Field(
        default="cosine", description="cosine from warm-up to the end, or warm-up / stable / decay (extendable)"
    )
    warmup_steps: int | None = Field(default=None, description="None: target_steps // 20")
    decay_fraction: float = Field(default=0.2, gt=0.0, le=1.0, description="wsd: share of steps in the final decay")
    min_lr_factor: float = Field(default=0.1, ge=0.0, le=1.0)
    distill_sampled_share: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of drafter training continuations sampled (else greedy)"
    )
    distill_temperature: float = Field(default=1.0, gt=0.0, description="temperature of the sampled continuations")
    distill_gen_batch: int = Field(default=64, ge=1, description="prompts continued per generate() call")
    bf16_autocast: bool = Field(
        default=False, description="train (not evaluate) under CPU bfloat16 autocast: ~2x faster where the CPU has AVX512-BF16"
    )
    eval_every: int = Field(default=0, ge=0, description="held-out perplexity every this many target steps (0: never)")
    eval_windows: int = Field(default=16, ge=1, description="held-out windows per domain of the periodic evaluation")
    drafter_labels: Literal["sequence", "target_argmax"] = Field(
        default="sequence",
        description="the drafter's cross-entropy labels: the training sequence's own tokens, or the target's argmax at each "
        "position (the draft greedy verification accepts, and the one sampled verification accepts most often)",
    )
    drafter_position_decay: float = Field(
        default=0.0, ge=0.0, description="weight block position j by exp(-(j-1)/decay), as DFlash trains: a later draft "
        "counts only when every earlier one was accepted (0: all positions alike)"
    )
    drafter_corpus_share: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of each drafter batch that is training text instead of continuations "
        "(far more distinct text than the continuations; pair it with drafter_labels target_argmax)"
    )
    drafter_corpus_min_context: int = Field(default=8, ge=1, description="blocks in training text start after this many tokens")
    drafter_restarts: list[int] = Field(
        default_factory=list, description="drafter steps at which its cosine schedule restarts with fresh AdamW moments and "
        "a fresh data order (warm restarts): a finished drafter trains on by adding its last step here and raising "
        "drafter_steps"
    )

    drafter_cycle_code_shares: list[float | None] = Field(
        default_factory=list, description="per cycle of the drafter's schedule (`drafter_restarts` plus one), the share of "
        "code in its batches, continuations and training text alike (a later cycle with more code specialises the "
        "drafter, as a code assistant's is); null: continuations drawn as they come and text at distill_code_share; "
        "empty: null for every cycle"
    )
    drafter_cycle_kl_weights: list[float | None] = Field(
        default_factory=list, description="per drafter cycle, the weight of KL(target || drafter) in its loss (a later "
        "cycle with more weight moves the drafter from the target's argmax towards its whole distribution, which is what "
        "sampled verification accepts); null: kl_weight; empty: kl_weight for every cycle"
    )

    @model_validator(mode="after")
    def _restarts_inside_the_run(self) -> "TrainSpec":
        r = self.drafter_restarts
        if r != sorted(set(r)) or any(not 0 < x < self.drafter_steps for x in r):
            raise ValueError("train.drafter_restarts must be increasing steps strictly between 0 and drafter_steps")
        cycles = len(r) + 1
        for name, values, ok, what in (
            ("drafter_cycle_code_shares", self.drafter_cycle_code_shares, lambda x: 0.0 <= x <= 1.0, "one share in [0, 1]"),
            ("drafter_cycle_kl_weights", self.drafter_cycle_kl_weights, lambda x: x >= 0.0, "one weight >= 0"),
        ):
            if values and (len(values) != cycles or any(x is not None and not ok(x) for x in values)):
                raise ValueError(f"train.{name} needs {what} (or null) per drafter cycle: {cycles} here")
        return self

    def drafter_code_share(self, cycle: int) -> float | None:
        """Cycle `cycle`'s `drafter_cycle_code_shares` entry (None: as the drafter's batches always came)."""
        return self.drafter_cycle_code_shares[cycle] if self.drafter_cycle_code_shares else None

    def drafter_kl_weight(self, cycle: int) -> float:
        """Cycle `cycle`'s KL weight: its `drafter_cycle_kl_weights` entry, else `kl_weight`."""
        weight = self.drafter_cycle_kl_weights[cycle] if self.drafter_cycle_kl_weights else None
        return self.kl_weight if weight is None else weight


class PolishSpec(BaseModel):
    """A stage after the drafter's training: the target unlearns its greedy loops by sequence-level unlikelihood
    (Welleck et al. 2020: each step, next-token likelihood on training text plus a penalty on the probability of
    every token of a repeated 4-gram in its own greedy continuations of training prefixes), then the finished
    drafter trains on against the changed target, on that target's new continuations, as its last cycle trained
    (code share, unless `drafter_code_share` says otherwise, and KL weight). Off (0 steps) by default; a finished
    build takes it on with `--resume`."""

    unlikelihood_steps: int = Field(default=0, ge=0, description="target steps of the stage (0: no polish stage)")
    unlikelihood_lr: float = Field(default=5e-5, gt=0.0)
    unlikelihood_weight: float = Field(default=0.5, ge=0.0, description="weight of the unlikelihood term")
    unlikelihood_prefixes: int = Field(default=4, ge=1, description="training prefixes the target continues per step")
    unlikelihood_prefix_len: int = Field(default=48, ge=4)
    unlikelihood_new_tokens: int = Field(default=128, ge=4, description="greedy tokens per prefix, where loops are found")
    unlikelihood_mle_batch: int = Field(default=8, ge=1, description="training windows of the likelihood term per step")
    eval_every: int = Field(default=50, ge=0, description="held-out perplexity and loop share every this many steps (0: never)")
    drafter_steps: int = Field(default=0, ge=0, description="drafter steps against the polished target (0: none)")
    drafter_lr: float = Field(default=5e-4, gt=0.0)
    drafter_code_share: float | None = Field(
        default=None, ge=0.0, le=1.0, description="share of code in the drafter's batches here (None: its last cycle's)"
    )

    @property
    def active(self) -> bool:
        return self.unlikelihood_steps > 0


class BuildSpec(BaseModel):
    corpus: CorpusSpec = Field(default_factory=CorpusSpec)
    target: TargetSpec = Field(default_factory=TargetSpec)
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    polish: PolishSpec = Field(default_factory=PolishSpec)
    weights_dtype: Literal["float32", "float16"] = Field(
        default="float32", description="how the finished weights are stored (and evaluated): float16 halves the files; "
        "the models are rounded to it before the build's evaluation, so its report describes what is served",
    )


def load_spec(name_or_path: str) -> BuildSpec:
    """A name under specs/ (`shipped`: what replicas/models/weights holds; `first`: the first pair, the defaults),
    or a JSON file. A spec may name another in `extends` and give only what differs (objects merge key by key,
    anything else is replaced), so that one package list serves the specs built on it."""
    return BuildSpec.model_validate(_spec_json(name_or_path, ()))


def _spec_json(name_or_path: str, seen: tuple[str, ...]) -> dict:
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = SPECS_DIR / f"{name_or_path}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in SPECS_DIR.glob("*.json")))
        raise FileNotFoundError(f"no build spec {name_or_path!r} (named specs: {names}; or a JSON file)")
    if str(path.resolve()) in seen:
        raise ValueError(f"build spec {path} extends itself: {' -> '.join(seen)} -> {path.resolve()}")
    data = json.loads(path.read_text())
    base = data.pop("extends", None)
    if base is None:
        return data
    return merged(_spec_json(base, (*seen, str(path.resolve()))), data)

