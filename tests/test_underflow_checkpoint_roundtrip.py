"""Issue 32: a checkpoint taken after a sampled step whose float16 gradients overflowed loads back as it was saved.

docs/underflow.md says ampguard never writes a non-finite measurement, and ``load_state_dict()`` refuses one (one
WARNING, the scaler's own underflow state kept). Before this, a sampled step whose backward overflowed recorded its
peak as inf, so ``scaler.load_state_dict(scaler.state_dict())`` refused ampguard's own entries. Now a skipped sampled
step is no measurement (``scaler.stats`` goes on showing the last one), and a peak of inf or NaN on a step that was
not skipped (a ReLU masked the overflowed values further down) is kept as 65536, finite and above every float16
value. The reference: the scaler that saved (its entries, its stats) and torch's GradScaler (the same scales).
"""

from __future__ import annotations

import io
import logging
import math
from typing import Any

import pytest
import torch
from scaler_support import one_thread, stock  # noqa: F401
from torch import nn

import ampguard
import ampguard.scaler.listeners as listeners
from ampguard.underflow.counts import OVERFLOWED
from ampguard.underflow.listener import UnderflowListener

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _adapt(reinstall):
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="5")


class Masked(nn.Module):
    """A linear layer, a ReLU and a float16 weighting whose gradient overflows (``loud``) where the ReLU is off:
    the ReLU's backward zeroes those values, so the parameters' gradients stay finite and no step is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.act = nn.ReLU()  # (a module: the sample counts its output's gradient, inf where it is off)
        self.loud = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        weights = torch.where(h.detach() < 0, self.loud, 1.0).to(h.dtype)
        return self.act(h) * weights


def train(scaler: Any, steps: int, *, overflow_at: int | None = None, loud: float = 1.0) -> nn.Module:
    """SGD on :class:`Masked` (a linear loss: every output has a gradient); at ``overflow_at`` (0-based) the loss is multiplied by 1e6 (the float16 gradients
    overflow at any scale ampguard runs at: the step is skipped)."""
    torch.manual_seed(0)
    model = Masked()
    model.loud = loud
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    coefficients = torch.randn(16, 16, generator=generator) / 256
    for step in range(steps):
        x = torch.randn(16, 8, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() * coefficients).sum() * (1e6 if step == overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return model


def underflow_state(scaler: Any) -> Any:
    [listener] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    return listener.states[scaler]


def held(scaler: Any) -> tuple[Any, ...]:
    state = underflow_state(scaler)
    return (state.ceiling, state.samples, state.growths, state.next_sample, state.last)


def weights_only_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_sampled_step_whose_backward_overflowed_is_no_measurement_and_loads_back(caplog):
    """Step 2 (the first sample) overflows: skipped, the scale halved as torch halves it. Step 7 (the next sample,
    every 5) is measured. Saved right after step 2 and after step 7, the state loads back into the same scaler and
    into a fresh one with no WARNING and nothing refused."""
    scaler = ampguard.SafeGradScaler("cpu")
    train(scaler, 2, overflow_at=1)
    torch_scaler = stock(init_scale=1024.0, growth_interval=100)
    train(torch_scaler, 2, overflow_at=1)
    stats = scaler.stats
    assert stats.skipped == 1 and scaler.get_scale() == torch_scaler.get_scale() == 512.0
    assert underflow_state(scaler).samples == 1 and underflow_state(scaler).last is None  # sampled, not measured
    assert stats.underflow_samples == 0 and stats.underflow_step == 0  # (nothing to show yet)
    entries = scaler.state_dict()["ampguard"]
    assert entries["underflow_samples"] == 1 and "underflow_last" not in entries  # before: a peak of inf
    assert entries["underflow_ceiling"] == 1024.0  # the overflow's ceiling, as any overflow sets it
    before = held(scaler)
    caplog.clear()  # (torch's scaler, the reference, was warned about)
    with caplog.at_level(logging.INFO, logger="ampguard"):
        scaler.load_state_dict(scaler.state_dict())
        fresh = ampguard.SafeGradScaler("cpu")
        fresh.load_state_dict(weights_only_round_trip(scaler.state_dict()))
    assert warnings_of(caplog) == []
    assert held(scaler)[:3] == before[:3] and held(fresh)[:3] == before[:3]
    assert fresh.stats == scaler.stats

    later = ampguard.SafeGradScaler("cpu")
    train(later, 8, overflow_at=1)
    assert later.stats.underflow_samples == 2 and later.stats.underflow_step == 7
    assert math.isfinite(later.stats.underflow_grad_peak) and later.stats.underflow_grad_peak < 65504
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ampguard"):
        later.load_state_dict(later.state_dict())
    assert warnings_of(caplog) == [] and later.stats.underflow_step == 7


def test_an_overflow_masked_further_down_is_kept_finite_and_loads_back(caplog):
    """The float16 gradient into the ReLU holds inf where the ReLU is off; the parameters' gradients are finite and
    the step is not skipped, so the sample is a measurement: its peak is kept as 65536 (no growth: no headroom),
    and the checkpoint loads back with no WARNING. The run is torch's, bit for bit (nothing grew)."""
    scaler = ampguard.SafeGradScaler("cpu")
    model = train(scaler, 3, loud=1e4)
    reference = train(stock(init_scale=1024.0, growth_interval=100), 3, loud=1e4)
    stats = scaler.stats
    assert stats.skipped == 0 and stats.underflow_samples == 1 and stats.underflow_step == 2
    assert stats.underflow_grad_peak == OVERFLOWED and stats.underflow_growths == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    saved = scaler.state_dict()
    assert saved["ampguard"]["underflow_last"]["total"][-1] == OVERFLOWED
    caplog.clear()  # (torch's scaler, the reference, was warned about)
    with caplog.at_level(logging.INFO, logger="ampguard"):
        scaler.load_state_dict(saved)
        fresh = ampguard.SafeGradScaler("cpu")
        fresh.load_state_dict(weights_only_round_trip(saved))
    assert warnings_of(caplog) == []
    assert fresh.stats == scaler.stats and held(fresh)[4] == held(scaler)[4]
