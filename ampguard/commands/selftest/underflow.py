"""The underflow sampler on this device: a sampled step's counts against a count made directly on its gradients.

A linear layer computing in float16 (its weight cast explicitly, as a model
loaded for float16 does) whose loss is multiplied by ``factor`` before the
scaler scales it. Its backward pass makes two float16 gradients: the output's
and the weight copy's (the float32 weight's gradient holds its values: the
sample counts it before the scaler unscales it). The reference run (plain torch, the same steps) takes
both with tensor hooks and counts them on the host: values, zeros, subnormals,
the values at the two smallest subnormals, the largest magnitude
(:class:`~ampguard.underflow.counts.Counts` turns those into the shares
``scaler.stats`` shows).

* **tiny loss** (``factor`` = 2**-26 at scale 1024): most gradient values are
  subnormal and some flushed to zero. Training stops at the first update that
  shows a measurement in ``scaler.stats`` (the sampled step is the second, or
  the first after it on CUDA, where the counts come through a copy), before a
  grown scale (``AMPGUARD_UNDERFLOW=adapt``) could part the run from torch's:
  the measurement must equal the reference's count of the sampled step.
* **healthy loss** (``factor`` 2**-8: gradients of a few units to tens, with
  room to grow): the same comparison, and the weights after the run must be
  torch's bit for bit (sampling observes only; the scale is never grown for a
  share this small).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampguard.commands.selftest.result import CheckResult, Context, seeded, verdict
from ampguard.commands.selftest.runner import plain_torch
from ampguard.commands.selftest.scaling import same_parameters
from ampguard.underflow.counts import Counts
from ampguard.underflow.gradients import SMALLEST_NORMAL, SMALLEST_SUBNORMAL

WIDTH, OUTPUTS, BATCH = 32, 16, 8
TINY, HEALTHY = 2.0**-26, 2.0**-8
SCALER: dict[str, Any] = {"init_scale": 1024.0, "growth_interval": 1000}
# The shares scaler.stats shows are rounded to 6 decimals.
ROUNDED = 6


class Half(nn.Module):
    """``x @ weight.half().T``: float16 output and float16 weight copy. ``captured``: their gradients go there."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(OUTPUTS, WIDTH) / math.sqrt(WIDTH))
        self.captured: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(torch.float16)
        out = x.to(torch.float16) @ weight.t()
        if self.captured is not None:
            for tensor in (out, weight):
                tensor.register_hook(self.captured.append)
        return out


@dataclass
class Run:
    model: Half
    scaler: Any
    gradients: list[list[torch.Tensor]] = field(default_factory=list)  # per step: the float16 gradients (reference)
    scales: list[float] = field(default_factory=list)  # per step: the scale it ran at


def sampled(scaler: Any) -> bool:
    """Whether ``scaler.stats`` shows a measurement (never for torch's own scaler)."""
    return bool(getattr(getattr(scaler, "stats", None), "underflow_samples", 0))


