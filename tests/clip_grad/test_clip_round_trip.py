"""clip_grad_norm_ with unscale_ forgotten: what the in-place unscale for the norm must never do (found by review).

The forgotten-unscale_ path unscales still-scaled float32 gradients in place and scales them back (exact for a
power-of-two scale). It must not do so where the round trip is not exact: float16 gradients (small values would
become subnormal or zero; the recipe unscales them into float32 master gradients), a scale of 3, a tensor listed
twice (unscaled twice), nor leave them unscaled when ampguard's own code fails half-way (the fallback to torch's
clip would see them unscaled and unscale_ would divide them again).
"""

from __future__ import annotations

import pytest
import torch
from scaler_support import no_scaler_left_mid_iteration, plain_torch  # noqa: F401 (a fixture)

import ampguard
import ampguard.scaler

# Unscaled gradients that float16 holds only subnormal or not at all; scaled by 65536 they are normal.
SMALL = [1e-4, 3e-6, 1e-7, 2e-8, 0.5]


pytestmark = pytest.mark.usefixtures("no_scaler_left_mid_iteration")


def _half_iteration(values: list[float]):
    param = torch.nn.Parameter(torch.zeros(len(values), dtype=torch.float16))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0, growth_interval=2000)
    scaler.scale((param.float() * torch.tensor(values)).sum()).backward()
    return param, optimizer, scaler


def test_measuring_the_norm_with_max_norm_inf_leaves_float16_scaled_gradients_as_torch_does():
    """clip_grad_norm_(params, inf): the usual way to log the norm; torch multiplies by exactly 1."""

    def run():
        param, _, _ = _half_iteration(SMALL)
        torch.nn.utils.clip_grad_norm_([param], float("inf"))
        return param.grad.clone()

    with plain_torch():
        want = run()
    got = run()
    assert torch.equal(got, want), (got, want)


def test_error_if_nonfinite_leaves_float16_gradients_untouched_as_torch_does():
    def run():
        param, _, _ = _half_iteration([*SMALL, float("inf")])
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_([param], 1.0, error_if_nonfinite=True)
        return param.grad.clone()

    with plain_torch():
        want = run()
    got = run()
    assert torch.equal(got, want), (got, want)


def test_forgotten_unscale_with_float16_params_steps_as_the_recipe_does():
    """Master weights: the recipe's optimizer sees float32 gradients unscaled from the float16 ones."""

    def run(recipe: bool):
        param, optimizer, scaler = _half_iteration(SMALL)
        if recipe:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([param], 10.0)  # the norm is ~0.5: nothing is clipped
        scaler.step(optimizer)
        scaler.update()
        masters = ampguard.master_weights.masters_of(optimizer)
        return masters[0][1].detach().clone() if masters else param.detach().float()

    want = run(recipe=True)
    got = run(recipe=False)
    assert torch.equal(got, want), (got, want)


def test_error_if_nonfinite_with_a_scale_of_3_leaves_float32_gradients_untouched_as_torch_does():
    """A scale that is not a power of two (init_scale=3, growth_factor=3): the round trip is not exact."""
    values = torch.linspace(0.1, 1.0, 200).tolist()

    def run():
        param = torch.nn.Parameter(torch.zeros(len(values) + 1))
        scaler = torch.amp.GradScaler("cpu", init_scale=3.0, growth_interval=2000)
        scaler.scale((param * torch.tensor([*values, float("inf")])).sum()).backward()
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_([param], 1.0, error_if_nonfinite=True)
        return param.grad.clone()

    with plain_torch():
        want = run()
    got = run()
    assert torch.equal(got, want), (got != want).sum()


class Injected(Exception):
    pass


def test_a_failure_after_the_in_place_unscale_falls_back_to_torchs_gradients(monkeypatch):
    """ampguard's own failure inside the clip (here: its norm, e.g. a CUDA OOM) must give torch's result.

    The forgotten-unscale_ path has already divided the gradients by the scale when the norm fails; the
    fallback runs torch's clip on them and leaves them unscaled, so unscale_ divides them a second time.
    """
    import ampguard.clip_grad.kernels

    values = [0.25, -0.125, 0.2]

    def run():
        param = torch.nn.Parameter(torch.zeros(len(values)))
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2000)
        scaler.scale((param * torch.tensor(values)).sum()).backward()
        torch.nn.utils.clip_grad_norm_([param], 1e9)  # nothing to clip, under torch or the recipe
        scaler.unscale_(optimizer)
        return param.grad.clone()

    with plain_torch():
        want = run()
    assert torch.equal(want, torch.tensor(values))

    def fail(*args, **kwargs):
        raise Injected("injected fault")

    monkeypatch.setattr(ampguard.clip_grad.kernels, "norms", fail)  # the per-tensor norms
    got = run()
    assert torch.equal(got, want), (got, want)


def test_a_parameter_listed_twice_gets_the_recipes_norm_and_gradients():
    """``clip_grad_norm_([a, b, a])`` (overlapping parameter lists, e.g. a module and its submodule chained).

    torch counts a listed-twice gradient twice in the norm and multiplies it twice. The forgotten-unscale_
    path unscales in place per listed tensor, so the shared gradient is divided by the scale twice before
    the norm is taken: another norm (6.40 instead of 8.31) and other gradients than the recipe's.
    """

    def run(recipe: bool):
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([a, b], lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2000)
        scaler.scale((a * torch.tensor([1.0, 2.0, 3.0])).sum() + (b * torch.tensor([4.0, 5.0])).sum()).backward()
        if recipe:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_([a, b, a], 1.0)
        if not recipe:
            scaler.unscale_(optimizer)
        return norm, [a.grad.clone(), b.grad.clone()]

    with plain_torch():
        want = run(recipe=True)
    _assert_close(run(recipe=False), want)


def _assert_close(got, want) -> None:
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
