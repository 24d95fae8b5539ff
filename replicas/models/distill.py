"""Train the DFlash drafter against the target.

Training text is the target's own continuations of training-text prompts: at
serving time the drafter must guess what the target will say. Greedy
continuations hold the target's argmax at each position (what greedy
verification accepts); with `distill_sampled_share` > 0 that share of the
continuations are the target's samples at `distill_temperature` (1 by default),
so the drafter also sees the text the target produces when it samples, as it
does at serving time at T=1. Loss per drafted position: cross-entropy on the
target's token (greedy or sampled) plus a KL term towards the target's full
distribution at that position (what sampled verification accepts). Blocks are
anchored at random positions of the continuation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from replicas.models.data import TokenStreams
from replicas.models.dflash import DFlashDrafter, target_features
from replicas.models.optim import Optimiser, TrainerState
from replicas.models.spec import DrafterSpec, TrainSpec


def continuation_plan(streams: TokenStreams, train: TrainSpec) -> tuple[np.ndarray, np.ndarray]:
    """(prompts [n, prompt_len], sampled [n] bool): the training prompts, greedy ones first, and which
    of them the target continues by sampling. Without sampling this is the shipped build's plan."""
    rng = np.random.default_rng(train.seed + 1)
    half = _code_prompts(train)
    prompts = np.concatenate(
        [
            streams.windows("code", "train", train.distill_prompt_len, half, rng),
            streams.windows("prose", "train", train.distill_prompt_len, train.distill_prompts - half, rng),
        ]
    )
    return _greedy_first(prompts, train)


def continuation_is_code(train: TrainSpec) -> np.ndarray:
    """(n,) bool: which of `continuation_plan`'s prompts, in its order, are code."""
    return _greedy_first(np.arange(train.distill_prompts) < _code_prompts(train), train)[0]


def _code_prompts(train: TrainSpec) -> int:
    return int(round(train.distill_prompts * train.distill_code_share))


def _greedy_first(rows: np.ndarray, train: TrainSpec) -> tuple[np.ndarray, np.ndarray]:
    """(rows reordered, sampled): `distill_sampled_share` of the rows, drawn at random, move to the end, to be sampled."""
    n_sampled = int(round(len(rows) * train.distill_sampled_share))
    sampled = np.zeros(len(rows), dtype=bool)
    if n_sampled:
        sampled[np.random.default_rng(train.seed + 6).permutation(len(rows))[:n_sampled]] = True
        rows = np.concatenate([rows[~sampled], rows[sampled]])
        sampled = np.arange(len(rows)) >= len(rows) - n_sampled
    return rows, sampled


def continuation_batches(prompts: np.ndarray, sampled: np.ndarray, batch: int) -> list[tuple[int, int, bool]]:
    """(start, stop, sampled) of each generate() call; a batch never mixes greedy and sampled prompts."""
    out = []
    for flag in (False, True):
        idx = np.flatnonzero(sampled == flag)
        for i in range(0, len(idx), batch):
            out.append((int(idx[i]), int(idx[min(i + batch, len(idx)) - 1]) + 1, flag))
    return out


@torch.no_grad()
def continue_batch(target, prompts: torch.Tensor, train: TrainSpec, sample: bool, seed: int) -> torch.Tensor:
    """The target's continuation of `prompts`: greedy, or sampled from its full distribution at
    `distill_temperature` (no top-k / top-p), seeded by `seed` without touching the global RNG."""
    kwargs = dict(do_sample=False)
    if sample:
        kwargs = dict(do_sample=True, temperature=train.distill_temperature, top_k=0, top_p=1.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return target.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=train.distill_new_tokens,
            min_new_tokens=train.distill_new_tokens,
            pad_token_id=target.config.eos_token_id,
            **kwargs,
        )


