"""The shipped models loaded for offline use (tests, references): target, drafter, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from replicas.models import WEIGHTS_DIR
from replicas.models.dflash import DFlashDrafter, target_features
from replicas.models.tokenizer import MASK, load_hf_tokenizer


def load_target(model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


@dataclass
class EmbeddedModels:
    target: object
    drafter: DFlashDrafter
    tokenizer: object
    mask_id: int

    @classmethod
    def load(cls, weights_dir: Path = WEIGHTS_DIR) -> "EmbeddedModels":
        tokenizer = load_hf_tokenizer(weights_dir / "target")
        return cls(
            load_target(weights_dir / "target"),
            DFlashDrafter.load(weights_dir / "drafter"),
            tokenizer,
            tokenizer.convert_tokens_to_ids(MASK),
        )

    @torch.no_grad()
    def draft_logits(self, context_ids: list[int], bonus: int, drafter: DFlashDrafter | None = None) -> torch.Tensor:
        """[block, V] logits of one draft block after `context_ids`, the target having just sampled `bonus`
        (what vLLM's drafter computes right after prefill). `drafter` overrides the shipped one."""
        drafter = drafter or self.drafter
        ids = torch.tensor([list(context_ids) + [bonus]])
        _, aux = target_features(self.target, ids, drafter.spec.target_layer_ids)
        block = torch.tensor([[[bonus] + [self.mask_id] * drafter.spec.block]])
        embed = self.target.get_input_embeddings().weight
        return drafter(aux, block, torch.tensor([[len(context_ids)]]), embed)[0, 0]
