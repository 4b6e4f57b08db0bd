"""clip_grad_value_, get_total_norm and clip_grads_with_norm_ act on unscaled gradients under a SafeGradScaler.

Each function runs in one fp16 iteration (a real scaled backward at scale 1024),
with ``unscale_`` forgotten ("scaled") or called first ("unscaled"), on float32
and float16 parameters (float16 ones get float32 masters at ``unscale_``). After
``unscale_`` the gradients the optimizer would step on must equal torch's own
function (the original, unwrapped) applied to the unscaled gradients, as held at
the time of the call (float16 while still scaled, the float32 master after
``unscale_``), and ampguard must add no host read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import wrapt
from clip_support import clip_state
from torch import nn

import ampguard
import ampguard.clip_grad.api
import ampguard.scaler
import ampguard.scaler.listeners
from ampguard.syncs import HostReadCounter

SCALE = 1024.0
CLIP_VALUE = 0.5  # float16-representable: one reference for float16 and float32 gradients
MAX_NORM = 1.0
SHAPES = [(8,), (4, 4), (16,)]
HAS_SPLIT = hasattr(torch.nn.utils, "get_total_norm")  # torch >= 2.6
needs_split = pytest.mark.skipif(not HAS_SPLIT, reason=f"torch {torch.__version__} has no get_total_norm")


@pytest.fixture(autouse=True)
def _no_scaler_left_mid_iteration() -> Iterator[None]:
    ampguard.scaler.scalers_in_iteration.clear()
    yield
    ampguard.scaler.scalers_in_iteration.clear()


def _unscaled_gradients() -> list[torch.Tensor]:
    """float16-representable values, so that scaled float16 gradients are exact multiples of them."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=generator).half().float() for shape in SHAPES]


def _torch(name: str) -> Callable[..., Any]:
    """torch's own function, unwrapped."""
    function = getattr(torch.nn.utils, name)
    return function.__wrapped__ if isinstance(function, wrapt.FunctionWrapper) else function


class Iteration:
    """Parameters whose gradients a scaled backward made, the optimizer, the scaler, mid-iteration."""

    def __init__(self, dtype: torch.dtype, unscale_first: bool) -> None:
        self.unscaled = _unscaled_gradients()
        self.params = [nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in self.unscaled]
        self.optimizer = torch.optim.SGD(self.params, lr=0.1)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        loss = sum((p.float() * g).sum() for p, g in zip(self.params, self.unscaled))
        self.scaler.scale(loss).backward()
        self.unscale_first = unscale_first
        if unscale_first:
            self.scaler.unscale_(self.optimizer)

    def held_dtype(self) -> torch.dtype:
        """The dtype of the tensors holding the gradients at the clip: a float16 parameter's master after unscale_."""
        return torch.float32 if self.unscale_first else self.params[0].dtype

    def reference_grads(self) -> list[torch.Tensor]:
        """Unscaled gradients as torch would hold them at the clip, in plain tensors for torch's function."""
        return [g.to(self.held_dtype()) for g in self.unscaled]

    def finish(self) -> list[torch.Tensor]:
        """unscale_ (if it was forgotten), the gradients the optimizer steps on (float32), then step and update."""
        if not self.unscale_first:
            self.scaler.unscale_(self.optimizer)
        grads = [g.detach().float().clone() for _, g in ampguard.scaler.listeners.gradient_pairs(self.params)]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return grads


