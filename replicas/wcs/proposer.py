"""Ragged DFlash drafting: request i drafts only d_i positions (docs/design/wcs-in-vllm.md section 2).

vLLM's DFlash proposer lays out a query block of 1 + K rows per request (the
newest token, then K mask tokens) and samples all K. Here the block is
compacted to 1 + d_i rows per request before the forward pass, so the
drafter's attention and MLP run on sum(1 + d_i) rows and its LM head on
sum(d_i) rows; positions past d_i come back as -1. With a causal drafter the
rows kept compute exactly what they compute in the full block.

A step in which no request drafts still stores the drafter's context K/V
for the tokens the target just accepted (later drafts attend to them) but
skips the drafter's forward pass and LM head: that saving is what lets a
step without drafts cost what a plain decoding step costs.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer


class RaggedDFlashProposer(DFlashProposer):
    """Installed over a live `DFlashProposer` by swapping `__class__`: it adds no `__init__` state."""

    widths: torch.Tensor | None = None  # (B,) draft widths for the next propose(); None = full block
    valid: torch.Tensor | None = None  # (B, K) bool: drafted positions of the last propose()
    confidence: torch.Tensor | None = None  # (B, K) max draft probability per drafted position, 0 elsewhere
    forward_rows: int = 0  # query rows the last propose() ran through the drafter (0: context K/V only)

    def propose(self, **kwargs) -> torch.Tensor:
        widths = self.widths
        if widths is None or bool(widths.any()):
            return super().propose(**kwargs)
        return self._store_context_only(**kwargs)

    def _store_context_only(self, *, target_hidden_states, common_attn_metadata, **kwargs) -> torch.Tensor:
        self.num_speculative_tokens = kwargs["num_speculative_tokens"]
        self._last_draft_probs = None
        hidden = self.model.combine_hidden_states(target_hidden_states)
        # Only the context buffers are read below: the parent's layout, without the ragged compaction.
        DFlashProposer.set_inputs_first_pass(
            self,
            target_token_ids=kwargs["target_token_ids"],
            next_token_ids=kwargs["next_token_ids"],
            target_positions=kwargs["target_positions"],
            target_hidden_states=hidden,
            token_indices_to_sample=kwargs["token_indices_to_sample"],
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=kwargs.get("num_rejected_tokens_gpu"),
        )
        self._store_context_kv(hidden)
        batch, k = common_attn_metadata.batch_size(), self.num_speculative_tokens
        self.confidence = torch.zeros(batch, k)
        self.forward_rows = 0
        return torch.full((batch, k), -1, dtype=torch.int64, device=hidden.device)

    def _store_context_kv(self, hidden: torch.Tensor) -> None:
        n = self._dflash_num_context
        self.model.precompute_and_store_context_kv(
            hidden, self._context_positions_buffer[:n], self._context_slot_mapping_buffer[:n]
        )

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
