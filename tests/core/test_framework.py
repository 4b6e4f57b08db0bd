"""The patch framework: registry, install/uninstall, status, version gates, names bound earlier."""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import sys
import threading
import types

import pytest
import torch
from banner_support import banners_after_install

import ampguard
import ampguard.scaler
from ampguard import registry
from ampguard.bindings import Bindings, rebind_queued
from ampguard.errors import PatchUnavailable
from ampguard.patch import Patch, torch_release


def _states() -> dict[str, str]:
    return {entry.name: entry.state for entry in ampguard.status()}


def test_status_has_one_entry_per_registered_patch():
    entries = ampguard.status()
    assert [e.name for e in entries] == registry.patch_names()
    for entry in entries:
        assert entry["state"] in {"applied", "disabled", "unavailable"}
        assert set(entry.as_dict()) == {"name", "state", "reason", "summary"}
        assert entry.summary
    assert _states()["autocast"] == "applied" and _states()["grad_scaler"] == "applied"


def test_install_is_idempotent():
    before = torch.amp.GradScaler
    assert ampguard.install() == ampguard.status()
    assert torch.amp.GradScaler is before


def test_uninstall_restores_the_identical_objects(stock_torch):
    originals = (
        torch.amp.GradScaler,
        torch.GradScaler,
        torch.cuda.amp.GradScaler,
        torch.cuda.amp.autocast.__dict__.copy(),
    )
    ampguard.install()
    assert torch.amp.GradScaler is not originals[0]
    ampguard.uninstall()
    assert (torch.amp.GradScaler, torch.GradScaler, torch.cuda.amp.GradScaler) == originals[:3]
    assert torch.cuda.amp.autocast.__dict__ == originals[3]
    assert set(_states().values()) == {"disabled"}


def test_install_is_thread_safe(stock_torch):
    barrier = threading.Barrier(8)
    results = []

    def worker() -> None:
        barrier.wait()
        results.append(ampguard.install())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({tuple(r) for r in results}) == 1
    assert issubclass(torch.amp.GradScaler, ampguard.SafeGradScaler)
    ampguard.uninstall()
    assert torch.amp.GradScaler is ampguard.scaler.TorchGradScaler  # one install, undone once


def test_master_switch_patches_nothing(reinstall):
    statuses = reinstall(AMPGUARD="0")
    assert {s.state for s in statuses} == {"disabled"}
    assert {s.reason for s in statuses} == {"AMPGUARD=0"}
    assert torch.amp.GradScaler is not ampguard.SafeGradScaler


def test_disable_by_name(reinstall):
    reinstall(AMPGUARD_DISABLE="grad_scaler")
    assert _states()["grad_scaler"] == "disabled" and _states()["autocast"] == "applied"
    assert torch.amp.GradScaler is not ampguard.SafeGradScaler


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.4.0a0+git1234abc", "2.4.0"),
        ("2.4.0.dev20240501", "2.4.0"),
        ("2.4.0rc1", "2.4.0"),
        ("2.4.1+cu121", "2.4.1"),
        ("2.13.0+cpu", "2.13.0"),
    ],
)
def test_version_gate_uses_release_numbers(version, release):
    assert str(torch_release(version)) == release

    class NeedsTwoFour(Patch):
        name = "needs_2_4"
        summary = "test"
        requires_torch = ">=2.4"

    assert NeedsTwoFour().supports(version)
    assert not NeedsTwoFour().supports("2.3.1+cu121")


