"""Ragged DFlash drafting: request i drafts only d_i positions (docs/design/wcs-in-vllm.md section 2).

vLLM's DFlash proposer lays out a query block of 1 + K rows per request (the
newest token, then K mask tokens) and samples all K. Here the block is
compacted to 1 + d_i rows per request before the forward pass, so the
drafter's attention and MLP run on sum(1 + d_i) rows and its LM head on
sum(d_i) rows; positions past d_i come back as -1. With a causal drafter the
rows kept compute exactly what they compute in the full block.

Later drafts attend to the drafter's context K/V of every token the target
computed. A step in which no request drafts does not run the drafter at all:
it keeps the target's hidden states, positions and slots of its tokens
(`defer_context`), and the next step that drafts stores them all in one
batched pass before drafting (`flush_context`). A step without drafts then
costs what a plain decoding step costs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer


# Deferred context tokens beyond which they are stored at once (bounds the memory they hold).
MAX_DEFERRED_TOKENS = 8192


@dataclasses.dataclass
class _Deferred:
    hidden: torch.Tensor  # (n, H') target hidden states as the drafter takes them (before combine)
    positions: torch.Tensor  # (n,)
    slots: torch.Tensor  # (n,) KV-cache slots


class RaggedDFlashProposer(DFlashProposer):
    """Installed over a live `DFlashProposer` by swapping `__class__`: it adds no `__init__` state
    (the deferred-context store is created on first use)."""

    widths: torch.Tensor | None = None  # (B,) draft widths for the next propose(); None = full block
    valid: torch.Tensor | None = None  # (B, K) bool: drafted positions of the last propose()
    confidence: torch.Tensor | None = None  # (B, K) max draft probability per drafted position, 0 elsewhere
    forward_rows: int = 0  # query rows the last propose() ran through the drafter (0: context K/V only)

    @property
    def _deferred(self) -> dict[str, list[_Deferred]]:
        if "_wcs_deferred" not in self.__dict__:
            self._wcs_deferred: dict[str, list[_Deferred]] = {}
        return self._wcs_deferred

    def defer_context(
        self,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Keep this step's context tokens (request i owns rows query_start_loc[i]:[i+1]) for a later flush."""
        n = int(query_start_loc[-1])
        hidden, positions, slots = hidden[:n].clone(), positions[:n].clone(), slots[:n].clone()
        for i, r in enumerate(req_ids):
            a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
            if b > a:
                self._deferred.setdefault(r, []).append(_Deferred(hidden[a:b], positions[a:b], slots[a:b]))
        self._deferred_tokens = getattr(self, "_deferred_tokens", 0) + n
        if self._deferred_tokens > MAX_DEFERRED_TOKENS:
            self.flush_context()

    def drop_context(self, req_ids) -> None:
        """Finished or preempted requests: their slots may belong to other requests by now."""
        for r in req_ids:
            self._deferred.pop(r, None)

    def flush_context(self) -> None:
        """Store every deferred context token's K/V (a later write of a slot wins over an earlier one)."""
        if not self._deferred:
            return
        parts = [p for chunks in self._deferred.values() for p in chunks]
        self._deferred.clear()
        self._deferred_tokens = 0
        slots = torch.cat([p.slots for p in parts])
        flat = slots.cpu().numpy()
        _, last_from_end = np.unique(flat[::-1], return_index=True)
        keep = torch.from_numpy(np.sort(len(flat) - 1 - last_from_end)).to(slots.device)
        hidden = self.model.combine_hidden_states(torch.cat([p.hidden for p in parts])[keep])
        self.model.precompute_and_store_context_kv(hidden, torch.cat([p.positions for p in parts])[keep], slots[keep])

    def set_inputs_first_pass(self, *args, **kwargs) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        n_full, sample_rows, cad = super().set_inputs_first_pass(*args, **kwargs)
        k = self.num_speculative_tokens
        batch = cad.num_reqs
        widths = self.widths
        if widths is None or k == 0:
            self.valid = None
            self.forward_rows = n_full
            return n_full, sample_rows, cad
        if not self.dflash_causal:
            raise RuntimeError("ragged draft widths need a causal DFlash drafter")
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

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata) -> tuple[torch.Tensor, None]:
        if self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            raise RuntimeError("ragged drafting supports the plain LM head only")
        k = self.num_speculative_tokens
        batch = hidden_states.shape[0] // k
        valid = self.valid if self.valid is not None else torch.ones(batch, k, dtype=torch.bool)
        flat = valid.flatten().to(hidden_states.device)
        logits = self.model.compute_logits(hidden_states[flat])
        ids = torch.full((batch * k,), -1, dtype=torch.int64, device=hidden_states.device)
        conf = torch.zeros(batch * k, dtype=torch.float32, device=hidden_states.device)
        if logits.shape[0]:
            top = logits.float().softmax(-1).max(-1)
            ids[flat] = top.indices
            conf[flat] = top.values
        self.confidence = conf.view(batch, k).cpu()
        # Greedy drafts (probability one on the drafted token): rejection sampling stays exact.
        return ids, None
