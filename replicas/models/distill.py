"""Train the DFlash drafter against the target.

Training text is the target's own greedy continuations of training-text
prompts: at serving time the drafter must guess what the target will say, and
the target's greedy token at each position is exactly what greedy verification
accepts. Loss per drafted position: cross-entropy on the target's token plus a
KL term towards the target's full distribution (what sampled verification
accepts). Blocks are anchored at random positions of the continuation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from replicas.models.data import TokenStreams
from replicas.models.dflash import DFlashDrafter, target_features
from replicas.models.optim import Optimiser
from replicas.models.spec import DrafterSpec, TrainSpec


@torch.no_grad()
def target_continuations(
    target, streams: TokenStreams, train: TrainSpec, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """[prompts, prompt_len + new_tokens] greedy continuations of code and prose training prompts."""
    rng = np.random.default_rng(train.seed + 1)
    half = int(round(train.distill_prompts * train.distill_code_share))
    prompts = np.concatenate(
        [
            streams.windows("code", "train", train.distill_prompt_len, half, rng),
            streams.windows("prose", "train", train.distill_prompt_len, train.distill_prompts - half, rng),
        ]
    )
    out = []
    for start in range(0, len(prompts), 64):
        batch = torch.from_numpy(prompts[start : start + 64])
        seqs = target.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=train.distill_new_tokens,
            min_new_tokens=train.distill_new_tokens,
            do_sample=False,
            pad_token_id=target.config.eos_token_id,
        )
        out.append(seqs)
        if progress:
            progress(len(batch))
    return torch.cat(out)


def train_drafter(
    drafter: DFlashDrafter,
    target,
    sequences: torch.Tensor,
    spec: DrafterSpec,
    train: TrainSpec,
    mask_token_id: int,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    torch.manual_seed(train.seed + 2)
    rng = np.random.default_rng(train.seed + 2)
    embed = target.get_input_embeddings().weight.detach()
    opt = Optimiser(
        drafter.parameters(),
        train.drafter_lr,
        0.01,
        lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / train.drafter_steps))),
    )
    t = sequences.shape[1]
    lo, hi = train.distill_prompt_len - 1, t - spec.block - 1
    offsets = torch.arange(1, spec.block + 1)
    drafter.train()
    losses = []
    for step in range(train.drafter_steps):
        rows = torch.from_numpy(rng.integers(0, len(sequences), train.drafter_batch))
        seqs = sequences[rows]
        with torch.no_grad():
            teacher_logits, aux = target_features(target, seqs, spec.target_layer_ids)
        anchors = torch.from_numpy(rng.integers(lo, hi + 1, (train.drafter_batch, train.drafter_anchors)))
        block = torch.full((*anchors.shape, spec.block + 1), mask_token_id, dtype=torch.long)
        block[..., 0] = torch.gather(seqs, 1, anchors)
        logits = drafter(aux, block, anchors, embed)  # [B, N, block, V]
        label_pos = anchors[..., None] + offsets  # slot j predicts x_{P+j}
        labels = torch.gather(seqs, 1, label_pos.flatten(1)).view_as(label_pos)
        teacher = torch.gather(
            teacher_logits, 1, (label_pos - 1).flatten(1)[..., None].expand(-1, -1, teacher_logits.shape[-1])
        ).view_as(logits)
        log_q = F.log_softmax(logits, dim=-1)
        ce = F.nll_loss(log_q.flatten(0, 2), labels.flatten())
        kl = F.kl_div(log_q, F.log_softmax(teacher, dim=-1), log_target=True, reduction="batchmean") / (
            anchors.shape[1] * spec.block
        )
        losses.append(opt.step(ce + train.kl_weight * kl))
        if progress:
            progress(step, losses[-1])
    drafter.eval()
    return losses


@torch.no_grad()
def offline_acceptance(
    drafter: DFlashDrafter, target, sequences: torch.Tensor, spec: DrafterSpec, mask_token_id: int, start: int, seed: int = 3
) -> np.ndarray:
    """Per-position greedy acceptance of the drafter against the target on its continuations, blocks
    anchored anywhere from `start` (the prompt's last token) on: P(drafts 1..j all match), j = 1..block."""
    rng = np.random.default_rng(seed)
    embed = target.get_input_embeddings().weight
    logits_t, aux = target_features(target, sequences, spec.target_layer_ids)
    greedy = logits_t.argmax(-1)  # greedy[P + j - 1] = target's token for position P + j
    t = sequences.shape[1]
    anchors = torch.from_numpy(rng.integers(start, t - spec.block - 1, (len(sequences), 16)))
    block = torch.full((*anchors.shape, spec.block + 1), mask_token_id, dtype=torch.long)
    block[..., 0] = torch.gather(sequences, 1, anchors)
    drafts = drafter(aux, block, anchors, embed).argmax(-1)
    want = torch.gather(greedy, 1, (anchors[..., None] + torch.arange(spec.block)).flatten(1)).view_as(drafts)
    survive = torch.cumprod((drafts == want).float(), dim=-1)
    return survive.mean(dim=(0, 1)).numpy()
