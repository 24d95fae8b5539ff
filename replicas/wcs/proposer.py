"""Ragged DFlash drafting: request i drafts only d_i positions (docs/design/wcs-in-vllm.md section 2).

vLLM's DFlash proposer lays out a query block of 1 + K rows per request (the
newest token, then K mask tokens) and samples all K. Here the block is
compacted to 1 + d_i rows per request before the forward pass, so the
drafter's attention and MLP run on sum(1 + d_i) rows and its LM head on
sum(d_i) rows; positions past d_i come back as -1. With a causal drafter the
rows kept compute exactly what they compute in the full block. With a
non-causal one (every public DFlash checkpoint) they attend to the truncated
block only: still lossless (widths are chosen before drafting), and whether it
keeps acceptance is measured per pair by `forespark calibrate`, which serves
the pair with whole blocks when it does not (docs/design/wcs-in-vllm.md).

Later drafts attend to the drafter's context K/V of every token the target
computed. A step in which no request drafts does not run the drafter at all:
it keeps the target's hidden states, positions and slots of its tokens
(`defer_context`), and the next step that drafts stores them all in one
batched pass before drafting (`flush_context`). A step without drafts then
costs what a plain decoding step costs, but for copying its hidden states
into a preallocated row store (a clone per step instead, up to 128 steps
of them alive, made every held step 4-6% slower than an `ar` step at 64
requests on this CPU). A request that goes
MAX_DEFERRED_STEPS steps without a drafting step gives up its drafter context
(`context_lost`) and is not drafted for again.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token


# A request that goes this many steps without drafting drops its deferred context and drafts no more:
# storing it would cost what running the drafter every step costs, and holding it, memory.
MAX_DEFERRED_STEPS = 128


@dataclasses.dataclass
class _Deferred:
    """One draft-free step's context tokens."""

    hidden: torch.Tensor  # (n, H') target hidden states as the drafter takes them (before combine): a view of the row store
    positions: torch.Tensor  # (n,)
    slots: torch.Tensor  # (n,) KV-cache slots
    owners: np.ndarray  # (n,) the run of the request each token belongs to (`_Deferral.owner`)


