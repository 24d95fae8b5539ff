"""The target: a small Llama (Hugging Face `LlamaForCausalLM`), trained on both domains."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from replicas.models.data import TokenStreams
from replicas.models.optim import Optimiser, TrainerState
from replicas.models.spec import TargetSpec, TrainSpec


def llama_config(spec: TargetSpec, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )


def new_target(spec: TargetSpec, eos_id: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(spec, eos_id))


def lr_factor(train: TrainSpec, steps: int | None = None) -> Callable[[int], float]:
    """Learning-rate factor per step: linear warm-up, then cosine decay to `min_lr_factor` over the
    remaining steps (`cosine`), or constant until the last `decay_fraction` of the steps and then the
    cosine decay (`wsd`: a run can be extended while it is in the constant part)."""
    steps = steps if steps is not None else train.target_steps
    warmup = train.warmup_steps if train.warmup_steps is not None else max(1, steps // 20)
    low = train.min_lr_factor
    decay_start = warmup if train.lr_schedule == "cosine" else max(warmup, steps - int(round(steps * train.decay_fraction)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_start:
            return 1.0
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * (step - decay_start) / max(1, steps - decay_start)))

    return factor


def decay_start(train: TrainSpec) -> int:
    """The first step whose learning rate depends on `target_steps` (before it, a run can be extended)."""
    warmup = train.warmup_steps if train.warmup_steps is not None else max(1, train.target_steps // 20)
    if train.lr_schedule == "cosine":
        return warmup
    return max(warmup, train.target_steps - int(round(train.target_steps * train.decay_fraction)))


class TargetTrainer(TrainerState):
    """AdamW on mixed code/prose windows, one step at a time, with its whole state in `state_dict()`
    (weights, optimiser moments, schedule position, the window sampler's RNG, the loss curve), so
    a run resumed from a checkpoint takes exactly the steps the uninterrupted run would have."""

    def __init__(self, model, streams: TokenStreams, train: TrainSpec) -> None:
        self.model, self.streams, self.train = model, streams, train
        self.trained = model
        self.rng = np.random.default_rng(train.seed)
        self.opt = Optimiser(model.parameters(), train.target_lr, 0.05, lr_factor(train))
        self.step = 0
        self.losses: list[float] = []
        model.train()

    @property
    def done(self) -> bool:
        return self.step >= self.train.target_steps

    def run_step(self) -> float:
        t = self.train
        batch = torch.from_numpy(self.streams.mixed_windows(t.seq_len, t.target_batch, t.code_share, self.rng))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.bf16_autocast):
            loss = self.model(input_ids=batch, labels=batch).loss
        loss = self.opt.step(loss)
        self.losses.append(loss)
        self.step += 1
        return loss

    @property
    def lr(self) -> float:
        return float(self.opt.opt.param_groups[0]["lr"])


def train_target(
    model, streams: TokenStreams, train: TrainSpec, progress: Callable[[int, float], None] | None = None
) -> list[float]:
    """AdamW with warm-up and cosine decay on mixed code/prose windows; returns the loss curve."""
    trainer = TargetTrainer(model, streams, train)
    while not trainer.done:
        loss = trainer.run_step()
        if progress:
            progress(trainer.step - 1, loss)
    model.eval()
    return trainer.losses


@torch.no_grad()
def held_out_perplexity(
    model, streams: TokenStreams, seq_len: int, windows: int = 48, seed: int = 1, unigram: np.ndarray | None = None
) -> dict[str, dict]:
    """Per-domain perplexity on held-out text, next to an add-one unigram baseline, and bits per
    character (the per-token figure over the held-out stream's characters per token, so that
    tokenizers of different vocabularies compare)."""
    rng = np.random.default_rng(seed)
    unigram = unigram if unigram is not None else streams.unigram_log_probs(model.config.vocab_size)
    was_training = model.training
    model.eval()
    out = {}
    for domain in streams.streams:
        batch = torch.from_numpy(streams.windows(domain, "held_out", seq_len, windows, rng))
        nll = float(model(input_ids=batch, labels=batch).loss)
        uni = float(-unigram[batch[:, 1:].numpy()].mean())
        out[domain] = {"perplexity": math.exp(nll), "unigram_perplexity": math.exp(uni)}
        if streams.chars:
            out[domain]["bits_per_char"] = nll / math.log(2) / streams.chars_per_token(domain, "held_out")
    model.train(was_training)
    return out
