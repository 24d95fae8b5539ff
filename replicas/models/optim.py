"""What the trainers share: the optimisation step (AdamW with clipping and a per-step learning-rate factor) and
the checkpointable state."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class Optimiser:
    def __init__(
        self, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, lr_factor: Callable[[int], float]
    ) -> None:
        self.params = list(params)
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor)

    def step(self, loss: torch.Tensor) -> float:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return float(loss.detach())


class TrainerState:
    """The state every trainer checkpoints (weights, AdamW moments, schedule position, its data sampler's RNG,
    step, loss curve) plus the list attributes it names in `extra_lists`, so that a run resumed from
    `state_dict()` takes exactly the steps the uninterrupted run would have."""

    trained: torch.nn.Module
    opt: Optimiser
    extra_lists: tuple[str, ...] = ()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "losses": list(self.losses),
            "rng": self.rng.bit_generator.state,
            "model": {k: v.detach().clone() for k, v in self.trained.state_dict().items()},
            "optimizer": self.opt.opt.state_dict(),
            "scheduler": self.opt.sched.state_dict(),
            **{name: list(getattr(self, name)) for name in self.extra_lists},
        }

    def load_state_dict(self, state: dict) -> None:
        self.trained.load_state_dict(state["model"])
        self.opt.opt.load_state_dict(state["optimizer"])
        self.opt.sched.load_state_dict(state["scheduler"])
        self.rng.bit_generator.state = state["rng"]
        self.step = int(state["step"])
        self.losses = list(state["losses"])
        for name in self.extra_lists:
            setattr(self, name, list(state[name]))
