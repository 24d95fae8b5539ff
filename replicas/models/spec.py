"""Configuration of the embedded models and of their build (pydantic, with the shipped defaults)."""

from __future__ import annotations

from pydantic import BaseModel, Field


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


class BuildSpec(BaseModel):
    target: TargetSpec = Field(default_factory=TargetSpec)
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
