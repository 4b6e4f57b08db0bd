"""Fault injection: every ampguard hook on the training path, forced to raise, leaves torch's results and one WARNING."""

from __future__ import annotations

import logging

import pytest
import torch
from scaler_support import (  # noqa: F401
    OPTIMIZER_PARAMS,
    ampguard_log,
    records,
    safe,
    same_parameters,
    stock,
    train,
)

import ampguard.clip_grad.norm
import ampguard.fp32_islands.iteration_ends
import ampguard.scaler.accounting
import ampguard.scaler.iteration
import ampguard.scaler.policy
import ampguard.scheduler_hold.hold
from ampguard import containment
from ampguard.fp32_islands.healing import Healing

FAULTS = {3, 4, 11}  # skipped steps, so that the skip paths run too
SETTINGS = {"init_scale": 1024.0, "growth_interval": 5}  # growth within the run

# (module or class, attribute): each is ampguard's own work inside a training step.
HOOKS = [
    (ampguard.scaler.iteration.Iteration, "note_loss"),  # scale(): the loss check
    (Healing, "add_verdict"),  # step(): what rides on the one host read
    (Healing, "note_verdict"),  # update(): what the host learned from it
    (ampguard.scheduler_hold.hold, "note_step"),
    (ampguard.scaler.policy, "next_scale"),  # update(): the host mirror of the scale
    (ampguard.fp32_islands.iteration_ends, "end_iteration"),
    (ampguard.scaler.accounting, "log_stats"),  # the stats line
    (ampguard.clip_grad.norm, "_recipe_case"),  # clip_grad_norm_ after unscale_: the recipe's case
]


class Injected(Exception):
    pass


def _raise(*args, **kwargs):
    raise Injected("injected fault")


@pytest.fixture(autouse=True)
def _fresh_reports(monkeypatch):
    monkeypatch.setattr(containment, "_reported", set())


@pytest.mark.parametrize(
    ("module", "name"),
    HOOKS,
    ids=[f"{f'{m.__module__}.{m.__qualname__}' if isinstance(m, type) else m.__name__}.{n}" for m, n in HOOKS],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_failing_hook_leaves_torchs_results_and_one_warning(
    module, name, optimizer, monkeypatch, ampguard_log, reinstall
):
    reinstall(AMPGUARD_STATS_EVERY="4")
    reference = train(stock(**SETTINGS), optimizer=optimizer, steps=16, faults=FAULTS, clip=True)
    monkeypatch.setattr(module, name, _raise)
    run = train(safe(**SETTINGS), optimizer=optimizer, steps=16, faults=FAULTS, clip=True)
    assert same_parameters(run.model, reference.model)
    assert run.scaler.get_scale() == reference.scaler.get_scale()
    warnings = records(ampguard_log, logging.WARNING, "failed (Injected: injected fault)")
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "torch's behaviour is used instead for this call" in warnings[0].getMessage()
    debug = records(ampguard_log, logging.DEBUG, "failed")
    assert debug and all(r.exc_info for r in debug)  # the traceback, every time


@pytest.mark.parametrize("make", [stock, safe], ids=["torch", "ampguard"])
def test_torchs_own_errors_inside_a_hook_still_reach_the_caller(make):
    """torch's update() raises on a bad new_scale from inside ampguard's contained update(): it stays torch's error."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    with pytest.raises((AssertionError, ValueError), match="new_scale should be a float or a 1-element"):
        scaler.update(torch.ones(2))


def test_intended_errors_pass_through_the_clip(monkeypatch):
    model = torch.nn.Linear(2, 1)
    scaler = safe()
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("as_generator", [False, True], ids=["list", "generator"])
def test_a_failing_clip_grad_value_falls_back_to_torchs(as_generator, monkeypatch, ampguard_log):
    import ampguard.clip_grad.api

    monkeypatch.setattr(ampguard.clip_grad.api, "_clamp_", _raise)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    scaler = safe()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 4)).pow(2).sum() * 10).backward()
    scaler.unscale_(opt)
    expected = [p.grad.clamp(-0.5, 0.5) for p in model.parameters()]
    params = (p for p in model.parameters()) if as_generator else list(model.parameters())
    torch.nn.utils.clip_grad_value_(params, 0.5)
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))  # every parameter, once
    assert len(records(ampguard_log, logging.WARNING, "safe clip_grad_value_ failed (Injected")) == 1


def test_torchs_own_clip_errors_get_no_warning(ampguard_log):
    model = torch.nn.Linear(2, 1)
    scaler = safe()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.raises(TypeError):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, 2.0, False, None, "an argument too many")
    assert not records(ampguard_log, logging.WARNING, "failed")
