"""The target unlearns its greedy loops: sequence-level unlikelihood (Welleck et al. 2020, "Neural text
generation with unlikelihood training", section 5.2).

A small model trained by likelihood alone falls into loops under greedy decoding (`" 1, 1, 1,"`,
`"import os\\nimport os\\n"`): each repetition makes the next one more likely. Each step here continues a few
training prefixes greedily with the model itself, marks every token of a 4-gram that already occurred in the
sequence, and lowers the probability of those tokens (the loss -log(1 - p)), while the likelihood of training
text keeps the model a language model. Its held-out perplexity rises a little; that is the price.
"""

from __future__ import annotations

import numpy as np
import torch

from replicas.models.data import TokenStreams
from replicas.models.optim import Optimiser, TrainerState
from replicas.models.spec import PolishSpec, TrainSpec

NGRAM = 4


def repeated_ngram_share(tokens: list[int], n: int = NGRAM) -> float:
    """Share of the n-grams of `tokens` that already occurred earlier in `tokens` (0: none repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def repeated_ngram_mask(seqs: torch.Tensor, start: int, n: int = NGRAM) -> torch.Tensor:
    """[B, T] float: 1 on each token at position >= `start` of an n-gram that occurred earlier in its row."""
    mask = torch.zeros(seqs.shape, dtype=torch.float32)
    for b, row in enumerate(seqs.tolist()):
        seen: set[tuple[int, ...]] = set()
        for end in range(n, len(row) + 1):
            gram = tuple(row[end - n:end])
            if gram in seen and end > start:
                mask[b, max(end - n, start):end] = 1.0
            seen.add(gram)
    return mask


@torch.no_grad()
def greedy_continuations(model, prefixes: torch.Tensor, new_tokens: int, stop_at_end: bool = False) -> torch.Tensor:
    """[B, prefix + new_tokens]: the model's greedy continuation of each prefix; the end token stops it only with
    `stop_at_end` (as serving stops it; the rest of the row is then end tokens), else it is never chosen."""
    was_training = model.training
    model.eval()
    out = model.generate(
        input_ids=prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=new_tokens,
        min_new_tokens=0 if stop_at_end else new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id,
    )
    model.train(was_training)
    return out


def unlikelihood_loss(model, seqs: torch.Tensor, start: int) -> tuple[torch.Tensor, float]:
    """(-mean log(1 - p) over the tokens of repeated n-grams from `start` on, share of such tokens)."""
    mask = repeated_ngram_mask(seqs, start)[:, 1:]
    logits = model(input_ids=seqs).logits[:, :-1].float()
    p = torch.softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    loss = -(torch.log((1 - p).clamp_min(1e-5)) * mask).sum() / mask.sum().clamp_min(1.0)
    return loss, float(mask[:, start:].mean()) if mask.shape[1] > start else 0.0


def until_end(tokens: list[int], eos_id: int) -> list[int]:
    """`tokens` up to its first end token (where serving stops a greedy continuation)."""
    return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


def continuation_loop_share(continuations: list[list[int]], eos_id: int) -> float:
    """The share of repeated 4-grams over continuations cut at their end token, each weighted by its 4-grams, as
    `forespark models bench` counts them on the shipped prompts."""
    cut = [until_end(row, eos_id) for row in continuations]
    weights = [max(len(row) - NGRAM + 1, 0) for row in cut]
    return float(np.average([repeated_ngram_share(row) for row in cut], weights=weights)) if sum(weights) else 0.0


def loop_share(model, streams: TokenStreams, polish: PolishSpec, prompts: int = 16, seed: int = 8) -> dict[str, float]:
    """Per domain: the share of repeated 4-grams in the model's greedy continuations of held-out prefixes
    (`continuation_loop_share`)."""
    rng = np.random.default_rng(seed)
    out = {}
    for domain in streams.streams:
        prefixes = torch.from_numpy(streams.windows(domain, "held_out", polish.unlikelihood_prefix_len, prompts, rng))
        gen = greedy_continuations(model, prefixes, polish.unlikelihood_new_tokens, stop_at_end=True)
        gen = gen[:, polish.unlikelihood_prefix_len:]
        out[domain] = continuation_loop_share(gen.tolist(), model.config.eos_token_id)
    return out


class UnlikelihoodTrainer(TrainerState):
    """The polish stage's target training one step at a time, its whole state in `state_dict()`."""

    extra_lists = ("repeated",)

    def __init__(self, model, streams: TokenStreams, polish: PolishSpec, train: TrainSpec) -> None:
        self.model, self.streams, self.polish, self.train = model, streams, polish, train
        self.trained = model
        self.rng = np.random.default_rng([train.seed, 9])
        warmup = 10
        self.opt = Optimiser(model.parameters(), polish.unlikelihood_lr, 0.0, lambda s: min(1.0, (s + 1) / warmup))
        self.step = 0
        self.losses: list[float] = []
        self.repeated: list[float] = []  # share of continuation tokens in repeated 4-grams, per step
        model.train()

    @property
    def done(self) -> bool:
        return self.step >= self.polish.unlikelihood_steps

    def run_step(self) -> float:
        p, t = self.polish, self.train
        text = torch.from_numpy(self.streams.mixed_windows(t.seq_len, p.unlikelihood_mle_batch, t.code_share, self.rng))
        prefixes = torch.from_numpy(self.streams.mixed_windows(p.unlikelihood_prefix_len, p.unlikelihood_prefixes, t.code_share, self.rng))
        seqs = greedy_continuations(self.model, prefixes, p.unlikelihood_new_tokens)
        likelihood = self.model(input_ids=text, labels=text).loss
        ul, repeated = unlikelihood_loss(self.model, seqs, p.unlikelihood_prefix_len)
        self.losses.append(self.opt.step(likelihood + p.unlikelihood_weight * ul))
        self.repeated.append(repeated)
        self.step += 1
        return self.losses[-1]
