"""The contract every patch of the registry keeps (ddtrace's PatchTestCase, applied to each patch alone).

For each patch, installed by itself: it changes something; installing again changes nothing more;
uninstalling puts back every object it replaced, by identity, every global hook it added is gone and
every process-wide mode it switched is back;
installing after that applies it again, the same way. The objects compared are the attributes of every
namespace a patch of ampguard touches (modules and classes of torch), and torch's global hook tables.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ampguard
from ampguard import registry
from ampguard.patch import torch_release
from ampguard.scaler import listeners

_MODULES = (
    "torch",
    "torch.amp",
    "torch.amp.grad_scaler",
    "torch.amp.autocast_mode",
    "torch.cuda.amp",
    "torch.cpu.amp",
    "torch.nn.utils",
    "torch.nn.utils.clip_grad",
    "torch.optim.optimizer",
    "torch.optim.lr_scheduler",
    "torch.autograd",
    "torch.autograd.anomaly_mode",
    "torch.nn.modules.module",
)
_CLASSES = (
    "torch.amp.GradScaler",
    "torch.optim.Optimizer",
    "torch.optim.lr_scheduler.LRScheduler",
    "torch.nn.Module",
    "torch.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
    "torch.autograd.detect_anomaly",
    "torch.autograd.set_detect_anomaly",
)
# torch's process-wide hook tables (OrderedDicts of handle id -> hook)
_HOOK_TABLES = (
    ("torch.optim.optimizer", "_global_optimizer_pre_hooks"),
    ("torch.optim.optimizer", "_global_optimizer_post_hooks"),
    ("torch.nn.modules.module", "_global_forward_pre_hooks"),
    ("torch.nn.modules.module", "_global_forward_hooks"),
    ("torch.nn.modules.module", "_global_forward_hooks_always_called"),
)


def _resolve(path: str) -> Any:
    module_name, _, attribute = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ImportError:
        return getattr(importlib.import_module(module_name), attribute)


def _snapshot() -> dict[str, int]:
    """id() of every attribute of the namespaces ampguard's patches touch, and of each global hook."""
    seen: dict[str, int] = {}
    for path in (*_MODULES, *_CLASSES):
        namespace = _resolve(path)
        if not isinstance(namespace, (types.ModuleType, type)):
            continue
        for name, value in list(vars(namespace).items()):
            seen[f"{path}.{name}"] = id(value)
    for module_name, table in _HOOK_TABLES:
        for key, hook in getattr(sys.modules[module_name], table, {}).items():
            seen[f"{module_name}.{table}[{key}]"] = id(hook)
    # the step listeners patches register with the scaler (ampguard.scaler.listeners), in order
    seen["ampguard.scaler.listeners.registered()"] = hash(tuple(id(listener) for listener in listeners.registered()))
    # process-wide modes a patch may switch (the anomaly patch): their values, not ids
    seen["torch.is_anomaly_enabled()"] = int(torch.is_anomaly_enabled())
    seen["torch.is_anomaly_check_nan_enabled()"] = int(torch.is_anomaly_check_nan_enabled())
    return seen


def _changed(before: dict[str, int], after: dict[str, int]) -> set[str]:
    return {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}


def _install_alone(monkeypatch: pytest.MonkeyPatch, name: str) -> dict[str, str]:
    others = [patch for patch in registry.patch_names() if patch != name]
    monkeypatch.setenv("AMPGUARD_DISABLE", ",".join(others))
    monkeypatch.setenv("AMPGUARD_ENABLE", name)
    monkeypatch.setenv("AMPGUARD_QUIET", "1")
    return {entry.name: entry.state for entry in ampguard.install()}


@pytest.mark.parametrize("name", registry.patch_names())
def test_each_patch_applies_alone_once_and_reverts_by_identity(name, stock_torch, monkeypatch):
    stock = _snapshot()
    states = _install_alone(monkeypatch, name)
    assert states[name] == "applied", ampguard.status()
    assert {state for patch, state in states.items() if patch != name} == {"disabled"}
    applied = _snapshot()
    first = _changed(stock, applied)

    assert ampguard.install() == ampguard.status()  # installed already: nothing more happens
    assert _snapshot() == applied

    ampguard.uninstall()
    assert _snapshot() == stock, f"{name} left changed: {sorted(_changed(stock, _snapshot()))}"
    assert listeners.registered() == ()  # (the stock snapshot is taken after an uninstall too)

    assert _install_alone(monkeypatch, name)[name] == "applied"
    assert len(_changed(stock, _snapshot())) == len(first)  # applied again, the same number of changes
    ampguard.uninstall()
    assert _snapshot() == stock


def test_the_contract_sees_each_wrapping_patch_change_something(stock_torch, monkeypatch):
    """The snapshot above is not blind: the patches that wrap torch's objects show up in it."""
    stock = _snapshot()
    names = ["autocast", "grad_scaler", "clip_grad", "master_weights", "scheduler_hold", "anomaly"]
    if torch_release().release < (2, 4):
        names.remove("autocast")  # the legacy spellings warn from torch 2.4 on: before, it has nothing to undo
    for name in names:
        _install_alone(monkeypatch, name)
        assert _changed(stock, _snapshot()), f"{name} changed nothing the contract test looks at"
        ampguard.uninstall()


def test_an_optimizer_class_hooked_while_installed_runs_each_step_hook_once_after_uninstall(monkeypatch):
    """torch hooks an optimizer class's step once; uninstalling must leave it hooked once, not hooked again."""

    class Fresh(torch.optim.SGD):  # a class torch hooks now, while ampguard is installed
        pass

    calls = []
    handle = register_optimizer_step_pre_hook(lambda *args: calls.append(1))
    try:
        param = torch.nn.Parameter(torch.zeros(2))
        param.grad = torch.ones(2)
        Fresh([param], lr=0.1).step()
        ampguard.uninstall()
        ampguard.install()
        Fresh([param], lr=0.1).step()
        ampguard.uninstall()
        Fresh([param], lr=0.1).step()
    finally:
        handle.remove()
        ampguard.install()
    assert calls == [1, 1, 1]
