"""What a capability reads of a SafeGradScaler (``scaler.view()``) and the change it may ask for (``grow_now``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampguard


def step(scaler: ampguard.SafeGradScaler, model: nn.Module, optimizer: torch.optim.Optimizer, loss_factor: float = 1.0):
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum() * loss_factor).backward()
    scaler.step(optimizer)
    scaler.update()


def test_the_view_is_a_snapshot_of_the_scaler_after_its_update_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0, growth_interval=2)
    step(scaler, model, optimizer)
    view = scaler.view()
    assert (view.steps, view.scale, view.last_skipped, view.scale_given) == (1, 1024.0, False, False)
    assert (view.growth_factor, view.backoff_factor, view.device) == (2.0, 0.5, "cpu")
    step(scaler, model, optimizer)  # (the growth interval: 2048)
    assert scaler.view().scale == 2048.0 == scaler.get_scale() and view.scale == 1024.0  # (a snapshot)
    step(scaler, model, optimizer, loss_factor=math.inf)
    assert scaler.view().last_skipped and scaler.view().steps == 3
    with pytest.raises(AttributeError):
        scaler.view().scale = 1.0  # type: ignore[misc]


def test_grow_now_grows_the_scale_as_torchs_growth_would_and_restarts_the_interval():
    """What ampguard.underflow asks for: the scale times the growth factor now, on the host's mirror and the
    device alike, within the cap and below the ceiling given; the next growth a whole interval later."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0, growth_interval=3)
    step(scaler, model, optimizer)
    step(scaler, model, optimizer)  # (two steps of the interval's three)
    assert scaler.grow_now() == 2048.0 == scaler.get_scale()
    assert scaler.grow_now(below=4096.0) == 2048.0  # (4096 is not below the ceiling: unchanged)
    step(scaler, model, optimizer)
    step(scaler, model, optimizer)
    assert scaler.get_scale() == 2048.0  # the interval restarted at the growth: 2 of 3 steps since
    step(scaler, model, optimizer)
    assert scaler.get_scale() == 4096.0
