"""Patch anomaly (opt-in): anomaly detection on, with its cost stated, and fp16 overflow steps still skipped."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import ampguard
from ampguard.patches import anomaly


@pytest.fixture(autouse=True)
def _anomaly_mode_restored():
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    yield
    ampguard.uninstall()
    torch.set_anomaly_enabled(*before)


def _overflowing_step(scaler: torch.amp.GradScaler) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """One fp16-autocast step on CPU whose scaled backward overflows into NaN (a scale of 2**20)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return model, before


def test_opt_in_only():
    state = {s.name: s for s in ampguard.status()}["anomaly"]
    assert state.state == "disabled" and "AMPGUARD_ENABLE=anomaly" in state.reason
    assert not torch.is_anomaly_enabled()


def test_enabled_with_a_warning_stating_the_measured_cost(reinstall, caplog):
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        statuses = {s.name: s.state for s in reinstall(AMPGUARD_ENABLE="anomaly")}
    assert statuses["anomaly"] == "applied"
    assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    messages = [r.getMessage() for r in caplog.records if r.name == "ampguard" and r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert f"about {anomaly.MEASURED_SLOWDOWN:.1f}x the time" in messages[0]
    assert "measure_cost" in messages[0]


def test_stock_anomaly_mode_aborts_on_the_overflow_step(stock_torch):
    """Why check_nan is off: torch's anomaly mode raises where the scaler would have skipped."""
    torch.set_anomaly_enabled(True, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="returned nan values"):
            _overflowing_step(torch.amp.GradScaler("cpu", init_scale=2.0**20))


def test_overflow_step_is_skipped_not_aborted(reinstall):
    reinstall(AMPGUARD_ENABLE="anomaly")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    assert isinstance(scaler, ampguard.SafeGradScaler)
    model, before = _overflowing_step(scaler)
    assert scaler.stats.skipped == 1
    for param, old in zip(model.parameters(), before):
        assert torch.equal(param, old)
    assert scaler.get_scale() == 2.0**19


def test_backward_errors_still_name_the_forward_line(reinstall):
    reinstall(AMPGUARD_ENABLE="anomaly")
    leaf = torch.randn(3, requires_grad=True)
    out = leaf.sigmoid()
    out.mul_(2)  # the in-place change that breaks SigmoidBackward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
    assert traces and "out = leaf.sigmoid()" in traces[0]


@pytest.mark.parametrize("previous", [(False, True), (True, True)])
def test_revert_restores_the_previous_mode(reinstall, previous):
    ampguard.uninstall()
    torch.set_anomaly_enabled(*previous)
    reinstall(AMPGUARD_ENABLE="anomaly")
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == (True, False)
    ampguard.uninstall()
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == previous


def test_measure_cost_shows_the_slowdown():
    result = anomaly.measure_cost(steps=6, width=64, depth=4, batch=16, rounds=2)
    assert set(result["seconds_per_step"]) == {"off", "anomaly_check_nan_off", "anomaly_check_nan_on"}
    assert result["slowdown_check_nan_off"] > 1.2
    assert not torch.is_anomaly_enabled()
