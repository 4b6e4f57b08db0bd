"""Patch grad_scaler: every way of creating a GradScaler gives a SafeGradScaler, and uninstall restores torch."""

from __future__ import annotations

import contextlib
import functools
import importlib
import pickle
import sys
import textwrap

import pytest
import torch
from scaler_support import iteration, tiny

import ampguard
import ampguard.scaler
from ampguard.patches.grad_scaler import GradScaler as PatchedGradScaler
from ampguard.scaler import SafeGradScaler


def _originals():
    return {
        "torch.amp.GradScaler": torch.amp.GradScaler,
        "torch.GradScaler": torch.GradScaler,
        "torch.amp.grad_scaler.GradScaler": torch.amp.grad_scaler.GradScaler,
        "torch.cuda.amp.GradScaler": torch.cuda.amp.GradScaler,
        "torch.cpu.amp.GradScaler": torch.cpu.amp.GradScaler,
    }


def _works(scaler) -> None:
    """A scaler made through any name trains a step (on the CPU)."""
    model, opt = tiny()
    iteration(scaler, model, opt)
    assert scaler.stats.steps == 1


def test_modern_names_all_give_safegradscaler():
    assert torch.amp.GradScaler is torch.GradScaler is torch.amp.grad_scaler.GradScaler is PatchedGradScaler
    assert issubclass(PatchedGradScaler, SafeGradScaler) and PatchedGradScaler is not SafeGradScaler
    for make in (torch.amp.GradScaler, torch.GradScaler, torch.amp.grad_scaler.GradScaler):
        scaler = make("cpu")
        assert type(scaler) is PatchedGradScaler and scaler.get_scale() == 1024.0
        _works(scaler)
    mro = type(torch.amp.GradScaler(device="cpu", init_scale=8.0)).__mro__
    assert mro[1] is SafeGradScaler and mro[-2:] == (ampguard.scaler.TorchGradScaler, object)
    assert all(part.__module__.startswith("ampguard.scaler.") for part in mro[2:-2])  # SafeGradScaler's parts


def test_legacy_cuda_scaler_takes_init_scale_first(monkeypatch):
    no_cuda = not torch.cuda.is_available()
    with pytest.warns(UserWarning, match="CUDA is not available") if no_cuda else contextlib.nullcontext():
        scaler = torch.cuda.amp.GradScaler(1024.0)
    assert isinstance(scaler, SafeGradScaler) and scaler._device == "cuda"
    assert scaler._settings.init_scale == 1024.0
    # with CUDA "available", the legacy positional order maps onto torch's arguments
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    scaler = torch.cuda.amp.GradScaler(512.0, 3.0, 0.25, 7)
    assert scaler.is_enabled()
    assert (
        scaler.get_scale(),
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (
        512.0,
        3.0,
        0.25,
        7,
    )
    assert torch.cuda.amp.GradScaler().get_scale() == 1024.0
    assert torch.cuda.amp.GradScaler(enabled=False).is_enabled() is False
    assert torch.cuda.amp.GradScaler(init_scale=64.0, min_scale=0.0)._min_scale == 0.0


def test_legacy_cpu_scaler_takes_init_scale_first():
    scaler = torch.cpu.amp.GradScaler(512.0, 3.0, 0.25, 7)
    assert isinstance(scaler, SafeGradScaler) and scaler._device == "cpu"
    assert (
        scaler.get_scale(),
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (
        512.0,
        3.0,
        0.25,
        7,
    )
    _works(torch.cpu.amp.GradScaler())
    restored = pickle.loads(pickle.dumps(torch.cpu.amp.GradScaler(256.0)))
    assert type(restored) is torch.cpu.amp.GradScaler and restored.get_scale() == 256.0


EARLY_MODULE = textwrap.dedent(
    """
    import functools
    import torch
    from torch.amp import GradScaler
    from torch.cuda.amp import GradScaler as CudaScaler

    make_scaler = functools.partial(torch.GradScaler, device="cpu")   # as the coqui trainer holds it
    """
)


def test_names_bound_before_install_and_uninstall_restores_them(stock_torch, tmp_path, monkeypatch):
    originals = _originals()
    assert originals["torch.amp.GradScaler"] is ampguard.scaler.TorchGradScaler
    (tmp_path / "early_trainer.py").write_text(EARLY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "early_trainer", raising=False)
    early = importlib.import_module("early_trainer")
    partial = early.make_scaler
    assert early.GradScaler is originals["torch.amp.GradScaler"] and partial.func is originals["torch.GradScaler"]

    ampguard.install()
    assert early.GradScaler is PatchedGradScaler
    assert issubclass(early.CudaScaler, SafeGradScaler)
    assert early.make_scaler is partial and partial.func is PatchedGradScaler  # retargeted in place
    scaler = early.make_scaler()
    assert type(scaler) is PatchedGradScaler and scaler._device == "cpu" and scaler.get_scale() == 1024.0
    _works(scaler)
    _works(early.GradScaler("cpu"))
    assert isinstance(functools.partial(torch.GradScaler, device="cpu")(), SafeGradScaler)

    ampguard.uninstall()
    assert _originals() == originals  # the identical class objects
    assert early.GradScaler is originals["torch.amp.GradScaler"]
    assert early.CudaScaler is originals["torch.cuda.amp.GradScaler"]
    assert partial.func is originals["torch.GradScaler"] and partial.keywords == {"device": "cpu"}
    assert type(early.make_scaler()) is originals["torch.GradScaler"]
    assert type(torch.amp.GradScaler("cpu")).__module__ == "torch.amp.grad_scaler"
    monkeypatch.delitem(sys.modules, "early_trainer")


def test_install_again_patches_again(stock_torch):
    assert torch.GradScaler is ampguard.scaler.TorchGradScaler
    ampguard.install()
    assert torch.GradScaler is PatchedGradScaler and issubclass(torch.cpu.amp.GradScaler, PatchedGradScaler)


def test_disabled_patch_leaves_torch_alone(reinstall):
    reinstall(AMPGUARD_DISABLE="grad_scaler")
    assert torch.amp.GradScaler is ampguard.scaler.TorchGradScaler
    assert not issubclass(torch.cuda.amp.GradScaler, SafeGradScaler)
    assert SafeGradScaler("cpu").get_scale() == 1024.0  # the class itself still works when asked for