def test_old_torch_reports_unavailable_with_reason(stock_torch, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.1.2+cu118")
    ampguard.install()
    entry = {e.name: e for e in ampguard.status()}["grad_scaler"]
    assert entry.state == "unavailable"
    assert entry.reason == "needs torch >=2.3, this is 2.1.2"
    assert torch.amp.GradScaler is not ampguard.SafeGradScaler


def test_a_patch_asked_for_by_name_that_cannot_apply_is_an_error_with_the_reason(stock_torch, monkeypatch):
    """sentry-sdk's DidNotEnable: a default patch that cannot apply is skipped quietly; one named is an error."""
    monkeypatch.setattr(torch, "__version__", "2.1.2+cu118")
    monkeypatch.setenv("AMPGUARD_ENABLE", "grad_scaler")
    with pytest.raises(ampguard.ConfigError) as raised:
        ampguard.install()
    message = str(raised.value)
    assert "AMPGUARD_ENABLE names grad_scaler, which cannot apply here: needs torch >=2.3, this is 2.1.2" in message
    assert "ampguard patches" in message
    assert not ampguard.registry.is_installed() and torch.amp.GradScaler is not ampguard.SafeGradScaler
    monkeypatch.delenv("AMPGUARD_ENABLE")
    assert {e.state for e in ampguard.install()} <= {"unavailable", "disabled"}  # not named: skipped quietly


class _Exploding(Patch):
    name = "exploding"
    summary = "fails half way through apply"

    def apply(self, config):
        self.bindings.set_attribute(torch, "_ampguard_test_marker", 1)
        raise RuntimeError("torch internals changed")


class _Refusing(Patch):
    name = "refusing"
    summary = "cannot apply here"

    def apply(self, config):
        raise PatchUnavailable("no such kernel on this build")


def test_a_failing_patch_is_reported_reverted_and_the_rest_apply(stock_torch, monkeypatch, caplog):
    monkeypatch.setattr(registry._registry, "patches", [_Exploding(), _Refusing(), *registry._registry.patches])
    caplog.set_level(logging.WARNING, logger="ampguard")
    monkeypatch.setattr(logging.getLogger("ampguard"), "propagate", True)
    ampguard.install()
    entries = {e.name: e for e in ampguard.status()}
    assert entries["exploding"].state == "unavailable"
    assert entries["exploding"].reason == "failed to apply: RuntimeError: torch internals changed"
    assert entries["refusing"].state == "unavailable" and entries["refusing"].reason == "no such kernel on this build"
    assert not hasattr(torch, "_ampguard_test_marker")  # the half-applied change was undone
    assert entries["grad_scaler"].state == "applied"
    assert "could not be applied" in caplog.text and "exploding" in caplog.text
    ampguard.uninstall()


def test_names_bound_earlier_are_rebound_and_restored(stock_torch):
    original = torch.amp.GradScaler
    module = types.ModuleType("user_training_script")
    module.GradScaler = original
    module.LegacyScaler = torch.cuda.amp.GradScaler
    module.make_scaler = functools.partial(torch.GradScaler, device="cuda")
    held_elsewhere = module.make_scaler
    sys.modules[module.__name__] = module
    try:
        ampguard.install()
        assert module.GradScaler is torch.amp.GradScaler and issubclass(module.GradScaler, ampguard.SafeGradScaler)
        assert issubclass(module.LegacyScaler, ampguard.SafeGradScaler)
        assert held_elsewhere.func is torch.amp.GradScaler  # the very same partial object
        assert held_elsewhere.keywords == {"device": "cuda"}
        ampguard.uninstall()
        assert module.GradScaler is original
        assert module.LegacyScaler is torch.cuda.amp.GradScaler
        assert held_elsewhere.func is original and held_elsewhere.keywords == {"device": "cuda"}
    finally:
        del sys.modules[module.__name__]


def test_bindings_undo_restores_inherited_and_own_attributes():
    class Base:
        def method(self):
            return "base"

    class Child(Base):
        pass

    bindings = Bindings("test")
    bindings.set_attribute(Child, "method", lambda self: "patched")
    assert Child().method() == "patched"
    bindings.undo()
    assert "method" not in vars(Child) and Child().method() == "base"


def test_rebind_skips_ampguard_modules():
    marker = object()
    replacement = object()
    mine = types.ModuleType("ampguard._test_holder")
    theirs = types.ModuleType("their_module")
    mine.x = theirs.x = marker
    sys.modules.update({mine.__name__: mine, theirs.__name__: theirs})
    try:
        bindings = Bindings("test")
        bindings.rebind_names_of(marker, replacement)
        assert rebind_queued([bindings]) == 1
        assert mine.x is marker and theirs.x is replacement
        bindings.undo()
        assert theirs.x is marker
    finally:
        del sys.modules[mine.__name__], sys.modules[theirs.__name__]


@pytest.fixture(scope="module")
def fresh_interpreter() -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (no AMPGUARD_* variable) that imports ampguard, installs it again, and prints the
    root logger's handler count and level."""
    code = (
        "import logging, ampguard; ampguard.uninstall(); ampguard.install(); root = logging.getLogger(); "
        "print(len(root.handlers), root.level)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": ""}, check=True)


def test_root_logger_is_never_configured(fresh_interpreter):
    assert fresh_interpreter.stdout.split() == ["0", str(logging.WARNING)]


def test_banner_names_the_applied_patches_once_per_process(fresh_interpreter):
    stderr = fresh_interpreter.stderr
    assert stderr.count("ampguard: ") == 1
    line = stderr.strip().splitlines()[-1]
    assert re.search(r"^ampguard: \S+ on torch [\d.]+: patched autocast, grad_scaler", line), line


@pytest.mark.parametrize(
    ("variables", "shown"),
    [
        ({"AMPGUARD_QUIET": "1"}, False),
        ({"AMPGUARD_QUIET": "0", "RANK": "1", "LOCAL_RANK": "1"}, False),
        ({"AMPGUARD_QUIET": "0", "RANK": "0", "LOCAL_RANK": "0"}, True),
    ],
)
def test_banner_is_silenced_and_only_on_rank_zero(monkeypatch, variables, shown):
    """The banner an install shows in a process that has shown none yet (banner_support)."""
    banners = banners_after_install(monkeypatch, **variables)()
    assert [("patched autocast" in banner) for banner in banners] == ([True] if shown else [])


def test_a_handler_the_user_attached_is_respected():
    code = (
        "import logging, io; stream = io.StringIO(); logging.getLogger('ampguard').addHandler(logging.StreamHandler(stream));"
        "logging.getLogger('ampguard').setLevel(logging.INFO); import ampguard; print(stream.getvalue().strip())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": ""}, check=True)
    assert "patched autocast" in result.stdout and result.stderr == ""


def test_modules_imported_while_installed_get_the_originals_back(stock_torch):
    original_scaler, original_clip = torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_
    ampguard.install()
    module = types.ModuleType("imported_while_installed")
    module.GradScaler = torch.amp.GradScaler  # what `from torch.amp import GradScaler` binds now
    module.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
    module.make_scaler = functools.partial(torch.GradScaler, device="cuda")
    module.SafeGradScaler = ampguard.SafeGradScaler  # the user asked for ampguard's class by name: kept
    sys.modules[module.__name__] = module
    try:
        ampguard.uninstall()
        assert module.GradScaler is original_scaler
        assert module.clip_grad_norm_ is original_clip
        assert module.make_scaler.func is original_scaler and module.make_scaler.keywords == {"device": "cuda"}
        assert module.SafeGradScaler is ampguard.SafeGradScaler
    finally:
        del sys.modules[module.__name__]
