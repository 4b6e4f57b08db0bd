"""A small run with an event in the middle, in float16 with fp32 masters and in float32: the two must agree.

:func:`Run.steps` trains on deterministic batches; the tests put the event
(an exception in a step, a copy, a rollback) at the same point of the
float16 run and of the float32 run from the same rounded start, and compare
the parameters and the optimizer state with :func:`assert_like` after the
event and after 20 more steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# float16 weights and float16 forward/backward against float32: each step differs by rounding, a few 1e-4 over
# the runs here; a lost update (a step of lr * grad, or momentum reset) is 1e-2 or more.
TOLERANCE = 2e-3


def model_of(dtype: torch.dtype, seed: int = 0) -> torch.nn.Sequential:
    """The same start in every dtype: weights rounded to float16."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model.half().to(dtype)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=data).to(dtype), torch.randn(8, 4, generator=data)


@dataclass
class Run:
    """A model and its optimizer(s), trained one deterministic batch per step."""

    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    dtype: torch.dtype
    step: int = 0
    loss_of: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = field(
        default=lambda model, x, y: F.mse_loss(model(x).float(), y)
    )

    def steps(self, count: int) -> None:
        for _ in range(count):
            for optimizer in self.optimizers:
                optimizer.zero_grad()
            x, y = batch(self.step, self.dtype)
            self.loss_of(self.model, x, y).backward()
            for optimizer in self.optimizers:
                optimizer.step()
            self.step += 1


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def state_by_position(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The optimizer's state keyed by parameter position, as torch saves it (for any dtype of parameter)."""
    return optimizer.state_dict()["state"]


def assert_like(half: Run, full: Run, tolerance: float = TOLERANCE) -> None:
    """Parameters and optimizer state of the float16 run within ``tolerance`` of the float32 run's."""
    for (name, p), q in zip(half.model.named_parameters(), full.model.parameters()):
        assert p.dtype == half.dtype, name
        torch.testing.assert_close(p.float(), q, atol=tolerance, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    for mine, reference in zip(half.optimizers, full.optimizers):
        ours, theirs = state_by_position(mine), state_by_position(reference)
        assert ours.keys() == theirs.keys()
        for index in theirs:
            for key, value in theirs[index].items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    torch.testing.assert_close(
                        ours[index][key].float(),
                        value,
                        atol=tolerance,
                        rtol=0,
                        msg=lambda m, index=index: f"state {index}: {m}",
                    )
                else:
                    assert ours[index][key] == value, (index, key)


def model_lists(run: Run) -> list[list[int]]:
    return [[id(p) for p in group["params"]] for optimizer in run.optimizers for group in optimizer.param_groups]
