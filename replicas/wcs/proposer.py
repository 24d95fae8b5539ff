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
costs what a plain decoding step costs, but for copying its hidden states,
positions and slots into preallocated ring buffers (a clone per step instead,
up to 128 steps of them alive, made every held step 4-6% slower than an `ar`
step at 64 requests on this CPU). A request that goes
MAX_DEFERRED_STEPS steps without a drafting step gives up its drafter context
(`context_lost`) and is not drafted for again.
"""

from __future__ import annotations

import collections
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
class _Deferral:
    """The deferred steps' rows, oldest first, in ring buffers (hidden states, positions, slots, runs): a held step
    copies its rows in, letting the oldest step go moves nothing, and only a full ring is copied (into one twice its
    size). Before the ring, a full store moved its live rows to its front: held past 128 steps at 64 and 128 requests,
    a step's keeping took 0.28 and 0.55 ms on average with those moves, 0.12 and 0.21 ms in the ring (this CPU)."""

    steps: collections.deque = dataclasses.field(default_factory=collections.deque)  # (rows, runs) of each kept step, oldest first
    lost: set[str] = dataclasses.field(default_factory=set)  # live requests without drafter context
    owners: dict[str, int] = dataclasses.field(default_factory=dict)  # request -> number of its current run
    runs: dict[int, str] = dataclasses.field(default_factory=dict)  # live run -> its request
    dead: set[int] = dataclasses.field(default_factory=set)  # runs dropped since the last flush
    next_owner: int = 0
    hidden: torch.Tensor | None = None  # (capacity, H') target hidden states as the drafter takes them (before combine)
    positions: torch.Tensor | None = None  # (capacity,)
    slots: torch.Tensor | None = None  # (capacity,) KV-cache slots
    run_of: np.ndarray | None = None  # (capacity,) the run each row belongs to (`owner`)
    head: int = 0  # ring index of the oldest kept row
    size: int = 0  # rows kept
    batch: tuple[list[str], np.ndarray] | None = None  # the last step's requests and their runs (`runs_of`)
    let_go: np.ndarray | None = None  # the runs of the step let go last (`let_go_oldest`)

    @property
    def capacity(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[0]

    def keep(self, parts: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor, runs: np.ndarray) -> None:
        """Copy one step's rows in; `parts` are its hidden states split along the last dimension (as the target's
        layers hand them over), laid side by side here."""
        n = positions.shape[0]
        if self.size + n > self.capacity:
            self._grow(parts, positions, slots, self.size + n)
        start = (self.head + self.size) % self.capacity
        first = min(n, self.capacity - start)  # rows before the ring's end; the rest wrap to its front
        self._write(start, parts, positions, slots, runs, slice(0, first))
        if first < n:
            self._write(0, parts, positions, slots, runs, slice(first, n))
        self.size += n
        self.steps.append((n, runs))

    def _write(self, at: int, parts: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor, runs: np.ndarray,
               rows: slice) -> None:
        if rows.start or rows.stop < positions.shape[0]:
            parts, positions, slots, runs = [p[rows] for p in parts], positions[rows], slots[rows], runs[rows]
        end = at + positions.shape[0]
        torch.cat(parts, dim=-1, out=self.hidden[at:end])  # (one call per step: a held step's cost is mostly calls)
        self.positions[at:end] = positions
        self.slots[at:end] = slots
        self.run_of[at:end] = runs

    def let_go_oldest(self) -> np.ndarray:
        """Drop the oldest kept step; returns the runs that owned its rows, or none when they are those of the step let
        go before it (a batch that ran on unchanged hands `keep` the same array each step: those runs were answered)."""
        n, runs = self.steps.popleft()
        self.head = (self.head + n) % self.capacity
        self.size -= n
        if runs is self.let_go:
            return runs[:0]
        self.let_go = runs
        return runs

    def kept(self, n: int | None = None) -> np.ndarray:
        """Ring indices of the oldest `n` kept rows (all of them by default), oldest first."""
        return (self.head + np.arange(self.size if n is None else n)) % max(self.capacity, 1)

    def empty(self) -> None:
        self.steps.clear()
        self.let_go = None
        self.head = self.size = 0

    def _grow(self, parts: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor, need: int) -> None:
        capacity = max(2 * need, 1024)
        like = parts[0]
        # Zeroed, not empty: the pages are touched once here, not one step's rows at a time (first writes into
        # fresh pages made a step's copy 3x slower at 64 requests on this CPU).
        hidden = torch.zeros((capacity, sum(p.shape[-1] for p in parts)), dtype=like.dtype, device=like.device)
        pos = torch.zeros(capacity, dtype=positions.dtype, device=positions.device)
        slot = torch.zeros(capacity, dtype=slots.dtype, device=slots.device)
        run_of = np.zeros(capacity, dtype=np.int64)
        if self.size:
            idx = self.kept()
            at = torch.from_numpy(idx)
            hidden[: self.size] = self.hidden[at.to(like.device)]
            pos[: self.size] = self.positions[at.to(positions.device)]
            slot[: self.size] = self.slots[at.to(slots.device)]
            run_of[: self.size] = self.run_of[idx]
        self.hidden, self.positions, self.slots, self.run_of, self.head = hidden, pos, slot, run_of, 0

    def runs_of(self, req_ids: list[str]) -> np.ndarray:
        """Each request's current run; consecutive steps of one batch reuse the last answer."""
        if self.batch is None or self.batch[0] != req_ids:
            self.batch = (list(req_ids), np.fromiter((self.owner(r) for r in req_ids), dtype=np.int64, count=len(req_ids)))
        return self.batch[1]

    def owner(self, req_id: str) -> int:
        if req_id not in self.owners:
            self.owners[req_id] = self.next_owner
            self.runs[self.next_owner] = req_id
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
        return self._deferral.size

    @property
    def context_lost(self) -> set[str]:
        """Live requests whose drafter context is incomplete: they must not draft."""
        return self._deferral.lost

    def defer_context(
        self,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        hidden: torch.Tensor | list[torch.Tensor],
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Keep this step's context tokens (request i owns rows query_start_loc[i]:[i+1]) for a later flush;
        `hidden` may come as the target layers' parts, which the drafter takes side by side."""
        d = self._deferral
        n = int(query_start_loc[-1])
        runs = d.runs_of(req_ids)
        if n != len(runs):  # (a decoding step has one row per request)
            runs = np.repeat(runs, np.diff(query_start_loc[: len(req_ids) + 1]))
        parts = [hidden[:n]] if torch.is_tensor(hidden) else [h[:n] for h in hidden]
        d.keep(parts, positions[:n], slots[:n], runs)
        # Every step since the last flush is kept, so a request waits no longer than the oldest kept step.
        if len(d.steps) > MAX_DEFERRED_STEPS:
            # Whoever still owns tokens in the oldest step loses them, and with them its context.
            d.lost.update(d.runs[run] for run in d.let_go_oldest().tolist() if run in d.runs)

    def drop_context(self, req_ids) -> None:
        """Finished or preempted requests: their deferred slots may belong to other requests by now
        (a preempted request recomputes its whole context when it resumes)."""
        d = self._deferral
        for r in req_ids:
            owner = d.owners.pop(r, None)
            if owner is not None:
                d.dead.add(owner)
                del d.runs[owner]
                d.batch = None
            d.lost.discard(r)

    def flush_context(self) -> None:
        """Store every deferred context token's K/V (a later write of a slot wins over an earlier one),
        leaving out dropped requests and those without context."""
        d = self._deferral
        if not d.size:
            return
        idx = d.kept()
        at = torch.from_numpy(idx).to(d.slots.device)
        owners = d.run_of[idx]
        slots = d.slots[at]
        flat = slots.cpu().numpy()
        _, last_from_end = np.unique(flat[::-1], return_index=True)
        keep = np.sort(len(flat) - 1 - last_from_end)
        excluded = d.dead | {d.owners[r] for r in d.lost if r in d.owners}
        if excluded:
            keep = keep[~np.isin(owners[keep], np.fromiter(excluded, dtype=np.int64))]
        rows = at[torch.from_numpy(keep).to(at.device)]
        hidden = self.model.combine_hidden_states(d.hidden[rows.to(d.hidden.device)])
        self.model.precompute_and_store_context_kv(hidden, d.positions[rows.to(d.positions.device)], d.slots[rows])
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
