"""The deepspeed_fp16 patch as a patch: import order, version gate, AMPGUARD_DEEPSPEED, uninstall by identity.

deepspeed imported before ampguard is here; imported after it (the post-import hook), in the training process of
tests/deepspeed_fp16/test_deepspeed_fp16_engine.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import ampguard
import ampguard.deepspeed_fp16.tracking as tracking
from ampguard.deepspeed_fp16.patch import SUPPORTED, unsupported

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (DS_BUILD_OPS=0 pip install deepspeed)"
)


@pytest.mark.parametrize("version", ["0.18.9", "0.19.7", "0.20.0", "1.0.0"])
def test_a_deepspeed_outside_the_verified_versions_is_named_with_its_version(version):
    assert unsupported(types.SimpleNamespace(__version__=version)) == f"needs deepspeed {SUPPORTED}, this is {version}"


def test_a_deepspeed_without_a_readable_version_is_left_alone():
    assert "reports its version as 'unknown'" in str(unsupported(types.SimpleNamespace(__version__="unknown")))


def test_an_unsupported_deepspeed_imported_before_install_makes_the_patch_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    sys.modules["deepspeed"].__version__ = "0.16.2"  # type: ignore[attr-defined]
    try:
        ampguard.uninstall()
        statuses = {status.name: status for status in ampguard.install()}
        assert statuses["deepspeed_fp16"].state == "unavailable"
        assert statuses["deepspeed_fp16"].reason == f"needs deepspeed {SUPPORTED}, this is 0.16.2"
    finally:
        monkeypatch.undo()
        ampguard.uninstall()
        ampguard.install()


@pytest.mark.parametrize("anything", [None, {}, [1], object(), 3.0])
def test_looking_up_counts_for_an_object_deepspeed_never_made_finds_none(anything):
    """The HF Trainer's callback asks for any optimizer's counts: no answer, and no error, for the others."""
    assert tracking.of(anything) is None


# Run in a fresh process: DeepSpeed imported BEFORE ampguard, then uninstall / install / AMPGUARD_DEEPSPEED=off.
_IMPORT_ORDER = textwrap.dedent(
    """
    import os
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    zero = (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
    optimizers = (FP16_UnfusedOptimizer, FP16_Optimizer, *zero)
    classes = (DeepSpeedFP16Config, DynamicLossScaler, DeepSpeedEngine, *optimizers)
    stock = [dict(vars(owner)) for owner in classes]

    def same_as_stock():
        return all(
            vars(owner).keys() == before.keys() and all(vars(owner)[k] is v for k, v in before.items())
            for owner, before in zip(classes, stock)
        )

    def starts():
        default = DeepSpeedFP16Config(enabled=True)
        chosen = DeepSpeedFP16Config(enabled=True, initial_scale_power=12)
        return (
            default.dynamic_loss_scale_args()["init_scale"],
            default.initial_dynamic_scale(),
            chosen.dynamic_loss_scale_args()["init_scale"],
            chosen.initial_dynamic_scale(),
        )

    assert same_as_stock() and starts() == (65536, 65536, 4096, 4096)
    import ampguard  # after deepspeed

    assert not same_as_stock(), "deepspeed imported first was not patched"
    assert starts() == (1024, 1024, 4096, 4096), starts()
    changed = {
        (owner.__name__, name)
        for owner, before in zip(classes, stock)
        for name in vars(owner)
        if vars(owner)[name] is not before.get(name)
    }
    assert changed == {
        ("DeepSpeedFP16Config", "dynamic_loss_scale_args"),
        ("DeepSpeedFP16Config", "initial_dynamic_scale"),
        ("DynamicLossScaler", "update_scale"),
        ("FP16_UnfusedOptimizer", "_update_scale"),
        ("FP16_Optimizer", "_update_scale"),
        ("DeepSpeedEngine", "backward"),
        ("DeepSpeedEngine", "scale"),
        *((owner.__name__, name) for owner in optimizers for name in ("state_dict", "load_state_dict")),
    }, changed
    ampguard.uninstall()
    assert same_as_stock() and starts() == (65536, 65536, 4096, 4096)
    ampguard.install()
    assert not same_as_stock() and starts() == (1024, 1024, 4096, 4096)
    ampguard.uninstall()
    os.environ["AMPGUARD_DEEPSPEED"] = "off"
    ampguard.install()
    assert same_as_stock()
    ampguard.uninstall()
    os.environ["AMPGUARD_DEEPSPEED"] = "on"
    os.environ["AMPGUARD_INIT_SCALE"] = "300"  # rounded down to a power of two: DeepSpeed's config takes powers
    ampguard.install()
    assert starts() == (256, 256, 4096, 4096), starts()
    print("ok")
    """
)


def _run_fresh(code: str) -> None:
    """``code`` in a fresh interpreter (its own DeepSpeed import), which must print "ok" last."""
    env = {"PATH": "", "AMPGUARD_QUIET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_deepspeed
def test_deepspeed_imported_before_ampguard_is_patched_and_uninstall_restores_it_by_identity():
    _run_fresh(_IMPORT_ORDER)


def test_each_engine_s_forward_overflow_is_judged_by_its_own_losses():
    """Two engines trained side by side: one engine's inf losses are not the other's forward overflow (a review
    found engine A's gradient overflows taken for forward overflows, because B's losses were inf, so A's scale was
    never lowered and A skipped every step). The losses are kept per engine and looked up by the step's owner: the
    fp16 optimizer (ZeRO 0) or its loss scaler (ZeRO 1-3)."""
    import ampguard.deepspeed_fp16.losses as losses

    class Engine(torch.nn.Module):  # what the losses module reads of a DeepSpeedEngine: its optimizer
        def __init__(self, optimizer: object) -> None:
            super().__init__()
            self.optimizer = optimizer

    backward = losses.engine_backward(lambda engine, loss: None, policy=None)  # (DeepSpeed's method: nothing here)
    scaler_a = types.SimpleNamespace()
    engine_a = Engine(types.SimpleNamespace(loss_scaler=scaler_a))  # ZeRO 1-3: the scaler steps it
    optimizer_b = types.SimpleNamespace()
    engine_b = Engine(optimizer_b)  # ZeRO 0: the fp16 optimizer steps it
    for _ in range(2):
        backward(engine_a, torch.tensor(1.5))
        backward(engine_b, torch.tensor(float("inf")))
    assert losses.forward_overflow(True, scaler_a) is False  # A's gradients overflowed: a scale matter
    assert losses.forward_overflow(True, optimizer_b) is True  # B's loss itself was inf
    backward(engine_a, torch.tensor(float("nan")))
    assert losses.forward_overflow(True, optimizer_b) is False  # B kept nothing since its step
    assert losses.forward_overflow(True, scaler_a) is True
