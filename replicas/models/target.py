"""The target: a small Llama (Hugging Face `LlamaForCausalLM`), trained on both domains."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from replicas.models.data import TokenStreams
from replicas.models.optim import Optimiser
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


def train_target(
    model, streams: TokenStreams, train: TrainSpec, progress: Callable[[int, float], None] | None = None
) -> list[float]:
    """AdamW with warm-up and cosine decay on mixed code/prose windows; returns the loss curve."""
    rng = np.random.default_rng(train.seed)
    warmup = max(1, train.target_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, train.target_steps - warmup)))

    opt = Optimiser(model.parameters(), train.target_lr, 0.05, lr_at)
    model.train()
    losses = []
    for step in range(train.target_steps):
        batch = torch.from_numpy(streams.mixed_windows(train.seq_len, train.target_batch, train.code_share, rng))
        losses.append(opt.step(model(input_ids=batch, labels=batch).loss))
        if progress:
            progress(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def held_out_perplexity(model, streams: TokenStreams, seq_len: int, windows: int = 48, seed: int = 1) -> dict[str, dict]:
    """Per-domain perplexity on held-out text, next to an add-one unigram baseline."""
    rng = np.random.default_rng(seed)
    unigram = streams.unigram_log_probs(model.config.vocab_size)
    out = {}
    for domain in streams.streams:
        batch = torch.from_numpy(streams.windows(domain, "held_out", seq_len, windows, rng))
        nll = float(model(input_ids=batch, labels=batch).loss)
        uni = float(-unigram[batch[:, 1:].numpy()].mean())
        out[domain] = {"perplexity": math.exp(nll), "unigram_perplexity": math.exp(uni)}
    return out
