"""A future torch that renames an internal ampguard relies on: that patch is unavailable with the name, the rest apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ampguard import torch_privates
from ampguard.registry import _registry

SCRIPT = """
import json, sys, torch
import torch.amp.grad_scaler as grad_scaler
{change}
import ampguard
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.ones(2, 4)).sum()
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the other patches still work
opt.step()
print(json.dumps({{s.name: [s.state, s.reason] for s in ampguard.status()}}))
"""


def _statuses(change: str) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(change=change)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            "del grad_scaler._refresh_per_optimizer_state",
            "torch has no torch.amp.grad_scaler._refresh_per_optimizer_state",
        ),
        ("del grad_scaler.OptState", "torch has no torch.amp.grad_scaler.OptState"),
        (
            "grad_scaler.GradScaler._unscale_grads_ = lambda self, optimizer, inv_scale, found_inf: {}",
            "torch.amp.grad_scaler.GradScaler._unscale_grads_ takes (self, optimizer, inv_scale, found_inf), "
            "ampguard calls it with (self, optimizer, inv_scale, found_inf, allow_fp16)",
        ),
    ],
    ids=["function_removed", "enum_removed", "signature_changed"],
)
def test_a_changed_private_makes_its_patch_unavailable_with_the_name(change, named):
    statuses = _statuses(change)
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
