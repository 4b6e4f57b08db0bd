"""fp32 masters (issue 20): optimizer state kept exactly as torch keeps it, against the float32 run.

Each test puts the same event in the float16 run (with masters) and in the
float32 run from the same rounded start, and compares parameters and
optimizer state after a few more steps (momentum lost or a parameter left
untrained is 1e-2 or more; rounding stays below the tolerance).
"""

from __future__ import annotations

import pytest
import torch
from master_events_support import Run, assert_like, model_of, sgd
from scaler_support import one_thread  # noqa: F401

import ampguard

pytestmark = pytest.mark.usefixtures("one_thread")


def pair(make_optimizer=lambda params: sgd(params)) -> tuple[Run, Run]:
    runs = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        runs.append(Run(model, [make_optimizer(list(model.parameters()))], dtype))
    return runs[0], runs[1]


def test_a_parameter_frozen_while_param_groups_change_keeps_its_momentum_when_unfrozen():
    """Freeze a layer, add a param group (the masters are rebuilt), unfreeze: torch resumes its momentum."""
    half, full = pair(lambda params: sgd(params[:3]))
    half.steps(3)
    full.steps(3)
    for run in (half, full):
        first = next(run.model.parameters())
        first.requires_grad_(False)
        run.optimizers[0].add_param_group({"params": list(run.model.parameters())[3:]})
    half.steps(1)
    full.steps(1)
    for run in (half, full):
        next(run.model.parameters()).requires_grad_(True)
    half.steps(3)
    full.steps(3)
    assert_like(half, full)


def test_a_parameter_replaced_in_place_in_param_groups_is_trained_like_torch():
    """``group["params"][i] = new`` (a resized embedding put back into the optimizer): torch steps the new one."""
    half, full = pair()
    half.steps(3)
    full.steps(3)
    for run in (half, full):
        layer = run.model[2]
        replacement = torch.nn.Parameter(layer.weight.detach().clone())
        params = run.optimizers[0].param_groups[0]["params"]
        params[next(i for i, p in enumerate(params) if p is layer.weight)] = replacement
        layer.weight = replacement
    half.steps(3)
    full.steps(3)
    for (name, p), q in zip(half.model.named_parameters(), full.model.parameters()):
        torch.testing.assert_close(p.float(), q, atol=2e-3, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_an_optimizer_that_has_state_when_ampguard_is_installed_again_keeps_it():
    """uninstall() then install() mid-run (or an optimizer stepped before ampguard was imported): torch keeps momentum."""
    half, full = pair()
    half.steps(5)
    full.steps(5)
    ampguard.uninstall()
    try:
        half.steps(1)
        full.steps(1)
    finally:
        ampguard.install()
    half.steps(3)
    full.steps(3)
    assert_like(half, full)


def test_a_model_reset_for_a_new_optimizer_while_the_old_one_lives_trains_from_what_was_loaded():
    """A sweep: ``model.load_state_dict(init)``, a new optimizer, the previous one still held (a results list)."""
    finals = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        start = {name: value.clone() for name, value in model.state_dict().items()}
        kept = []
        for lr in (0.05, 0.02):
            model.load_state_dict(start)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            Run(model, [optimizer], dtype).steps(3)
            kept.append(optimizer)
        finals.append(model)
    for (name, p), q in zip(finals[0].named_parameters(), finals[1].parameters()):
        torch.testing.assert_close(p.float(), q, atol=2e-3, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_a_parameter_taken_out_of_param_groups_and_put_back_keeps_its_momentum():
    """torch keeps ``state[p]`` while ``p`` is out of ``param_groups``: put back, it resumes its momentum."""
    half, full = pair()
    half.steps(3)
    full.steps(3)
    for run in (half, full):
        group = run.optimizers[0].param_groups[0]
        group["params"] = group["params"][1:]
    half.steps(2)
    full.steps(2)
    for run in (half, full):
        group = run.optimizers[0].param_groups[0]
        group["params"] = [next(run.model.parameters()), *group["params"]]
    half.steps(3)
    full.steps(3)
    assert_like(half, full)
