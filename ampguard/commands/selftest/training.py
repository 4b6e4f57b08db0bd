"""Whole-model checks: a block that overflows float16 is healed, and a float16-loaded model trains like float32.

**Forward overflow.** A small attention model whose block ``blocks.1.attn``
overflows float16 on every tenth batch (its query/key weights are sharp, those
batches 8x larger): on plain torch each such batch gives an inf loss, a skipped
step and a halved scale. Under ampguard the second overflow names the block
and makes it an fp32 island; the scale is never lowered for it and the later
overflowing batches give finite losses.

**fp16-loaded model.** A linear student fine-tuned toward a teacher with AdamW
(updates far below float16's resolution of the weights): the float16 student
with fp32 master weights must reach at least 90% of the float32 student's loss
reduction from the same (rounded) start; without masters it ends in NaN.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampguard.master_weights as master_weights
from ampguard.commands.selftest.result import CheckResult, Context, seeded, verdict
from ampguard.commands.selftest.runner import plain_torch

DIM, TOKENS, BATCH, CLASSES, EVERY = 16, 6, 4, 4, 10
ISLAND_SCALER: dict[str, Any] = {"init_scale": 1024.0, "growth_interval": 100}


class Attention(nn.Module):
    def __init__(self, sharpness: float) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(sharpness)
            self.k.weight.mul_(sharpness)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(DIM)
        out: torch.Tensor = self.out(logits.softmax(-1) @ self.v(x))
        return out


class Block(nn.Module):
    def __init__(self, sharpness: float) -> None:
        super().__init__()
        self.attn = Attention(sharpness)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        out: torch.Tensor = x + self.mlp(x) * 0.1
        return out


class HotNet(nn.Module):
    """Three blocks; the attention of ``blocks.1`` overflows float16 on the large batches."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(36.0 if i == 1 else 0.3) for i in range(3))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x.mean(1))
        return out


def overflows(step: int) -> bool:
    return step % EVERY == EVERY - 1


def train_hot_net(context: Context, steps: int) -> tuple[nn.Module, Any, list[float], list[float]]:
    """(model, scaler, loss per step, scale per step) of ``steps`` SGD steps with a fresh ``torch.amp.GradScaler``."""
    with seeded(0):
        model = HotNet()
    model.to(context.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(context.device.type, **ISLAND_SCALER)
    losses, scales = [], []
    for step in range(steps):
        data = torch.Generator().manual_seed(1000 + step)
        x = context.tensor(BATCH, TOKENS, DIM, generator=data) * (8.0 if overflows(step) else 1.0)
        y = torch.randint(0, CLASSES, (BATCH,), generator=data).to(context.device)
        optimizer.zero_grad(set_to_none=True)
        with context.autocast():
            loss = F.cross_entropy(model(x), y)
        losses.append(float(loss.detach()))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, scaler, losses, scales


def forward_overflow_healed(context: Context) -> CheckResult:
    name = "forward_overflow_healed"
    steps = context.steps(4 * EVERY, 3 * EVERY)
    with plain_torch():
        _, _, torch_losses, torch_scales = train_hot_net(context, steps)
    model, scaler, losses, scales = train_hot_net(context, steps)
    islands = list(getattr(getattr(scaler, "stats", None), "fp32_islands", ()))  # of live modules: model still here
    del model
    lost = [step for step, loss in enumerate(losses) if not math.isfinite(loss)]
    torch_lost = [step for step, loss in enumerate(torch_losses) if not math.isfinite(loss)]
    last_overflow = max(step for step in range(steps) if overflows(step))
    measured = {"islands": islands, "min_scale": min(scales), "nonfinite_loss_steps": lost}
    reference = {
        "init_scale": ISLAND_SCALER["init_scale"],
        "min_scale": min(torch_scales),
        "nonfinite_loss_steps": torch_lost,
    }
    if not torch_lost:
        return verdict(name, False, measured, reference, "the test model did not overflow float16 on plain torch here")
    ok = bool(islands) and min(scales) >= ISLAND_SCALER["init_scale"] and last_overflow not in lost
    detail = (
        f"plain torch lost {len(torch_lost)} of {steps} batches (scale down to {min(torch_scales):g}); "
        f"ampguard: island {', '.join(islands) or 'none'}, lowest scale {min(scales):g}, "
        f"last overflowing batch {'finite' if last_overflow not in lost else 'NaN/inf'}"
    )
    return verdict(name, ok, measured, reference, detail)


WIDTH, FINE_TUNE_BATCH, LEARNING_RATE, SHARE = 32, 64, 1e-4, 0.9


def fine_tune(
    context: Context, dtype: torch.dtype, steps: int
) -> tuple[float, float, nn.Linear, torch.optim.Optimizer]:
    """(held-out loss before, after, student, optimizer): AdamW under a GradScaler, the student stored in ``dtype``."""
    with seeded(0):
        teacher, student = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            for mine, theirs in zip(student.parameters(), teacher.parameters()):
                mine.copy_(theirs + 3e-3 * torch.randn_like(theirs))
    teacher.to(context.device)
    student.to(context.device, torch.float16).to(dtype)  # the float32 student starts from the float16 weights
    optimizer = torch.optim.AdamW(student.parameters(), lr=LEARNING_RATE)
    scaler = torch.amp.GradScaler(context.device.type)
    data = torch.Generator().manual_seed(1)
    held_out = context.tensor(256, WIDTH, generator=data)

    def loss_now() -> float:
        with torch.no_grad():
            return float(
                F.mse_loss(F.linear(held_out, student.weight.float(), student.bias.float()), teacher(held_out))
            )

    before = loss_now()
    for _ in range(steps):
        x = context.tensor(FINE_TUNE_BATCH, WIDTH, generator=data)
        with torch.no_grad():
            y = teacher(x)
        optimizer.zero_grad()
        with context.autocast():
            out = student(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        scaler.step(optimizer)
        scaler.update()
    return before, loss_now(), student, optimizer


def fp16_model_with_masters(context: Context) -> CheckResult:
    name = "fp16_model_with_masters"
    steps = context.steps(100, 50)
    with plain_torch():
        before32, after32, _, _ = fine_tune(context, torch.float32, steps)
    before16, after16, student, optimizer = fine_tune(context, torch.float16, steps)
    masters = len(master_weights.masters_of(optimizer))
    finite = all(bool(torch.isfinite(p).all()) for p in student.parameters())
    reduction32, reduction16 = before32 - after32, before16 - after16
    share = reduction16 / reduction32 if reduction32 > 0 else float("nan")
    measured = {"loss_reduction": reduction16, "share_of_float32": share, "finite": finite, "masters": masters}
    reference = {"loss_reduction": reduction32, "min_share": SHARE}
    ok = finite and masters > 0 and reduction32 > 0 and share >= SHARE and student.weight.dtype == torch.float16
    detail = (
        f"AdamW {steps} steps: the float16 model with {masters} fp32 masters reached "
        f"{share:.0%} of the float32 model's loss reduction" + ("" if finite else " (NaN/inf weights)")
    )
    return verdict(name, ok, measured, reference, detail)
