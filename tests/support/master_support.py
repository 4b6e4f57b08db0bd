"""A tiny fine-tuning problem for the master-weights tests: a linear student moved toward its teacher.

The student starts as the teacher plus a small perturbation (a fine-tune), so
that the updates are small next to the weights: exactly where float16 weights
without fp32 masters lose them (updates below half an ulp round away; AdamW's
eps and second moment underflow). Every run is deterministic (fixed seeds); the
same run with a float32 student is the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

WIDTH = 32
BATCH = 64


@dataclass
class Result:
    start_loss: float
    end_loss: float
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    norms: list[float] = field(default_factory=list)

    @property
    def reduction(self) -> float:
        return self.start_loss - self.end_loss

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def dtypes(self) -> set[torch.dtype]:
        return {p.dtype for p in self.model.parameters()}


class OwnStateDictSGD(torch.optim.SGD):
    """ampguard cannot keep masters for it (its own state_dict): it steps its half-precision weights directly."""

    def state_dict(self):  # type: ignore[override]
        return super().state_dict()


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "lbfgs":  # evaluates its closure up to 5 times a step, after each update
        return torch.optim.LBFGS(params, lr=lr, max_iter=5, history_size=10)
    assert name == "sgd"
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def teacher_and_student(
    dtype: torch.dtype, start_like: torch.dtype | None = None, seed: int = 0
) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """The student in ``dtype``, starting from weights representable in ``start_like`` (the same start as a half run)."""
    torch.manual_seed(seed)
    teacher = torch.nn.Linear(WIDTH, WIDTH)
    student = torch.nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        student.weight.copy_(teacher.weight + 3e-3 * torch.randn_like(teacher.weight))
        student.bias.copy_(teacher.bias + 3e-3 * torch.randn_like(teacher.bias))
    return teacher, student.to(start_like or dtype).to(dtype)


def held_out_loss(student: torch.nn.Linear, teacher: torch.nn.Linear, x: torch.Tensor) -> float:
    """The student's weights judged in float32 arithmetic: what they are worth, whatever their dtype."""
    with torch.no_grad():
        return F.mse_loss(F.linear(x, student.weight.float(), student.bias.float()), teacher(x)).item()


def fine_tune(
    dtype: torch.dtype,
    optimizer: str,
    lr: float,
    *,
    steps: int = 200,
    scaler: bool = True,
    clip: float | None = None,
    start_like: torch.dtype | None = None,
    closure: bool = False,
) -> Result:
    """Train the student under fp16 autocast; ``scaler=False``: plain ``loss.backward(); opt.step()``.

    ``start_like``: start from weights rounded to that dtype (the float32 reference of a half run).
    ``closure``: ``opt.step(closure)``, the closure zeroing the gradients and running forward and backward
    (no scaler).
    """
    teacher, student = teacher_and_student(dtype, start_like)
    opt = make_optimizer(optimizer, student.parameters(), lr)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    data = torch.Generator().manual_seed(1)
    held_out = torch.randn(256, WIDTH, generator=data)
    result = Result(held_out_loss(student, teacher, held_out), float("nan"), student, opt, grad_scaler)

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = student(x)
        return F.mse_loss(out.float(), y)

    def evaluate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = forward(x, y)
        loss.backward()
        return loss

    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=data)
        with torch.no_grad():
            y = teacher(x)
        if closure:
            assert grad_scaler is None and clip is None
            opt.step(functools.partial(evaluate, x, y))
            continue
        loss = forward(x, y)
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
            if clip is not None:
                grad_scaler.unscale_(opt)
                result.norms.append(torch.nn.utils.clip_grad_norm_(student.parameters(), clip).item())
            grad_scaler.step(opt)
            grad_scaler.update()
        else:
            loss.backward()
            if clip is not None:
                result.norms.append(torch.nn.utils.clip_grad_norm_(student.parameters(), clip).item())
            opt.step()
    result.end_loss = held_out_loss(student, teacher, held_out)
    return result


def table(width: int = 128) -> None:
    """Print docs/master-weights.md's table: each half-precision run's loss reduction against float32's."""
    import logging
    import os

    import ampguard

    global WIDTH
    WIDTH = width
    logging.getLogger("ampguard").setLevel(logging.CRITICAL + 1)

    def install(mode: str) -> None:
        os.environ["AMPGUARD_MASTER_WEIGHTS"] = mode
        ampguard.uninstall()
        ampguard.install()

    def share(result: Result, reference: float) -> str:
        return f"{100 * result.reduction / reference:.0f}%" if result.finite() else "NaN weights"

    print(
        "| optimizer | lr | loop | float16, no masters | float16, masters | bfloat16, no masters | bfloat16, masters (`all`) |"
    )
    print("|---|---|---|---|---|---|---|")
    for optimizer, lr in [("adamw", 1e-4), ("adamw", 1e-5), ("sgd", 1e-3)]:
        for scaler in (True, False):
            references = {
                d: fine_tune(torch.float32, optimizer, lr, scaler=scaler, start_like=d).reduction
                for d in (torch.float16, torch.bfloat16)
            }
            cells = []
            for dtype in (torch.float16, torch.bfloat16):
                for mode in ("off", "all"):
                    install(mode)
                    cells.append(share(fine_tune(dtype, optimizer, lr, scaler=scaler), references[dtype]))
            loop = "GradScaler" if scaler else "plain step"
            print(f"| {optimizer} | {lr:g} | {loop} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":  # python tests/support/master_support.py
    import os

    os.environ["AMPGUARD_QUIET"] = "1"
    table()
