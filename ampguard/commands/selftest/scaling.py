"""The GradScaler checks: skips counted exactly and every step torch's, and no host read more than torch's.

The loop is a tiny MLP under float16 autocast; on the fault steps one scaled
gradient is overwritten with inf or NaN after backward (the GradScaler sees
exactly what a real overflow gives it). The reference is the same loop on
plain torch with torch's own GradScaler and the same settings.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ampguard.commands.selftest.result import CheckResult, Context, not_ampguards, not_applicable, seeded, verdict
from ampguard.commands.selftest.runner import plain_torch
from ampguard.syncs import HostReadCounter

# growth_interval 20: the scale grows back between faults; neither ampguard's floor nor its cap is reached.
SCALER_SETTINGS: dict[str, Any] = {
    "init_scale": 4096.0,
    "growth_factor": 1.5,
    "backoff_factor": 0.4,
    "growth_interval": 20,
}

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def fused_adam(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, fused=True)


def has_fused_adam(device: torch.device) -> bool:
    """``Adam(fused=True)`` on this device (CPU: from torch 2.4 on)."""
    try:
        fused_adam([torch.nn.Parameter(torch.zeros(1, device=device))])
    except (RuntimeError, ValueError):
        return False
    return True


@dataclass
class Loop:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    scales: list[float] = field(default_factory=list)


def train(
    context: Context,
    make_optimizer: OptimizerFactory,
    steps: int,
    faults: Iterable[int] = (),
    record_scales: bool = True,
) -> Loop:
    """``steps`` steps with a fresh ``torch.amp.GradScaler`` (whatever class that name is now)."""
    with seeded(0):
        first = torch.nn.Linear(8, 16)
        model = torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model.to(context.device)
    optimizer = make_optimizer(model.parameters())
    loop = Loop(model, optimizer, torch.amp.GradScaler(context.device.type, **SCALER_SETTINGS))
    faults = set(faults)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = context.tensor(8, 8, generator=data), context.tensor(8, 2, generator=data)
        optimizer.zero_grad(set_to_none=True)
        with context.autocast():
            out = model(x)
        loop.scaler.scale(F.mse_loss(out.float(), y)).backward()
        if step in faults and first.weight.grad is not None:
            first.weight.grad[step % 16, 0] = float("inf") if step % 2 else float("nan")
        loop.scaler.step(optimizer)
        loop.scaler.update()
        if record_scales:
            loop.scales.append(loop.scaler.get_scale())
    return loop


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def backoffs(scales: list[float], init_scale: float) -> int:
    """Skipped steps as torch's scaler shows them: each one lowers the scale (backoff_factor < 1)."""
    return sum(after < before for before, after in zip([init_scale, *scales], scales))


def skips_and_parity(context: Context, fused: bool) -> CheckResult:
    """k injected inf/NaN gradients: exactly k skips counted, parameters and scales bit-identical to torch's."""
    name = "skips_and_parity_fused_adam" if fused else "skips_and_parity_sgd"
    if fused and not has_fused_adam(context.device):
        return not_applicable(
            name, f"Adam(fused=True) has no {context.device.type} kernel in torch {torch.__version__}"
        )
    steps = context.steps(200, 60)
    injected = context.steps(10, 4)
    faults = sorted(random.Random(3).sample(range(steps), injected))
    make_optimizer = fused_adam if fused else sgd
    with plain_torch():
        reference = train(context, make_optimizer, steps, faults)
    ours = train(context, make_optimizer, steps, faults)
    wrong_class = not_ampguards(name, ours.scaler)
    if wrong_class is not None:
        return wrong_class
    counted = ours.scaler.stats.skipped
    torch_skips = backoffs(reference.scales, SCALER_SETTINGS["init_scale"])
    identical = same_parameters(ours.model, reference.model)
    measured = {"skipped": counted, "final_scale": ours.scaler.get_scale(), "parameters_identical": identical}
    expected = {"injected": injected, "skipped": torch_skips, "final_scale": reference.scaler.get_scale()}
    ok = counted == injected == torch_skips and identical and ours.scales == reference.scales
    detail = (
        f"{injected} faults in {steps} steps: ampguard counted {counted}, torch's scaler backed off {torch_skips} times"
    )
    if not identical or ours.scales != reference.scales:
        detail += "; parameters or scales differ from torch's"
    return verdict(name, ok, measured, expected, detail)


def skips_and_parity_sgd(context: Context) -> CheckResult:
    return skips_and_parity(context, fused=False)


def skips_and_parity_fused_adam(context: Context) -> CheckResult:
    return skips_and_parity(context, fused=True)


def host_reads(context: Context) -> CheckResult:
    """Healthy steps read the device no more often than torch's own GradScaler loop (counted, not timed)."""
    name = "host_reads"
    steps = context.steps(50, 20)
    with plain_torch(), HostReadCounter() as torch_reads:
        train(context, sgd, steps, record_scales=False)
    with HostReadCounter() as ours:
        loop = train(context, sgd, steps, record_scales=False)
    wrong_class = not_ampguards(name, loop.scaler)
    if wrong_class is not None:
        return wrong_class
    measured = {"reads": ours.total, "by_source": dict(ours.by_source)}
    reference = {"reads": torch_reads.total}
    detail = f"{steps} healthy steps: {ours.total} host reads, torch's GradScaler {torch_reads.total}"
    return verdict(name, ours.total == torch_reads.total, measured, reference, detail)