@torch.no_grad()
def target_continuations(
    target, streams: TokenStreams, train: TrainSpec, progress: Callable[[int], None] | None = None,
    done: dict[int, torch.Tensor] | None = None, on_batch: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences [prompts, prompt_len + new_tokens], sampled [prompts] bool): the target's continuations
    of code and prose training prompts. `done` holds batches already generated (by batch index, from a
    checkpoint); `on_batch` is told of each new one."""
    prompts, sampled = continuation_plan(streams, train)
    done = dict(done or {})
    for b, (start, stop, sample) in enumerate(continuation_batches(prompts, sampled, train.distill_gen_batch)):
        if b not in done:
            batch = torch.from_numpy(prompts[start:stop])
            done[b] = continue_batch(target, batch, train, sample, seed=train.seed + 1000 + b)
            if on_batch:
                on_batch(b, done[b])
        if progress:
            progress(stop - start)
    return torch.cat([done[b] for b in sorted(done)]), torch.from_numpy(sampled)


def drafter_cycle(train: TrainSpec, step: int) -> tuple[int, int, int]:
    """(index, first step, end) of the schedule cycle holding `step`; one cycle unless `drafter_restarts`."""
    bounds = [0, *train.drafter_restarts, train.drafter_steps]
    i = max(k for k in range(len(bounds) - 1) if bounds[k] <= step) if step < train.drafter_steps else len(bounds) - 2
    return i, bounds[i], bounds[i + 1]


def drafter_lr_factor(train: TrainSpec) -> Callable[[int], float]:
    """A 20-step warm-up, then a cosine to 0.1, within each cycle (see `drafter_cycle`)."""
    def factor(s: int) -> float:
        _, first, end = drafter_cycle(train, s)
        local = s - first
        return min(1.0, (local + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * local / (end - first))))

    return factor


class DrafterTrainer(TrainerState):
    """The drafter's training loop one step at a time, its whole state in `state_dict()` (see TargetTrainer)."""

    def __init__(
        self, drafter: DFlashDrafter, target, sequences: torch.Tensor, spec: DrafterSpec, train: TrainSpec, mask_token_id: int,
        streams: TokenStreams | None = None,
    ) -> None:
        torch.manual_seed(train.seed + 2)
        if train.drafter_corpus_share > 0 and streams is None:
            raise ValueError("train.drafter_corpus_share needs the training text's token streams")
        self.drafter, self.target, self.sequences, self.streams = drafter, target, sequences, streams
        self.trained = drafter
        self.spec, self.train, self.mask_token_id = spec, train, mask_token_id
        self.rng = np.random.default_rng(train.seed + 2)
        self.embed = target.get_input_embeddings().weight.detach()
        self.opt = Optimiser(drafter.parameters(), train.drafter_lr, 0.01, drafter_lr_factor(train))
        t = sequences.shape[1]
        self.lo, self.hi = train.distill_prompt_len - 1, t - spec.block - 1
        self.offsets = torch.arange(1, spec.block + 1)
        is_code = continuation_is_code(train)
        self.by_domain = (np.flatnonzero(is_code), np.flatnonzero(~is_code)) if len(is_code) == len(sequences) else None
        if any(s is not None for s in train.drafter_cycle_code_shares) and self.by_domain is None:
            raise ValueError("train.drafter_cycle_code_shares needs the continuations of this spec's plan")
        self.step = 0
        self.losses: list[float] = []
        drafter.train()

    @property
    def done(self) -> bool:
        return self.step >= self.train.drafter_steps

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequences [B, T], anchors [B, N]): continuations, then `drafter_corpus_share` of training-text windows."""
        train = self.train
        n_text = int(round(train.drafter_batch * train.drafter_corpus_share))
        n_cont = train.drafter_batch - n_text
        share = train.drafter_code_share(drafter_cycle(train, self.step)[0])
        rows = torch.from_numpy(self._rows(n_cont, share))
        anchors = self.rng.integers(self.lo, self.hi + 1, (n_cont, train.drafter_anchors))
        if not n_text:
            return self.sequences[rows], torch.from_numpy(anchors)
        text_share = train.distill_code_share if share is None else share
        text = torch.from_numpy(self.streams.mixed_windows(self.sequences.shape[1], n_text, text_share, self.rng))
        lo = min(train.drafter_corpus_min_context, self.hi)
        text_anchors = self.rng.integers(lo, self.hi + 1, (n_text, train.drafter_anchors))
        return torch.cat([self.sequences[rows], text]), torch.from_numpy(np.concatenate([anchors, text_anchors]))

    def _rows(self, n: int, code_share: float | None) -> np.ndarray:
        """`n` continuations: uniformly, or that share of them code (`drafter_cycle_code_shares`)."""
        if code_share is None:
            return self.rng.integers(0, len(self.sequences), n)
        code, prose = self.by_domain
        n_code = int(self.rng.binomial(n, code_share)) if len(code) and len(prose) else (n if len(code) else 0)
        return np.concatenate([self.rng.choice(code, n_code), self.rng.choice(prose, n - n_code)])

    def restart(self) -> None:
        """A warm restart: AdamW's moments and the data order start afresh (a continued run matches a fresh one)."""
        self.opt.opt.state.clear()
        cycle, _, _ = drafter_cycle(self.train, self.step)
        self.rng = np.random.default_rng([self.train.seed + 2, cycle])

    def run_step(self) -> float:
        spec, train = self.spec, self.train
        if self.step in train.drafter_restarts:
            self.restart()
        seqs, anchors = self.batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=train.bf16_autocast):
            with torch.no_grad():
                teacher_logits, aux = target_features(self.target, seqs, spec.target_layer_ids)
            loss = distill_loss(
                self.drafter, seqs, teacher_logits.float(), aux, anchors, self.embed, spec, self.mask_token_id,
                train.drafter_kl_weight(drafter_cycle(train, self.step)[0]),
                labels=train.drafter_labels, position_decay=train.drafter_position_decay,
            )
        self.losses.append(self.opt.step(loss))
        self.step += 1
        return self.losses[-1]

    def continue_finished(self, weights: dict, step: int, losses: list[float]) -> None:
        """Train on a finished drafter (its weights only) from `step`, a restart of this trainer's schedule."""
        if step not in self.train.drafter_restarts:
            raise ValueError(f"a finished drafter continues only from a restart (train.drafter_restarts holds no {step})")
        self.drafter.load_state_dict(weights)
        self.step, self.losses = step, list(losses)
        sched = self.opt.sched
        sched.last_epoch = step
        sched._last_lr = [base * sched.lr_lambdas[0](step) for base in sched.base_lrs]
        for group, lr in zip(self.opt.opt.param_groups, sched._last_lr):
            group["lr"] = lr


