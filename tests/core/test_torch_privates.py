"""A future torch that renames an internal ampguard relies on: that patch is unavailable with the name, the rest apply."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.amp.grad_scaler as grad_scaler

import ampguard
from ampguard import torch_privates
from ampguard.registry import _registry


def _statuses(monkeypatch: pytest.MonkeyPatch, change: Callable[[pytest.MonkeyPatch], None]) -> dict[str, list[str]]:
    """ampguard installed over a torch with ``change`` made to it (torch's own classes: ampguard uninstalled
    first), a plain step with a clip (the other patches still work), and the patches' statuses. Installing is
    where ``import ampguard`` decides each patch (registry._decide), so this process need not be a fresh one; the
    change is undone and the default installation made again before the test ends."""
    ampguard.uninstall()
    try:
        change(monkeypatch)
        ampguard.install()
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the other patches still work
        opt.step()
        return {s.name: [s.state, s.reason] for s in ampguard.status()}
    finally:
        ampguard.uninstall()
        monkeypatch.undo()
        ampguard.install()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda mp: mp.delattr(grad_scaler, "_refresh_per_optimizer_state"),
            "torch has no torch.amp.grad_scaler._refresh_per_optimizer_state",
        ),
        (lambda mp: mp.delattr(grad_scaler, "OptState"), "torch has no torch.amp.grad_scaler.OptState"),
        (
            lambda mp: mp.setattr(
                grad_scaler.GradScaler, "_unscale_grads_", lambda self, optimizer, inv_scale, found_inf: {}
            ),
            "torch.amp.grad_scaler.GradScaler._unscale_grads_ takes (self, optimizer, inv_scale, found_inf), "
            "ampguard calls it with (self, optimizer, inv_scale, found_inf, allow_fp16)",
        ),
    ],
    ids=["function_removed", "enum_removed", "signature_changed"],
)
def test_a_changed_private_makes_its_patch_unavailable_with_the_name(change, named, monkeypatch):
    statuses = _statuses(monkeypatch, change)
    assert statuses["grad_scaler"] == ["unavailable", f"a torch internal it relies on changed: {named}"]
    assert statuses["autocast"][0] == statuses["clip_grad"][0] == "applied"


def test_every_declared_private_exists_in_this_torch():
    for patch in _registry.patches:
        assert torch_privates.problem(patch.requires_privates) is None, patch.name


def test_problem_names_what_is_missing():
    assert torch_privates.problem([torch_privates.Private("torch.no_such_thing")]) == "torch has no torch.no_such_thing"
    assert (
        torch_privates.problem([torch_privates.Private("torch.amp.grad_scaler.GradScaler.step", ("self", "optimizer"))])
        is None
    )
    hook = "torch.nn.modules.module.register_module_forward_hook"
    assert torch_privates.problem([torch_privates.Private(hook, keywords=("always_call",))]) is None
    assert torch_privates.problem([torch_privates.Private(hook, keywords=("always_call", "sometimes_call"))]) == (
        f"{hook} has no sometimes_call parameter"
    )