@dataclasses.dataclass
class _Deferral:
    steps: list[_Deferred] = dataclasses.field(default_factory=list)
    lost: set[str] = dataclasses.field(default_factory=set)  # live requests without drafter context
    owners: dict[str, int] = dataclasses.field(default_factory=dict)  # request -> number of its current run
    dead: set[int] = dataclasses.field(default_factory=set)  # runs dropped since the last flush
    next_owner: int = 0
    rows: torch.Tensor | None = None  # the row store the deferred steps' hidden states are views of
    used: int = 0  # rows of it written since it was last emptied

    def keep(self, hidden: torch.Tensor) -> torch.Tensor:
        """A view of the row store holding a copy of `hidden` (the store grows, or is compacted, when full)."""
        n = hidden.shape[0]
        if self.rows is None or self.used + n > self.rows.shape[0]:
            self._make_room(hidden, n)
        view = self.rows[self.used : self.used + n]
        view.copy_(hidden)
        self.used += n
        return view

    def empty(self) -> None:
        self.steps.clear()
        self.used = 0

    def _make_room(self, hidden: torch.Tensor, n: int) -> None:
        """Move the live steps' rows to the front of a store with room for `n` more (twice what is needed, when the
        store must grow); rows of steps dropped since are reclaimed."""
        live = torch.cat([s.hidden for s in self.steps]) if self.steps else None
        need = (0 if live is None else live.shape[0]) + n
        if self.rows is None or 2 * need > self.rows.shape[0]:
            self.rows = torch.empty((max(2 * need, 1024), *hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
        start = 0
        for s in self.steps:
            m = s.hidden.shape[0]
            self.rows[start : start + m].copy_(live[start : start + m])
            s.hidden = self.rows[start : start + m]
            start += m
        self.used = start

    def owner(self, req_id: str) -> int:
        if req_id not in self.owners:
            self.owners[req_id] = self.next_owner
            self.next_owner += 1
        return self.owners[req_id]


class RaggedDFlashProposer(DFlashProposer):
    """Installed over a live `DFlashProposer` by swapping `__class__`: it adds no `__init__` state
    (the deferred-context store is created on first use)."""

    widths: torch.Tensor | None = None  # (B,) draft widths for the next propose(); None = full block
    valid: torch.Tensor | None = None  # (B, K) bool: drafted positions of the last propose()
    confidence: torch.Tensor | None = None  # (B, K) max draft probability per drafted position, 0 elsewhere
    forward_rows: int = 0  # query rows the last propose() ran through the drafter (0: context K/V only)

    @property
    def _deferral(self) -> "_Deferral":
        if "_wcs_deferral" not in self.__dict__:
            self._wcs_deferral = _Deferral()
        return self._wcs_deferral

    @property
    def pending_rows(self) -> int:
        """Deferred context rows the next drafting step stores first (what staying ready to draft costs)."""
        return sum(len(s.owners) for s in self._deferral.steps)

    @property
    def context_lost(self) -> set[str]:
        """Live requests whose drafter context is incomplete: they must not draft."""
        return self._deferral.lost

    def defer_context(
        self,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Keep this step's context tokens (request i owns rows query_start_loc[i]:[i+1]) for a later flush."""
        d = self._deferral
        n = int(query_start_loc[-1])
        owners = np.repeat(np.array([d.owner(r) for r in req_ids], dtype=np.int64), np.diff(query_start_loc[: len(req_ids) + 1]))
        d.steps.append(_Deferred(d.keep(hidden[:n]), positions[:n].clone(), slots[:n].clone(), owners))
        # Every step since the last flush is kept, so a request waits no longer than the oldest kept step.
        if len(d.steps) > MAX_DEFERRED_STEPS:
            # Whoever still owns tokens in the oldest step loses them, and with them its context.
            oldest = set(d.steps.pop(0).owners.tolist())
            d.lost.update(r for r, owner in d.owners.items() if owner in oldest)

    def drop_context(self, req_ids) -> None:
        """Finished or preempted requests: their deferred slots may belong to other requests by now
        (a preempted request recomputes its whole context when it resumes)."""
        d = self._deferral
        for r in req_ids:
            owner = d.owners.pop(r, None)
            if owner is not None:
                d.dead.add(owner)
            d.lost.discard(r)

    def flush_context(self) -> None:
        """Store every deferred context token's K/V (a later write of a slot wins over an earlier one),
        leaving out dropped requests and those without context."""
        d = self._deferral
        if not d.steps:
            return
        owners = np.concatenate([s.owners for s in d.steps])
        slots = torch.cat([s.slots for s in d.steps])
        flat = slots.cpu().numpy()
        _, last_from_end = np.unique(flat[::-1], return_index=True)
        keep = np.sort(len(flat) - 1 - last_from_end)
        excluded = d.dead | {d.owners[r] for r in d.lost if r in d.owners}
        if excluded:
            keep = keep[~np.isin(owners[keep], np.fromiter(excluded, dtype=np.int64))]
        rows = torch.from_numpy(keep).to(slots.device)
        hidden = self.model.combine_hidden_states(torch.cat([s.hidden for s in d.steps])[rows])
        self.model.precompute_and_store_context_kv(hidden, torch.cat([s.positions for s in d.steps])[rows], slots[rows])
        d.empty()
        d.dead.clear()

    def set_inputs_first_pass(self, *args, **kwargs) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        n_full, sample_rows, cad = super().set_inputs_first_pass(*args, **kwargs)
        k = self.num_speculative_tokens
        batch = cad.num_reqs
        widths = self.widths
        if widths is None or k == 0:
            self.valid = None
            self.forward_rows = n_full
            return n_full, sample_rows, cad
        d = widths.to(torch.int64).clamp(0, k)
        query_len = 1 + d
        per_req = 1 + k
        keep = (torch.arange(per_req)[None, :] < query_len[:, None]).flatten()
        rows = keep.nonzero()[:, 0]
        n = int(rows.numel())
        self.forward_rows = n
        # Right-hand gathers copy before the in-place writes.
        self.input_ids[:n] = self.input_ids[: batch * per_req][rows]
        self.positions[:n] = self.positions[: batch * per_req][rows]
        self._slot_mapping_buffer[:n] = self._slot_mapping_buffer[: batch * per_req][rows]
        start = torch.zeros(batch + 1, dtype=torch.int32)
        start[1:] = torch.cumsum(query_len, 0)
        cad = dataclasses.replace(
            cad,
            query_start_loc=start.to(cad.query_start_loc.device),
            query_start_loc_cpu=start,
            seq_lens=(cad.seq_lens - per_req + query_len.to(cad.seq_lens.device)).to(cad.seq_lens.dtype),
            num_actual_tokens=n,
            max_query_len=int(query_len.max()),
            slot_mapping=self._slot_mapping_buffer[:n],
        )
        j = torch.arange(k)
        self.valid = j[None, :] < d[:, None]
        # Rows past d_i point at the request's first row; their samples are discarded.
        first = start[:-1, None].to(torch.int64)
        sample_rows = torch.where(self.valid, first + 1 + j[None, :], first).flatten().to(torch.int32)
        return n, sample_rows.to(self.input_ids.device), cad

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted positions' tokens, -1 elsewhere: the drafter's argmax, or under vLLM's
        `draft_sample_method: probabilistic` (sampled requests) a sample from the drafter with its
        probabilities (zero rows elsewhere), which vLLM's ratio test then uses."""
        if self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            raise RuntimeError("ragged drafting supports the plain LM head only")
        k = self.num_speculative_tokens
        batch = hidden_states.shape[0] // k
        valid = self.valid if self.valid is not None else torch.ones(batch, k, dtype=torch.bool)
        flat = valid.flatten().to(hidden_states.device)
        logits = self.model.compute_logits(hidden_states[flat]).float()
        ids = torch.full((batch * k,), -1, dtype=torch.int64, device=hidden_states.device)
        conf = torch.zeros(batch * k, dtype=torch.float32, device=hidden_states.device)
        probs = None
        if logits.shape[0]:
            top = logits.softmax(-1).max(-1)
            # The drafter's own distribution, never a sampled draft: a verify length chosen from it stays
            # lossless when drafts are sampled (docs/design/wcs-in-vllm.md).
            conf[flat] = top.values
            ids[flat] = top.indices
            if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy:
                rows = valid.nonzero()[:, 0].to(sampling_metadata.temperature.device)  # each drafted row's request
                meta = dataclasses.replace(sampling_metadata, temperature=sampling_metadata.temperature[rows])
                sampled, row_probs = compute_probs_and_sample_next_token(logits, meta, self.use_fp64_gumbel)
                ids[flat] = sampled
                probs = torch.zeros(batch * k, logits.shape[-1], dtype=row_probs.dtype, device=hidden_states.device)
                probs[flat] = row_probs
        self.confidence = conf.view(batch, k).cpu()
        # Argmax drafts have probability one on the drafted token: rejection sampling stays exact.
        return ids, probs
