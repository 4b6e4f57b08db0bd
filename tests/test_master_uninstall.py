"""fp32 masters (issue 20): ``ampguard.uninstall()`` with masters live, against the float32 run.

After ``scaler.unscale_(optimizer)`` the unscaled gradients are the masters'
(the parameters' ``.grad`` keep the scaled float16 values). Switched off before
``scaler.step``, the optimizer must step with the unscaled gradients, as the
float32 run does, not with gradients still multiplied by the scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from master_events_support import batch, model_of, sgd
from scaler_support import one_thread  # noqa: F401

import ampguard

pytestmark = pytest.mark.usefixtures("one_thread")


def _update_after_unscale(dtype: torch.dtype, uninstall: bool) -> float:
    model = model_of(dtype)
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    start = [p.detach().float().clone() for p in model.parameters()]
    x, y = batch(0, dtype)
    scaler.scale(F.mse_loss(model(x).float(), y)).backward()
    scaler.unscale_(optimizer)
    if uninstall:
        ampguard.uninstall()
    try:
        scaler.step(optimizer)
    finally:
        ampguard.install()
    return max((p.float() - s).abs().max().item() for p, s in zip(model.parameters(), start))


def test_uninstall_between_unscale_and_step_steps_with_the_unscaled_gradients():
    half = _update_after_unscale(torch.float16, uninstall=True)
    full = _update_after_unscale(torch.float32, uninstall=False)
    assert half == pytest.approx(full, rel=0.05), f"largest update {half:.4g} in float16, {full:.4g} in float32"