def distill_loss(
    drafter: DFlashDrafter, seqs: torch.Tensor, teacher_logits: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
    embed: torch.Tensor, spec: DrafterSpec, mask_token_id: int, kl_weight: float,
    labels: str = "sequence", position_decay: float = 0.0,
) -> torch.Tensor:
    """CE on the sequence's tokens (`labels="sequence"`: the target's greedy or sampled ones) or on the target's
    greedy draft (`"target_argmax"`: its argmax, where the text since the anchor is its greedy chain), +
    kl_weight x KL(target || drafter), per drafted position of blocks anchored at `anchors`; block position j
    weighs exp(-(j-1)/position_decay) (uniform at 0)."""
    offsets = torch.arange(1, spec.block + 1)
    block = torch.full((*anchors.shape, spec.block + 1), mask_token_id, dtype=torch.long)
    block[..., 0] = torch.gather(seqs, 1, anchors)
    logits = drafter(aux, block, anchors, embed)  # [B, N, block, V]
    label_pos = anchors[..., None] + offsets  # slot j predicts x_{P+j}
    teacher = torch.gather(
        teacher_logits, 1, (label_pos - 1).flatten(1)[..., None].expand(-1, -1, teacher_logits.shape[-1])
    ).view_as(logits)
    text = torch.gather(seqs, 1, label_pos.flatten(1)).view_as(label_pos)
    weights = torch.ones(spec.block) if position_decay <= 0 else torch.exp(-(offsets - 1).float() / position_decay)
    weights = (weights / weights.mean()).expand_as(label_pos)
    if labels == "target_argmax":
        want = teacher.argmax(-1)
        # The target's argmax at slot j is the greedy draft only where the text between the anchor and that
        # slot is the greedy one too (always in a greedy continuation; in sampled or training text, until
        # the first token the target would not have chosen): later slots there have no label.
        on_chain = torch.cumprod((text == want).float(), dim=-1)
        weights = weights * torch.cat([torch.ones_like(on_chain[..., :1]), on_chain[..., :-1]], dim=-1)
    elif labels == "sequence":
        want = text
    else:
        raise ValueError(f"unknown drafter labels {labels!r}")
    log_q = F.log_softmax(logits.float(), dim=-1)
    ce = -torch.gather(log_q, -1, want[..., None]).squeeze(-1)  # [B, N, block]
    log_p = F.log_softmax(teacher, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    total = weights.sum().clamp_min(1e-9)
    return (ce * weights).sum() / total + kl_weight * (kl * weights).sum() / total


def train_drafter(
    drafter: DFlashDrafter,
    target,
    sequences: torch.Tensor,
    spec: DrafterSpec,
    train: TrainSpec,
    mask_token_id: int,
    progress: Callable[[int, float], None] | None = None,
    streams: TokenStreams | None = None,
) -> list[float]:
    trainer = DrafterTrainer(drafter, target, sequences, spec, train, mask_token_id, streams)
    while not trainer.done:
        loss = trainer.run_step()
        if progress:
            progress(trainer.step - 1, loss)
    drafter.eval()
    return trainer.losses


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


@torch.no_grad()
def offline_acceptance_sampled(
    drafter: DFlashDrafter, target, sequences: torch.Tensor, spec: DrafterSpec, mask_token_id: int, start: int,
    anchors_per_sequence: int = 4, temperature: float = 1.0, seed: int = 4,
) -> np.ndarray:
    """Per-position acceptance at `temperature` as vLLM verifies greedy drafts (its drafts carry no
    probabilities, so draft d_j is accepted with the target's probability of it): with blocks anchored
    in the target's own sampled text, E[prod_{i<=j} p(d_i | prefix, d_1..d_{i-1})], j = 1..block, exactly,
    from one target pass over each prefix followed by its drafts."""
    rng = np.random.default_rng(seed)
    embed = target.get_input_embeddings().weight
    _, aux = target_features(target, sequences, spec.target_layer_ids)
    n, t = sequences.shape
    k = spec.block
    anchors = torch.from_numpy(rng.integers(start, t - k - 1, (n, anchors_per_sequence)))
    block = torch.full((*anchors.shape, k + 1), mask_token_id, dtype=torch.long)
    block[..., 0] = torch.gather(sequences, 1, anchors)
    drafts = drafter(aux, block, anchors, embed).argmax(-1)  # [n, A, k]
    # Rows: the prefix x_0..x_P then the drafts (causal attention: what follows a position never changes it).
    width = int(anchors.max()) + 1 + k
    rows = torch.zeros((n * anchors_per_sequence, width), dtype=torch.long)
    flat_anchors = anchors.flatten()
    for r, (i, p) in enumerate(zip(torch.arange(n).repeat_interleave(anchors_per_sequence).tolist(), flat_anchors.tolist())):
        rows[r, : p + 1] = sequences[i, : p + 1]
        rows[r, p + 1 : p + 1 + k] = drafts.flatten(0, 1)[r]
    probs = []
    for s in range(0, len(rows), 16):
        logits = target(input_ids=rows[s : s + 16]).logits  # logits[P + j - 1] give p(d_j)
        pos = flat_anchors[s : s + 16, None] + torch.arange(k)
        lp = torch.log_softmax(torch.gather(logits, 1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature, -1)
        probs.append(torch.gather(lp, 2, drafts.flatten(0, 1)[s : s + 16, :, None]).squeeze(-1).exp())
    survive = torch.cumprod(torch.cat(probs), dim=-1)
    return survive.mean(dim=0).numpy()
