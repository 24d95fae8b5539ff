"""ForeSpark's vLLM general plugin (entry point `vllm.general_plugins`: `forespark`).

vLLM loads it in every engine process before models are built. On the CPU
build it mends two things the DFlash drafter needs, without touching vLLM's
files:

1. The CPU linear method packs each weight for oneDNN and empties
   `layer.weight`; DFlash projects context K/V straight from
   `qkv_proj.weight`. When the drafter builds that projection lazily (any load
   path that does not run its `load_weights`, e.g. `load_format="dummy"`) it
   finds an empty weight and fails. We mark the drafter's `qkv_proj` to keep
   its weight (`_cpu_skip_gemm_dispatch`, the flag vLLM's MLA uses for the
   same reason).
2. DFlash normalises the context keys of all draft layers in one grouped
   `rms_norm` call that expects a per-layer weight; the CPU kernel applies
   layer 0's weight to every layer, so layers >= 1 see wrongly scaled keys.
   We normalise per layer in plain torch.
3. The rejection sampler spreads per-request temperature / top-k / top-p over
   draft tokens with `expand_batch_to_tokens`, whose CPU kernel casts its
   float output and input to int64 copies: the float result is never written
   and temperatures are truncated, so every sampled (temperature > 0)
   verification uses garbage probabilities and almost nothing is accepted.
   We expand in plain torch.
4. When a chunked prefill's sampled token is discarded, the runner rewinds
   that request's seeded generator with `set_offset`, which CPU generators do
   not have: any request with a `seed` crashed the engine as soon as its
   prefill was chunked. We restore the generator's state from before sampling
   instead (the same rewind).
5. A spec-decode step in which no request has draft tokens (WCS chose width
   0 for all of them, or every request is still in prefill) still runs the
   rejection sampler's top-k/top-p masking over zero token rows; the CPU
   top-k-only path takes `k.max()` of that empty tensor and raises, which
   killed the engine for any request with `top_k` set. Masking no rows
   returns them as they are.

All five are no-ops off the CPU.
"""

from __future__ import annotations

_applied = False
ORIGINALS: dict[str, object] = {}  # what the plugin replaced, for tests that show the fix matters


def _keep_qkv_weight(module) -> None:
    init = ORIGINALS.setdefault("DFlashQwen3Attention.__init__", module.DFlashQwen3Attention.__init__)

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.qkv_proj._cpu_skip_gemm_dispatch = True

    module.DFlashQwen3Attention.__init__ = __init__


def _normalize_context_k_per_layer(module) -> None:
    import torch

    ORIGINALS.setdefault("DFlashQwen3Model._normalize_context_k", module.DFlashQwen3Model._normalize_context_k)

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:  # all_k: [layers, tokens, heads, dim]
        x = all_k.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return (x * self._k_norm_weights.float()[:, None, None, :]).to(all_k.dtype)

    module.DFlashQwen3Model._normalize_context_k = _normalize_context_k


def _expand_in_torch(module) -> None:
    import torch

    ORIGINALS.setdefault("rejection_sampler.expand_batch_to_tokens", module.expand_batch_to_tokens)

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        out = torch.repeat_interleave(x, counts.to(torch.long), output_size=num_tokens)
        return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)

    module.expand_batch_to_tokens = expand_batch_to_tokens


def _mask_no_rows(module) -> None:
    apply = ORIGINALS.setdefault("rejection_sampler.apply_top_k_top_p", module.apply_top_k_top_p)

    def apply_top_k_top_p(logits, k, p):
        if logits.shape[0] == 0:  # no draft tokens in this step: nothing to mask
            return logits
        return apply(logits, k, p)

    module.apply_top_k_top_p = apply_top_k_top_p


def _rewind_cpu_generators(module) -> None:
    runner = module.GPUModelRunner
    ORIGINALS.setdefault("GPUModelRunner._sample", runner._sample)
    ORIGINALS.setdefault("GPUModelRunner._bookkeeping_sync", runner._bookkeeping_sync)
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def _discarded_generators(self) -> dict:
        import numpy as np

        gens = self.input_batch.generators
        if not gens:
            return {}
        rows = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        return {int(i): gens[int(i)] for i in rows if int(i) in gens}

    def _sample(self, *args, **kwargs):
        self._forespark_gen_states = {i: g.get_state() for i, g in _discarded_generators(self).items()}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_forespark_gen_states", None) or {}
        self._forespark_gen_states = None
        gens = self.input_batch.generators
        held = {i: gens.pop(i) for i in saved if i in gens}  # keep them from the set_offset rewind
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for i, gen in held.items():
                gen.set_state(saved[i])
                gens[i] = gen

    runner._sample = _sample
    runner._bookkeeping_sync = _bookkeeping_sync


def register() -> None:
    global _applied
    if _applied:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker import gpu_model_runner

    _keep_qkv_weight(qwen3_dflash)
    _normalize_context_k_per_layer(qwen3_dflash)
    _expand_in_torch(rejection_sampler)
    _mask_no_rows(rejection_sampler)
    _rewind_cpu_generators(gpu_model_runner)
    _applied = True
