"""The optimisation step both trainers share: AdamW with clipping and a per-step learning-rate factor."""

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
