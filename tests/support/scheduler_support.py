"""A tiny fp16-autocast run with an LR scheduler, and warmup schedules, for the scheduler hold's tests.

A gradient hook makes the gradients inf on chosen iterations, as a real overflow would; the learning rates the
optimizer steps with are recorded, skipped steps included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

WARMUP = 6


def warmup_lambda(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))


def warmup_linear(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=WARMUP)


def warmup_then_cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=8)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[3])


SCHEDULES = {"LambdaLR": warmup_lambda, "LinearLR": warmup_linear, "SequentialLR": warmup_then_cosine}


class Run:
    """A model, an optimizer and a scheduler; ``iteration(i)`` trains one batch, inf gradients when ``i`` in ``overflow_at``."""

    def __init__(
        self,
        schedule: Callable[[torch.optim.Optimizer], Any],
        overflow_at: set[int] = frozenset(),
        *,
        fp16: bool = True,
        fused: bool = False,
    ) -> None:
        generator = torch.Generator().manual_seed(0)
        self.model = nn.Linear(8, 4)
        self.xs = torch.randn(40, 16, 8, generator=generator)
        self.optimizer = (
            torch.optim.Adam(self.model.parameters(), lr=0.01, fused=fused)
            if fused
            else torch.optim.SGD(self.model.parameters(), lr=0.1)
        )
        self.scheduler = schedule(self.optimizer)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if fp16 else None
        self.overflow_at = overflow_at
        self.index = 0
        self.model.weight.register_hook(self._hook)
        self.lrs: list[float] = []  # the learning rate each optimizer step used (skipped steps included)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        return torch.full_like(grad, float("inf")) if self.index in self.overflow_at else None

    def iteration(self, index: int, *, step_scheduler: bool = True) -> None:
        self.index = index
        self.optimizer.zero_grad()
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        if self.scaler is None:
            (self.model(self.xs[index]) ** 2).mean().backward()
            self.optimizer.step()
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                out = self.model(self.xs[index])
            self.scaler.scale((out.float() ** 2).mean()).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if step_scheduler:
            self.scheduler.step()

    def train(self, iterations: int) -> Run:
        for index in range(iterations):
            self.iteration(index)
        return self


def successful_lrs(run: Run) -> list[float]:
    return [lr for i, lr in enumerate(run.lrs) if i not in run.overflow_at]


OVERFLOWS = {0, 3, 4, 9}


ITERATIONS = 14
