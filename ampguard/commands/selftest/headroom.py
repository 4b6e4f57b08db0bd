"""The headroom watch on this device: a module close to float16's limit made an fp32 island before it overflows.

A small model (``embed``, ``loud``, ``head``) whose module ``loud`` computes,
in its own ``forward``, a float16 intermediate ``gain * x @ weight.T`` that peaks at
about 22,000 to 38,000 on an ordinary batch (within ``AMPGUARD_HEADROOM`` = 4
of float16's 65,504: from 16,376 on), and normalises it (its output stays
small). Every fourth batch is 4x louder: there the intermediate overflows, and
on plain torch the loss is inf/NaN, the step skipped and the scale halved.

The check runs with its own schedule (``AMPGUARD_WATCH_EVERY=1``,
``AMPGUARD_HEADROOM=4``; the user's other settings kept), whatever the user's
schedule, so that every step from the second on is watched:

* **ahead of the overflow**: the watch of step 2 names ``loud``, which becomes
  an island before the first loud batch: no loss is inf/NaN, no step skipped,
  the scale never lowered, where plain torch loses every loud batch;
* **observation only**: the same model with a quiet ``loud`` (peaks of a few
  hundred) trains with every step watched and ends with the weights of plain
  torch bit for bit, no island, and ``scaler.stats.headroom`` giving
  ``loud``'s peak of the last step as the reference computes it directly (the
  largest magnitude of its float16 intermediate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampguard.commands.selftest.result import CheckResult, Context, seeded, verdict
from ampguard.commands.selftest.runner import plain_torch
from ampguard.commands.selftest.scaling import same_parameters

DIM, TOKENS, BATCH, CLASSES, LOUD_EVERY, LOUDER = 16, 6, 4, 4, 4, 4.0
HOT_GAIN, QUIET_GAIN = 13000.0, 100.0  # ordinary batches: peaks of ~22,000 to ~38,000 (hot), a few hundred (quiet)
HEADROOM = 4.0
SCHEDULE = {"AMPGUARD_WATCH_EVERY": "1", "AMPGUARD_HEADROOM": f"{HEADROOM:g}"}
SCALER: dict[str, Any] = {"init_scale": 1024.0, "growth_interval": 100}


class Loud(nn.Module):
    """``layer_norm(gain * x @ weight.T)``: its own float16 intermediate is large, its output small.

    ``peak``: the largest magnitude of that intermediate in its last call, the largest of its float16 values (the
    reference for the watch's peak).
    """

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / math.sqrt(DIM))
        self.gain = gain
        self.peak = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.weight.t()) * self.gain
        self.peak = h.detach().abs().amax()
        return F.layer_norm(h, (DIM,))


class LoudNet(nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.loud = Loud(gain)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.loud(self.embed(x)).mean(1))
        return out


def loud_batch(step: int) -> bool:
    return step % LOUD_EVERY == LOUD_EVERY - 1


@dataclass
class Run:
    model: LoudNet
    scaler: Any
    nonfinite: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


def train(context: Context, gain: float, steps: int, loud: bool) -> Run:
    """``steps`` SGD steps under float16 autocast with a fresh ``torch.amp.GradScaler`` (loud: every 4th batch)."""
    with seeded(0):
        model = LoudNet(gain)
    model.to(context.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = Run(model, torch.amp.GradScaler(context.device.type, **SCALER))
    for step in range(steps):
        data = torch.Generator().manual_seed(1000 + step)
        x = context.tensor(BATCH, TOKENS, DIM, generator=data) * (LOUDER if loud and loud_batch(step) else 1.0)
        y = torch.randint(0, CLASSES, (BATCH,), generator=data).to(context.device)
        optimizer.zero_grad(set_to_none=True)
        with context.autocast():
            loss = F.cross_entropy(model(x), y)
        if not math.isfinite(float(loss.detach())):
            run.nonfinite.append(step)
        run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        run.scales.append(run.scaler.get_scale())
    return run


def ahead_of_overflow(reference: Run, ours: Run, steps: int) -> tuple[bool, dict[str, Any], dict[str, Any], str]:
    """(ok, measured, reference, detail) of the hot model: ``loud`` an island before its first overflow."""
    stats = ours.scaler.stats
    islands = list(stats.fp32_islands)  # (of live models: another check's may be there still)
    measured = {"islands": islands, "nonfinite_loss_steps": ours.nonfinite, "skipped": stats.skipped}
    measured["min_scale"] = min(ours.scales)
    expected = {"island": "loud", "nonfinite_loss_steps": reference.nonfinite, "min_scale": min(reference.scales)}
    ok = bool(reference.nonfinite) and "loud" in islands and not ours.nonfinite and stats.skipped == 0
    ok = ok and min(ours.scales) >= SCALER["init_scale"]
    detail = (
        f"loud within {HEADROOM:g}x of 65,504 (plain torch lost {len(reference.nonfinite)} of {steps} batches): "
        f"{'an island' if 'loud' in islands else 'no island'}, {len(ours.nonfinite)} inf/NaN losses, "
        f"{stats.skipped} skipped"
    )
    if not reference.nonfinite:
        detail = "the test model did not overflow float16 on plain torch here: " + detail
    return ok, measured, expected, detail


def observation_only(reference: Run, ours: Run, steps: int) -> tuple[bool, dict[str, Any], dict[str, Any], str]:
    """(ok, measured, reference, detail) of the quiet model, every step watched: torch's weights, the peak named."""
    stats = ours.scaler.stats
    identical = same_parameters(ours.model, reference.model)
    peaks = dict(stats.headroom)
    true_peak = float(reference.model.loud.peak)
    island = "loud" in stats.fp32_islands
    measured = {"parameters_identical": identical, "island": island, "headroom": peaks}
    expected = {"loud_peak": true_peak}
    ok = identical and not island and peaks.get("loud") == true_peak
    detail = (
        f"quiet, {steps} steps watched: parameters {'identical to' if identical else 'differ from'} torch's, "
        f"{'an island' if island else 'no island'}, peak {peaks.get('loud', 'not seen')} (directly: {true_peak:g})"
    )
    return ok, measured, expected, detail


def headroom_watch(context: Context) -> CheckResult:
    """Run with :data:`SCHEDULE` (:attr:`~ampguard.commands.selftest.runner.Check.settings`)."""
    steps = context.steps(12, 8)
    with plain_torch():
        torch_quiet = train(context, QUIET_GAIN, steps, loud=False)
        torch_hot = train(context, HOT_GAIN, steps, loud=True)
    # the quiet model first: its module ``loud`` must not be taken for the hot one's island
    quiet_ok, quiet, quiet_reference, quiet_detail = observation_only(
        torch_quiet, train(context, QUIET_GAIN, steps, loud=False), steps
    )
    ahead_ok, ahead, ahead_reference, ahead_detail = ahead_of_overflow(
        torch_hot, train(context, HOT_GAIN, steps, loud=True), steps
    )
    measured = {"ahead_of_overflow": ahead, "observation_only": quiet}
    reference = {"ahead_of_overflow": ahead_reference, "observation_only": quiet_reference}
    return verdict("headroom_watch", ahead_ok and quiet_ok, measured, reference, f"{ahead_detail}; {quiet_detail}")
