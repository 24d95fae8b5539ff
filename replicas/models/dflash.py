"""A DFlash parallel drafter in plain PyTorch, computing what vLLM's `DFlashQwen3ForCausalLM` computes.

Per step, with the target's residual streams after `target_layer_ids` for the
context tokens x_0..x_{P-1}, and the bonus token x_P just sampled:

    c        = hidden_norm(fc(concat(aux)))                    # one vector per context token
    K/V(ctx) = rope(k_norm(W_k c)), W_v c   in every layer     # context enters as keys/values only
    queries  = [x_P, MASK x block] at positions P..P+block     # embedded with the target's table
    Qwen3 pre-norm layers (q/k per-head RMSNorm, neox RoPE), queries attend to the context
    and to the block (causal within the block when `causal`)
    logits   = target_lm_head(norm(h))[1:]                      # slot j predicts x_{P+j}

The embedding table and the output head are the target's (tied, frozen), so
the checkpoint holds only the drafter's own weights, under the names vLLM loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from replicas.models.spec import DrafterSpec

RMS_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding over the last dim; positions broadcast against x[..., 0]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # [..., T, H] -> [..., heads, T, hd]
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(-3, -2)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        k = rope(self.k_norm(self.split(self.k_proj(x))), positions[..., None, :], theta)
        return k, self.split(self.v_proj(x))

    def forward(self, x, positions, ctx_kv, mask, theta) -> torch.Tensor:
        q = rope(self.q_norm(self.split(self.q_proj(x))), positions[..., None, :], theta)
        k, v = self.keys_values(x, positions, theta)
        k = torch.cat([ctx_kv[0], k], dim=-2)
        v = torch.cat([ctx_kv[1], v], dim=-2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(-3, -2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, inner)


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DrafterSpec, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(hidden * len(spec.target_layer_ids), hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden)
        self.layers = nn.ModuleList(Layer(hidden, spec.num_heads, spec.intermediate_size) for _ in range(spec.num_layers))
        self.norm = RMSNorm(hidden)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., T, n_aux * H] target residual streams -> [..., T, H] context vectors."""
        return self.hidden_norm(self.fc(aux))

    def forward(
        self,
        aux: torch.Tensor,
        block_ids: torch.Tensor,
        anchors: torch.Tensor,
        embed: torch.Tensor,
    ) -> torch.Tensor:
        """Draft logits for many blocks of one batch of sequences at once.

        aux [B, T, n_aux*H]: target features of every position; block_ids [B, N, block+1]:
        [x_P, MASK, ...]; anchors [B, N]: P for each block (its context is positions < P);
        embed [V, H]: the target's tied embedding / output matrix. Returns [B, N, block, V].
        """
        b, t, _ = aux.shape
        _, n, q = block_ids.shape
        theta = self.spec.rope_theta
        ctx = self.context(aux)
        ctx_pos = torch.arange(t).expand(b, t)
        qpos = (anchors[..., None] + torch.arange(q)).reshape(b, n * q)
        # Visibility: block query (n, j) sees context t < P_n, and its own block (causally or not).
        sees_ctx = torch.arange(t)[None, None, :] < anchors.repeat_interleave(q, dim=1)[..., None]
        same_block = torch.arange(n).repeat_interleave(q)
        slot = torch.arange(q).repeat(n)
        sees_block = same_block[:, None] == same_block[None, :]
        if self.spec.causal:
            sees_block = sees_block & (slot[None, :] <= slot[:, None])
        mask = torch.cat([sees_ctx, sees_block.expand(b, -1, -1)], dim=-1)[:, None]  # [B, 1, NQ, T+NQ]
        h = F.embedding(block_ids.reshape(b, n * q), embed)
        for layer in self.layers:
            attn = layer.self_attn
            ctx_kv = attn.keys_values(ctx, ctx_pos, theta)
            h = h + attn(layer.input_layernorm(h), qpos, ctx_kv, mask, theta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out = self.norm(h).reshape(b, n, q, -1)[:, :, 1:]
        return out @ embed.T

    def save(self, out_dir: Path, *, vocab_size: int, mask_token_id: int, max_positions: int) -> None:
        """config.json + model.safetensors in the layout vLLM's DFlashDraftModel loads."""
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        hidden = self.norm.weight.shape[0]
        config = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": hidden,
            "num_hidden_layers": self.spec.num_layers,
            "num_attention_heads": self.spec.num_heads,
            "num_key_value_heads": self.spec.num_heads,
            "head_dim": hidden // self.spec.num_heads,
            "intermediate_size": self.spec.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": RMS_EPS,
            "attention_bias": False,
            "rope_theta": self.spec.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.spec.rope_theta},
            "max_position_embeddings": max_positions,
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": self.spec.block + 1,
            "dflash_config": {
                "mask_token_id": mask_token_id,
                "target_layer_ids": self.spec.target_layer_ids,
                "causal": self.spec.causal,
            },
        }
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(out_dir / "model.safetensors"))

    @classmethod
    def load(cls, model_dir: Path) -> "DFlashDrafter":
        from safetensors.torch import load_file

        config = json.loads((model_dir / "config.json").read_text())
        spec = DrafterSpec(
            block=config["block_size"] - 1,
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            target_layer_ids=config["dflash_config"]["target_layer_ids"],
            causal=config["dflash_config"]["causal"],
            rope_theta=config["rope_theta"],
        )
        drafter = cls(spec, config["hidden_size"])
        drafter.load_state_dict(load_file(str(model_dir / "model.safetensors")))
        return drafter.eval()


def target_features(target, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, aux): the target's logits and its residual streams after `layer_ids`, concatenated
    (what vLLM's aux-hidden-state capture hands the drafter; pre-final-norm for the last layer)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layer_ids:
        def hook(_module, _inputs, output, i=i):
            captured[i] = output[0] if isinstance(output, tuple) else output
        hooks.append(target.model.layers[i].register_forward_hook(hook))
    try:
        logits = target(input_ids=input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.cat([captured[i] for i in layer_ids], dim=-1)


def drafter_variant(src: Path, dst: Path, *, causal: bool) -> Path:
    """A copy of the DFlash checkpoint in `src` with `dflash_config.causal` set (same weights, linked).

    `causal=False` gives what every public DFlash checkpoint is: block positions attend to the whole block."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["dflash_config"]["causal"] = causal
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    return dst
