"""Patch ``autocast``: legacy spellings behave as torch.amp's, without FutureWarnings, identities kept."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import ampguard
from ampguard.patch import torch_release

WARNS_ON_LEGACY = torch_release() >= torch_release("2.4")
WARNS_ON_SUBCLASS = torch_release() >= torch_release("2.10")


def _no_future_warnings(action):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        return action()


def test_must_show_command_exits_zero():
    code = (
        "import ampguard, torch; torch.cuda.amp.autocast(); torch.cpu.amp.autocast(); "
        "torch.cuda.amp.GradScaler(); torch.cpu.amp.GradScaler()"
    )
    result = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not WARNS_ON_LEGACY, reason="torch < 2.4 does not deprecate the legacy spellings")
def test_stock_torch_does_warn(stock_torch):
    with pytest.warns(FutureWarning):
        torch.cpu.amp.autocast()
    with pytest.warns(FutureWarning):
        torch.cuda.amp.custom_fwd(lambda ctx, x: x)


def test_legacy_cpu_autocast_is_torch_amp_autocast():
    def run(context):
        with context:
            return torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype

    assert _no_future_warnings(lambda: run(torch.cpu.amp.autocast())) == torch.bfloat16
    assert run(torch.amp.autocast("cpu")) == torch.bfloat16
    assert _no_future_warnings(lambda: run(torch.cpu.amp.autocast(False))) == torch.float32
    assert _no_future_warnings(lambda: run(torch.cpu.amp.autocast(True, torch.float16))) == torch.float16


def test_legacy_positional_order_keeps_its_meaning():
    context = _no_future_warnings(lambda: torch.cuda.amp.autocast(False))
    assert context._enabled is False and context.fast_dtype == torch.float16
    cpu = _no_future_warnings(lambda: torch.cpu.amp.autocast(True, torch.float16, False))
    assert cpu.fast_dtype == torch.float16 and cpu._cache_enabled is False


def test_legacy_autocast_as_decorator():
    @torch.cpu.amp.autocast(dtype=torch.float16)
    def matmul(a, b):
        return a @ b

    assert _no_future_warnings(lambda: matmul(torch.ones(2, 2), torch.ones(2, 2))).dtype == torch.float16


def test_subclassing_legacy_autocast_does_not_warn_and_isinstance_holds():
    def define():
        class MyAutocast(torch.cuda.amp.autocast):
            pass

        return MyAutocast

    subclass = _no_future_warnings(define)
    assert issubclass(subclass, torch.amp.autocast)
    assert isinstance(_no_future_warnings(lambda: torch.cpu.amp.autocast()), torch.amp.autocast_mode.autocast)


def test_custom_fwd_and_bwd_match_torch_amp():
    class Square(torch.autograd.Function):
        @staticmethod
        @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.cuda.amp.custom_bwd
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.tensor([3.0], requires_grad=True)
    y = _no_future_warnings(lambda: Square.apply(x))
    y.backward()
    assert y.item() == 9.0 and x.grad.item() == 6.0


def test_legacy_grad_scalers_take_init_scale_first():
    scaler = _no_future_warnings(lambda: torch.cpu.amp.GradScaler(256.0))
    assert scaler.get_scale() == 256.0 and scaler._device == "cpu"
    assert isinstance(scaler, torch.amp.GradScaler)


def test_with_grad_scaler_patch_off_legacy_scalers_are_torchs_without_warning(reinstall):
    reinstall(AMPGUARD_DISABLE="grad_scaler")
    scaler = _no_future_warnings(lambda: torch.cpu.amp.GradScaler(128.0, growth_interval=5))
    assert type(scaler) is torch.cpu.amp.GradScaler and not isinstance(scaler, ampguard.SafeGradScaler)
    assert scaler.get_scale() == 128.0 and scaler.get_growth_interval() == 5


def test_classes_keep_their_identity(stock_torch):
    before = (torch.cuda.amp.autocast, torch.cpu.amp.autocast, torch.amp.autocast)
    ampguard.install()
    assert (torch.cuda.amp.autocast, torch.cpu.amp.autocast, torch.amp.autocast) == before


@pytest.mark.skipif(not WARNS_ON_LEGACY, reason="nothing is deprecated before torch 2.4")
def test_uninstall_brings_the_warnings_back(stock_torch):
    ampguard.install()
    _no_future_warnings(lambda: torch.cpu.amp.autocast())
    ampguard.uninstall()
    with pytest.warns(FutureWarning):
        torch.cpu.amp.autocast()
    if WARNS_ON_SUBCLASS:
        with pytest.warns(FutureWarning):
            type("Sub", (torch.cuda.amp.autocast,), {})


def test_compile_fullgraph_through_legacy_spelling():
    torch._dynamo.reset()

    def f(x):
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):
            return torch.mm(x, x)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    out = _no_future_warnings(lambda: compiled(torch.ones(4, 4)))
    assert out.dtype == torch.bfloat16
    torch._dynamo.reset()