def train(context: Context, factor: float, steps: int, capture: bool = False, until_sampled: bool = False) -> Run:
    """Up to ``steps`` SGD steps with a fresh ``torch.amp.GradScaler``; ``until_sampled``: no step after the update
    that shows the first measurement. ``capture``: each step's float16 gradients, on the host."""
    with seeded(0):
        model = Half()
    model.to(context.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = Run(model, torch.amp.GradScaler(context.device.type, **SCALER))
    data = torch.Generator().manual_seed(2)
    coefficients = context.tensor(BATCH, OUTPUTS, generator=data)
    for _ in range(steps):
        x = context.tensor(BATCH, WIDTH, generator=data)
        model.captured = [] if capture else None
        optimizer.zero_grad(set_to_none=True)
        run.scales.append(run.scaler.get_scale())
        with context.autocast():
            loss = (model(x).float() * coefficients).sum() * factor
        run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        context.synchronize()  # (CUDA: the sample's copy is done by the next update)
        run.gradients.append([g.detach().cpu() for g in model.captured or ()])
        if until_sampled and sampled(run.scaler):
            break
    model.captured = None
    return run


def count(gradients: list[torch.Tensor]) -> Counts:
    """The counts of one step's float16 gradients (in backward order: the output's, then the weight copy's,
    computed from it) as docs/underflow.md defines them, counted here on the host."""
    total, fed, rows = Counts(), False, []
    for gradient in gradients:
        magnitude = gradient.abs().float()
        peak, zeros = float(magnitude.max()), int((magnitude == 0).sum())
        lowest, next_lowest = (
            int((magnitude == SMALLEST_SUBNORMAL).sum()),
            int((magnitude == 2 * SMALLEST_SUBNORMAL).sum()),
        )
        estimate = lowest * max(lowest, next_lowest) // (2 * max(next_lowest, 1))
        if peak < SMALLEST_NORMAL or fed:  # flushed, or fed by a flushed one: its sinking columns' zeros are lost
            table = magnitude.reshape(-1, magnitude.shape[-1] if magnitude.dim() > 1 else 1)
            sinking = int(((table == 0) & (table.amax(0) <= 2.5 * SMALLEST_SUBNORMAL)).sum())
            estimate = sinking + min(zeros - sinking, estimate)
        below = int((magnitude < SMALLEST_NORMAL).sum())
        rows.append((gradient.numel(), peak, zeros, min(zeros, estimate), below, peak == 0 and fed))
        fed = peak < SMALLEST_NORMAL and (peak > 0 or fed)
    no_normal_value = max((row[1] for row in rows), default=0.0) < SMALLEST_NORMAL
    for values, peak, zeros, estimate, below, sunk in rows:
        if peak == 0 and (sunk or no_normal_value):  # all zeros, lost whole
            total = total + Counts(values, sunk=values, peak=peak)
        else:
            total = total + Counts(values, zeros, zeros + estimate, below, 0, peak)
    return total


def shown(counts: Counts, scale: float, step: int) -> dict[str, Any]:
    """``counts`` as ``scaler.stats`` shows a measurement."""
    return {
        "underflow_values": counts.values,
        "underflow_subnormal": round(counts.share(counts.subnormal), ROUNDED),
        "underflow_lost": round(counts.share(counts.flushed), ROUNDED),
        "underflow_share": round(counts.share(counts.underflow), ROUNDED),
        "underflow_grad_peak": counts.peak,
        "underflow_scale": scale,
        "underflow_step": step,
    }


def compare(context: Context, factor: float, steps: int) -> tuple[bool, dict[str, Any], dict[str, Any], bool]:
    """(the measurement equals the reference's count, measured, reference, the parameters equal torch's)."""
    with plain_torch():
        reference = train(context, factor, steps, capture=True)
    ours = train(context, factor, steps, until_sampled=factor == TINY)
    stats = ours.scaler.stats
    measured = {name: getattr(stats, name) for name in shown(Counts(), 0.0, 0)}
    measured["underflow_samples"] = stats.underflow_samples
    identical = len(ours.scales) == steps and same_parameters(ours.model, reference.model)
    step = stats.underflow_step
    if not 1 <= step <= len(reference.gradients):
        return False, measured, {"steps": len(reference.gradients)}, identical
    expected = shown(count(reference.gradients[step - 1]), reference.scales[step - 1], step)
    return all(measured[name] == value for name, value in expected.items()), measured, expected, identical


def describe(measured: dict[str, Any], agrees: bool) -> str:
    if not measured["underflow_step"]:
        return "no measurement in scaler.stats"
    return (
        f"{measured['underflow_share']:.2%} of {measured['underflow_values']} float16 gradient values subnormal or "
        f"lost at step {measured['underflow_step']} ({'as' if agrees else 'not as'} counted directly)"
    )


def underflow_sampled(context: Context) -> CheckResult:
    steps = context.steps(6, 4)
    tiny_ok, tiny, tiny_reference, _ = compare(context, TINY, steps)
    healthy_ok, healthy, healthy_reference, identical = compare(context, HEALTHY, steps)
    healthy["parameters_identical"] = identical
    measured = {"tiny_loss": tiny, "healthy_loss": healthy}
    reference = {"tiny_loss": tiny_reference, "healthy_loss": healthy_reference}
    ok = tiny_ok and healthy_ok and identical and tiny["underflow_share"] > 0.5
    detail = f"loss x 2**-26: {describe(tiny, tiny_ok)}; healthy loss: {describe(healthy, healthy_ok)}, parameters "
    detail += f"{'identical to' if identical else 'differ from'} torch's after {steps} steps"
    return verdict("underflow_sampled", ok, measured, reference, detail)