def _params_holding(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


CASES = [
    pytest.param(dtype, unscale_first, id=f"{str(dtype)[6:]}-{'unscaled' if unscale_first else 'scaled'}")
    for dtype in (torch.float32, torch.float16)
    for unscale_first in (False, True)
]
FOREACH = [
    pytest.param(None, id="foreach=None"),
    pytest.param(False, id="foreach=False"),
    pytest.param(True, id="foreach=True"),
]


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("dtype, unscale_first", CASES)
def test_clip_grad_value_is_torchs_clamp_of_the_unscaled_gradients(
    dtype: torch.dtype, unscale_first: bool, foreach: bool | None
) -> None:
    iteration = Iteration(dtype, unscale_first)
    expected = _params_holding(iteration.reference_grads())
    _torch("clip_grad_value_")(expected, CLIP_VALUE, foreach=foreach)
    with HostReadCounter() as reads:
        result = torch.nn.utils.clip_grad_value_(iteration.params, CLIP_VALUE, foreach=foreach)
    assert result is None and reads.total == 0
    got = iteration.finish()
    for g, p in zip(got, expected):
        assert torch.equal(g, p.grad.float())
    assert max(g.abs().max().item() for g in got) == CLIP_VALUE  # the clamp did act


@needs_split
@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("dtype, unscale_first", CASES)
def test_get_total_norm_and_clip_grads_with_norm_give_torchs_result_on_unscaled_gradients(
    dtype: torch.dtype, unscale_first: bool, foreach: bool | None
) -> None:
    """torch's documented split of clip_grad_norm_, with the gradients as the user reads them: ``p.grad``."""
    iteration = Iteration(dtype, unscale_first)
    # torch's norm of the unscaled gradients, in float32 (a float16 norm is what ampguard avoids).
    expected_norm = _torch("get_total_norm")([g.float() for g in iteration.unscaled], foreach=foreach)
    expected = _params_holding(iteration.reference_grads())
    _torch("clip_grads_with_norm_")(expected, MAX_NORM, expected_norm, foreach=foreach)
    with HostReadCounter() as reads:
        norm = torch.nn.utils.get_total_norm([p.grad for p in iteration.params], foreach=foreach)
        result = torch.nn.utils.clip_grads_with_norm_(iteration.params, MAX_NORM, norm, foreach=foreach)
    assert result is None and reads.total == 0
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    assert expected_norm.item() > 4 * MAX_NORM  # the clip did act
    got = iteration.finish()
    for g, p in zip(got, expected):
        torch.testing.assert_close(g, p.grad.float(), rtol=1e-6, atol=0)


@needs_split
def test_torchs_own_clip_grad_norm_through_the_wrapped_halves_is_the_recipe() -> None:
    """torch's clip_grad_norm_ calls the two halves by their module names: wrapped, they stay consistent."""
    # Before any loss is scaled: with a SafeGradScaler in play these gradients would be taken as scaled ones.
    expected = _params_holding(_unscaled_gradients())
    expected_norm = _torch("clip_grad_norm_")(expected, MAX_NORM)
    iteration = Iteration(torch.float32, unscale_first=False)
    norm = clip_state().original(iteration.params, MAX_NORM)  # torch's clip_grad_norm_, unwrapped
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for g, p in zip(iteration.finish(), expected):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)


def test_stock_torch_clamps_the_scaled_gradients(stock_torch: None) -> None:
    """The comparison above can fail: without ampguard clip_grad_value_ clamps scaled values."""
    iteration = Iteration(torch.float32, unscale_first=False)
    torch.nn.utils.clip_grad_value_(iteration.params, CLIP_VALUE)
    got = iteration.finish()
    assert max(g.abs().max().item() for g in got) == CLIP_VALUE / SCALE


@needs_split
def test_get_total_norm_without_the_patch_is_scaled(stock_torch: None) -> None:
    iteration = Iteration(torch.float32, unscale_first=False)
    norm = torch.nn.utils.get_total_norm([p.grad for p in iteration.params])
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in iteration.unscaled]))
    assert norm.item() == pytest.approx(expected.item() * SCALE, rel=1e-5)
    iteration.finish()


@needs_split
@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaled", "unscaled"])
def test_a_nonfinite_total_norm_skips_the_step(unscale_first: bool) -> None:
    iteration = Iteration(torch.float32, unscale_first)
    before = [p.detach().clone() for p in iteration.params]
    torch.nn.utils.clip_grads_with_norm_(iteration.params, MAX_NORM, torch.tensor(math.inf))
    iteration.finish()
    assert iteration.scaler.stats.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(iteration.params, before))


def test_no_scaler_in_play_is_torchs_function() -> None:
    grads = _unscaled_gradients()
    params, expected = _params_holding(grads), _params_holding(grads)
    _torch("clip_grad_value_")(expected, CLIP_VALUE)
    torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    assert all(torch.equal(p.grad, e.grad) for p, e in zip(params, expected))
    if HAS_SPLIT:
        assert torch.equal(torch.nn.utils.get_total_norm(grads), _torch("get_total_norm")(grads))


def test_wrapped_uninstalled_and_disabled(reinstall: Callable) -> None:
    names = ["clip_grad_value_"] + (["get_total_norm", "clip_grads_with_norm_"] if HAS_SPLIT else [])
    private = {
        "clip_grad_value_": "clip_grad_value_",
        "get_total_norm": "_get_total_norm",
        "clip_grads_with_norm_": "_clip_grads_with_norm_",
    }
    wrappers = {name: getattr(torch.nn.utils, name) for name in names}
    for name, wrapper in wrappers.items():
        assert isinstance(wrapper, wrapt.FunctionWrapper)
        assert getattr(torch.nn.utils.clip_grad, private[name]) is wrapper
        assert wrapper.__name__ == wrapper.__wrapped__.__name__ and wrapper.__doc__ == wrapper.__wrapped__.__doc__
    ampguard.uninstall()
    try:
        for name, wrapper in wrappers.items():
            assert getattr(torch.nn.utils, name) is wrapper.__wrapped__
            assert getattr(torch.nn.utils.clip_grad, private[name]) is wrapper.__wrapped__
    finally:
        ampguard.install()
    reinstall(AMPGUARD_DISABLE="clip_grad")
    for name, wrapper in wrappers.items():
        assert getattr(torch.nn.utils, name) is wrapper.__wrapped__
