"""Build checkpoints: the full local form (exact resume) and the compact form (small enough to commit).

A checkpoint is one `torch.save`d dict (see `build.py` for what the phases put in it):

    format, kind ("full" | "compact"), spec (the BuildSpec as JSON data), phase
    (one of build.PHASES), tokenizer (its JSON),
    torch_rng, seconds (per phase, summed over resumes), and per phase the trainer
    state (weights, AdamW state, LR-schedule position, the sampler's numpy RNG
    state, the loss curve) or the phase's result; the polish stage's parts
    (`unlikelihood`, `target`, `continuations`, `drafter`) under `polish`.

Full checkpoints hold everything in float32 and resume bit for bit (one thread).
Compact checkpoints (`compact()`) keep the weights in float16, AdamW's second
moment as 8-bit codes of its logarithm per tensor (relative error <= 4% with a
typical 30-octave range), and drop the first moment. Resuming from one
(`expand()`) restarts the first moment at zero: Adam's update is then
m/sqrt(v) with m growing from 0 to its running value over ~1/(1-beta1) = 10
steps, a built-in re-warm of the step size, so no schedule change is needed;
the resumed run then differs from the uninterrupted one by float16 rounding of
the weights and that re-warm.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import torch

FORMAT = 1
STATE_FILE = "state.pt"


def save(state: dict, path: Path) -> None:
    """Atomically: a reader (or a crash) never sees a half-written checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a build checkpoint of format {FORMAT}")
    return expand(state) if state.get("kind") == "compact" else state


def _quantise_log(v: torch.Tensor) -> dict:
    """Non-negative tensor -> uint8 codes of log2(v) on [lo, hi] (code 0: exactly zero)."""
    flat = v.detach().float().flatten()
    nonzero = flat > 0
    codes = torch.zeros(flat.shape, dtype=torch.uint8)
    if nonzero.any():
        logs = torch.log2(flat[nonzero])
        lo, hi = float(logs.min()), float(logs.max())
        scale = (hi - lo) / 254 if hi > lo else 1.0
        codes[nonzero] = (torch.round((logs - lo) / scale) + 1).clamp(1, 255).to(torch.uint8)
    else:
        lo, scale = 0.0, 1.0
    return {"codes": codes.view(v.shape), "lo": lo, "scale": scale}


def _dequantise_log(q: dict) -> torch.Tensor:
    codes = q["codes"]
    out = torch.exp2(q["lo"] + (codes.float() - 1) * q["scale"])
    return torch.where(codes == 0, torch.zeros_like(out), out)


def _compact_optimizer(opt_state: dict) -> dict:
    state = {}
    for idx, s in opt_state["state"].items():
        state[idx] = {"step": s["step"], "exp_avg_sq_log8": _quantise_log(s["exp_avg_sq"])}
    return {"state": state, "param_groups": opt_state["param_groups"]}


def _expand_optimizer(opt_state: dict) -> dict:
    state = {}
    for idx, s in opt_state["state"].items():
        v = _dequantise_log(s["exp_avg_sq_log8"])
        state[idx] = {"step": s["step"], "exp_avg": torch.zeros_like(v), "exp_avg_sq": v}
    return {"state": state, "param_groups": opt_state["param_groups"]}


def _half(weights: dict) -> dict:
    return {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}


def _float(weights: dict) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def _small_ids(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int16) if t.numel() and int(t.max()) < 2**15 and int(t.min()) >= 0 else t


def _map_phase_states(state: dict, weights, optimizer, ids) -> dict:
    out = dict(state)
    if isinstance(state.get("polish"), dict):  # the polish stage's parts have the same forms
        out["polish"] = _map_phase_states(state["polish"], weights, optimizer, ids)
    for key in ("target", "drafter", "unlikelihood"):
        part = state.get(key)
        if not isinstance(part, dict):
            continue
        part = dict(part)
        for wkey in ("model", "weights"):
            if wkey in part:
                part[wkey] = weights(part[wkey])
        if "optimizer" in part:
            part["optimizer"] = optimizer(part["optimizer"])
        out[key] = part
    cont = state.get("continuations")
    if isinstance(cont, dict):
        out["continuations"] = {
            k: (ids(v) if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool else v)
            for k, v in cont.items()
        }
    return out


def compact(state: dict) -> dict:
    """The committable form of a full checkpoint (see the module docstring)."""
    if state.get("kind") == "compact":
        return state
    out = _map_phase_states(state, _half, _compact_optimizer, _small_ids)
    out["kind"] = "compact"
    out["compacted_at"] = time.time()
    return out


def expand(state: dict) -> dict:
    """A compact checkpoint in the full form the trainers load (first moments zero, float32 weights)."""
    if state.get("kind") != "compact":
        return state
    out = _map_phase_states(state, _float, _expand_optimizer, lambda t: t.long())
    out["kind"] = "full"
    out["resumed_from_compact"] = True
    return out


def nbytes(state: dict) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


class Clock:
    """Says when a periodic checkpoint is due."""

    def __init__(self, minutes: float) -> None:
        self.interval = minutes * 60
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.interval

    def reset(self) -> None:
        self.last = time.monotonic()
