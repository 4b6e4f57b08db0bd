"""Skipped-step reports when the parameters themselves hold inf/NaN: said first, named, and not blamed on overflow.

The check costs a pass over the parameters and one host read, shared with the
gradient check, on reported skipped steps only (tests/scaler/test_diagnose.py checks
that healthy steps do no work).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from scaler_support import ampguard_log, recipe_step, records  # noqa: F401
from test_diagnose import _fresh_diagnose_state, make_model, reports  # noqa: F401

import ampguard
import ampguard.scaler.policy
from ampguard.scaler import diagnose


def _poison(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.view(-1)[3] = float("nan")


def _steps(model, optimizer, scaler, count: int, dtype=torch.float32) -> None:
    for _ in range(count):
        recipe_step(optimizer, scaler, lambda: model(torch.randn(4, 8, dtype=dtype)).float().square().mean())


def test_nan_weights_before_a_step_are_named_as_the_cause(ampguard_log):
    model = ampguard.watch(make_model(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _poison(model.block1.weight)
    _steps(model, optimizer, ampguard.SafeGradScaler("cpu"), 1)
    [record] = reports(ampguard_log)
    message = record.getMessage()
    assert record.levelno == logging.ERROR
    assert message.startswith("step 1 skipped at loss scale 1024: the parameters themselves hold inf/NaN: 1 of the 6")
    assert "block1.weight." in message and "block0" not in message
    assert "forward overflow" not in message and "bfloat16 (run" not in message


def test_a_watched_frozen_parameter_outside_the_optimizer_is_named(ampguard_log):
    model = ampguard.watch(make_model(2), prefix="base.")
    model.block0.requires_grad_(False)
    optimizer = torch.optim.SGD(model.block1.parameters(), lr=0.1)
    _poison(model.block0.weight)
    _steps(model, optimizer, ampguard.SafeGradScaler("cpu"), 1)
    message = reports(ampguard_log)[0].getMessage()
    assert "1 of the 4 parameters checked" in message and "base.block0.weight." in message


def test_float16_adamw_without_masters_is_reported_as_corrupted_weights(reinstall, ampguard_log):
    """The issue's case: AdamW steps float16 weights (masters off) and makes them NaN; the next step says so."""
    reinstall(AMPGUARD_MASTER_WEIGHTS="off")
    model = ampguard.watch(make_model(2)).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _steps(model, optimizer, ampguard.SafeGradScaler("cpu"), 3, dtype=torch.float16)
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    message = reports(ampguard_log)[0].getMessage()
    assert "the parameters themselves hold inf/NaN" in message and "AMPGUARD_MASTER_WEIGHTS" in message


def test_with_masters_the_same_run_has_nothing_to_report(ampguard_log):
    model = ampguard.watch(make_model(2)).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _steps(model, optimizer, ampguard.SafeGradScaler("cpu"), 3, dtype=torch.float16)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert reports(ampguard_log) == []


def test_stall_and_collapse_blame_the_parameters_not_clipping_or_bf16(reinstall, ampguard_log):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="3")
    model = ampguard.watch(make_model(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _poison(model.block0.bias)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=2.0)
    _steps(model, optimizer, scaler, 4)
    # The forward overflows whatever the scale, so whether the scale backs off into a collapse is the
    # forward-overflow policy's business: the collapse report is asked for directly.
    scaler._counters.collapse_reported = False
    scaler._report_collapse(1.0)
    critical = [r.getMessage() for r in records(ampguard_log, logging.CRITICAL)]
    assert len(critical) == 2
    for message in critical:
        assert "The parameters themselves hold inf/NaN (block0.bias)" in message
        assert "bf16" not in message and "clipped" not in message and "forward pass overflowed" not in message
    assert any(m.startswith("the loss scale collapsed") for m in critical)
    assert any(re.match(r"3 consecutive optimizer steps were skipped", m) for m in critical)


def test_parameters_note_is_empty_while_the_parameters_are_finite():
    scaler = ampguard.SafeGradScaler("cpu")
    assert diagnose.parameters_note(scaler) == ""
    model = make_model(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, optimizer, scaler, 1)
    with torch.no_grad():
        model.block0.weight.grad = None
    assert diagnose.parameters_note(scaler) == ""


@pytest.mark.parametrize("poisoned", [False, True])
def test_one_host_read_for_gradients_and_weights(poisoned, monkeypatch):
    model = make_model(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if poisoned:
        _poison(model.block1.weight)
    reads = []
    monkeypatch.setattr(diagnose, "read_to_host", lambda t: reads.append(t) or t.tolist())
    loss = model(torch.randn(2, 8)).square().mean()
    loss.backward()
    _grads, weights = diagnose.nonfinite_gradients_and_weights(optimizer)
    assert len(reads) == 1 and weights.total == int(poisoned) and weights.with_grad == 4
