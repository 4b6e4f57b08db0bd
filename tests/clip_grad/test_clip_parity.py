"""clip_grad_norm_ on still-scaled gradients gives torch's numbers, or the recipe's, bit for bit (issue: parity).

Each case sets gradients directly (no model), so the compared numbers are exactly the ones a reviewer's
differential run found apart: the same scaled gradients are clipped under plain torch (ampguard uninstalled,
torch's own GradScaler) and under ampguard, and the returned norm and the gradients the optimizer then sees
are compared with ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scaler_support import no_scaler_left_mid_iteration, plain_torch  # noqa: F401 (a fixture)

SCALE = 1024.0


pytestmark = pytest.mark.usefixtures("no_scaler_left_mid_iteration")


def _params(values: list[list[float]]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(len(v))) for v in values]


def _scaled_iteration(values: list[list[float]], scale: float = SCALE):
    """Parameters whose gradients are ``values * scale`` after ``scaler.scale(loss).backward()``."""
    params = _params(values)
    optimizer = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2000)
    loss = sum((p * torch.tensor(v)).sum() for p, v in zip(params, values))
    scaler.scale(loss).backward()
    return params, optimizer, scaler


def _unscaled_grads(scaler, optimizer, params) -> list[torch.Tensor]:
    scaler.unscale_(optimizer)
    return [p.grad.clone() for p in params]


def _run(clip: Callable, values: list[list[float]], *, unscale_after: bool = True, scale: float = SCALE):
    params, optimizer, scaler = _scaled_iteration(values, scale)
    norm = clip(params, scaler)
    grads = _unscaled_grads(scaler, optimizer, params) if unscale_after else [p.grad.clone() for p in params]
    return norm, grads


def _assert_same(got, want) -> None:
    norm, grads = got
    want_norm, want_grads = want
    assert torch.equal(norm, want_norm), (norm.item(), want_norm.item())
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w), (g, w)


VALUES = [[0.25, -0.125, 0.2], [0.3, 0.01]]


def test_an_infinite_scaled_threshold_returns_torchs_norm():
    """``max_norm = inf * get_scale()`` on still-scaled gradients: torch returns the scaled norm (377.487)."""

    def clip(params, scaler):
        return torch.nn.utils.clip_grad_norm_(params, float("inf") * scaler.get_scale())

    with plain_torch():
        want = _run(clip, VALUES)
    _assert_same(_run(clip, VALUES), want)


def test_a_scaled_threshold_for_one_optimizer_after_another_was_unscaled_is_torchs():
    """Two optimizers, one scaler: a unscaled, b's still-scaled gradients clipped with ``0.1 * get_scale()``."""

    def run():
        params_a, params_b = _params(VALUES), _params([[4.0, -3.0], [0.5]])
        optimizer_a = torch.optim.SGD(params_a, lr=0.0)
        optimizer_b = torch.optim.SGD(params_b, lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2000)
        loss = sum((p * torch.tensor(v)).sum() for p, v in zip(params_a, VALUES))
        loss = loss + sum((p * torch.tensor(v)).sum() for p, v in zip(params_b, [[4.0, -3.0], [0.5]]))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer_a)
        norm = torch.nn.utils.clip_grad_norm_(params_b, 0.1 * scaler.get_scale())
        return norm, _unscaled_grads(scaler, optimizer_b, params_b)

    with plain_torch():
        want = run()
    _assert_same(run(), want)


def _recipe(values: list[list[float]], max_norm: float, norm_type: float, scale: float = SCALE):
    """The documented recipe on plain torch: unscale_, then clip."""
    params, optimizer, scaler = _scaled_iteration(values, scale)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return norm, [p.grad.clone() for p in params]


def _forgotten_unscale(max_norm: float, norm_type: float) -> Callable:
    def clip(params, scaler):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    return clip


@pytest.mark.parametrize("values", [[[1e20 / SCALE, 3.0]], [[2.0**-70, -(2.0**-72)], [2.0**-71]]])
def test_a_forgotten_unscale_gives_the_recipes_norm_at_both_ends_of_float32(values):
    """Scaled gradient 1e20 at scale 1024: the recipe returns 9.77e16 and steps (the scaled norm overflowed)."""
    with plain_torch():
        want = _recipe(values, 1.0, 2.0)
    got = _run(_forgotten_unscale(1.0, 2.0), values)
    assert torch.isfinite(got[0])
    _assert_same(got, want)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, 0.5, float("inf")])
def test_a_forgotten_unscale_gives_the_recipes_bits_for_every_p_norm(norm_type):
    values = [[0.25, -0.125, 0.2, 1e-3], [0.3, 0.01, -7.5]]
    with plain_torch():
        want = _recipe(values, 0.5, norm_type)
    _assert_same(_run(_forgotten_unscale(0.5, norm_type), values), want)


@pytest.mark.parametrize("init_scale", [0.1, 1e38, 3.0])
def test_before_the_first_scale_the_scale_is_the_python_float_torch_gives(init_scale, reinstall):
    """get_scale(), state_dict()["scale"] and a pickled copy, before scale(): init_scale itself, not rounded."""
    import pickle

    def read(scaler):
        return scaler.get_scale(), scaler.state_dict()["scale"], pickle.loads(pickle.dumps(scaler)).get_scale()

    with plain_torch():
        want = read(torch.amp.GradScaler("cpu", init_scale=init_scale))
    reinstall(AMPGUARD_MIN_SCALE="0", AMPGUARD_MAX_SCALE="3.4028234663852886e38")
    got = read(torch.amp.GradScaler("cpu", init_scale=init_scale))
    assert got == want == (init_scale,) * 3


# -- a forgotten unscale_ where the exact round trip is not taken ----------------------------------

HUGE = [1e20, -3e19, 2.5e20]  # still-scaled gradients whose 2-norm squares past float32 (1e40 > 3.4e38)
SCALE_SETTINGS = ["init_scale=1000", "after_update_new_scale", "init_scale=1024"]


def _huge_scaled_iteration(setting: str, inject: float | None = None):
    """A parameter whose still-scaled gradient is ``HUGE`` (one entry ``inject`` if given), mid-iteration.

    ``init_scale=1000`` is no power of two (no round trip); after ``update(new_scale)`` the scale is known on the
    device only (device mode, no round trip either); ``init_scale=1024`` takes the round trip.
    """
    param = torch.nn.Parameter(torch.zeros(len(HUGE)))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0 if setting == "init_scale=1000" else SCALE)
    if setting == "after_update_new_scale":
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update(2048.0)
        optimizer.zero_grad()
    scaler.scale(param.sum()).backward()
    with torch.no_grad():
        param.grad.copy_(torch.tensor(HUGE))
        if inject is not None:
            param.grad[1] = inject
    return param, optimizer, scaler


def _finish(param, optimizer, scaler, result):
    scaler.step(optimizer)
    scaler.update()
    return result, param.detach().clone(), scaler.get_scale()


def _recipe_then(clip: Callable, setting: str, inject: float | None = None):
    """Plain torch: the recipe, unscale_ then ``clip``; the optimizer steps, the scaler updates."""
    with plain_torch():
        param, optimizer, scaler = _huge_scaled_iteration(setting, inject)
        scaler.unscale_(optimizer)
        return _finish(param, optimizer, scaler, clip(param))


def _forgotten_then(clip: Callable, setting: str, inject: float | None = None):
    """ampguard: ``clip`` on the still-scaled gradients (unscale_ forgotten), then step and update."""
    param, optimizer, scaler = _huge_scaled_iteration(setting, inject)
    return _finish(param, optimizer, scaler, clip(param))


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("setting", SCALE_SETTINGS)
def test_a_forgotten_unscale_of_a_huge_gradient_gives_the_recipes_norm_at_any_scale(setting, foreach):
    """The recipe returns ~2.7e17 and steps; dividing the scaled norm (inf) by the scale skipped the step."""

    def clip(param):
        return torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=foreach)

    (want_norm, want_param, want_scale) = _recipe_then(clip, setting)
    (norm, param, scale) = _forgotten_then(clip, setting)
    assert torch.isfinite(want_norm) and torch.equal(norm, want_norm), (norm, want_norm)
    assert scale == want_scale  # nothing overflowed: no back-off
    torch.testing.assert_close(param, want_param, rtol=1e-6, atol=0)  # docs/clipping.md: the last bits


@pytest.mark.skipif(not hasattr(torch.nn.utils, "get_total_norm"), reason="torch < 2.6 has no get_total_norm")
@pytest.mark.parametrize("setting", SCALE_SETTINGS)
def test_get_total_norm_of_huge_still_scaled_gradients_is_the_unscaled_norm(setting):
    def total(param):
        return torch.nn.utils.get_total_norm([param.grad])

    (want_norm, want_param, want_scale) = _recipe_then(total, setting)
    (norm, param, scale) = _forgotten_then(total, setting)
    assert torch.isfinite(want_norm) and torch.equal(norm, want_norm), (norm, want_norm)
    assert scale == want_scale and torch.equal(param, want_param)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("inject", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("setting", SCALE_SETTINGS)
def test_clip_grad_value_with_unscale_forgotten_never_hides_an_overflow(setting, inject, foreach):
    """The clamp made a scaled inf finite, so the scaler never saw it and stepped: the recipe skips."""

    def clip(param):
        torch.nn.utils.clip_grad_value_([param], 0.5, foreach=foreach)

    (_, want_param, want_scale) = _recipe_then(clip, setting, inject)
    (_, param, scale) = _forgotten_then(clip, setting, inject)
    assert torch.equal(param, want_param)  # the step skipped, as the recipe's
    backed_off = {"init_scale=1000": 500.0, "after_update_new_scale": 1024.0, "init_scale=1024": 512.0}[setting]
    assert scale == want_scale == backed_off  # as the recipe's scaler does


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("setting", SCALE_SETTINGS)
def test_clip_grad_value_with_unscale_forgotten_is_the_recipes_clamp(setting, foreach):
    def clip(param):
        torch.nn.utils.clip_grad_value_([param], 0.5, foreach=foreach)

    (_, want_param, want_scale) = _recipe_then(clip, setting)
    (_, param, scale) = _forgotten_then(clip, setting)
    assert torch.equal(param, want_param) and scale == want_scale


@pytest.mark.skipif(not hasattr(torch.nn.utils, "get_total_norm"), reason="torch < 2.6 has no get_total_norm")
def test_the_split_api_with_a_scaled_threshold_is_torchs():
    """get_total_norm of still-scaled gradients after get_scale() was read: torch's scaled norm, as clip_grad_norm_
    reads the idiom (found by tests/parity/test_differential.py: the threshold met the unscaled norm, 1024 times apart)."""

    def clip(params, scaler):
        threshold = 1e-3 * scaler.get_scale()  # read before the norm is taken, as the one-line form reads it
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 1.0)
        torch.nn.utils.clip_grads_with_norm_(params, threshold, norm)
        return norm

    with plain_torch():
        want = _run(clip, VALUES)
    _assert_same(_run(clip, VALUES), want)


@pytest.mark.skipif(not hasattr(torch.nn.utils, "get_total_norm"), reason="torch < 2.6 has no get_total_norm")
def test_the_split_api_with_a_scaled_threshold_after_another_optimizer_was_unscaled_is_torchs():
    def run():
        params_a, params_b = _params([[0.25, -0.125]]), _params([[0.3, 0.01]])
        optimizer_b = torch.optim.SGD(params_b, lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        scaler.scale(sum((p * 3.0).sum() for p in params_a + params_b)).backward()
        scaler.unscale_(optimizer_b)
        threshold = 1e-3 * scaler.get_scale()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params_a])
        torch.nn.utils.clip_grads_with_norm_(params_a, threshold, norm)
        return norm, [p.grad.clone() for p in params_a]

    with plain_torch():
        want = run()
    _assert_same(run(), want)


def test_clip_grad_value_with_a_scaled_bound_is_torchs():
    """``clip_grad_value_(params, 0.2 * get_scale())`` on still-scaled gradients: torch's clamp at the bound as
    given (before, ampguard multiplied it by the scale again: a bound of 0.2 * scale**2, nothing clipped)."""

    def clip(params, scaler):
        torch.nn.utils.clip_grad_value_(params, 0.2 * scaler.get_scale())
        return torch.zeros(())

    with plain_torch():
        want = _run(clip, VALUES)
    assert any(not torch.equal(g, torch.tensor(v)) for g, v in zip(want[1], VALUES))  # (the bound clips)
    _assert_same(_run(clip, VALUES), want)


def test_clip_grad_value_with_a_scaled_bound_still_skips_a_step_whose_gradients_overflowed():
    """The one difference the idiom keeps: torch's clamp turns a still-scaled inf into the finite bound and the step
    is taken with it; ampguard makes it NaN, so the scaler finds the overflow and skips the step."""

    def run():
        params = _params(VALUES)
        optimizer = torch.optim.SGD(params, lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        scaler.scale(sum((p * torch.tensor(v)).sum() for p, v in zip(params, VALUES))).backward()
        params[0].grad[0] = float("inf")
        torch.nn.utils.clip_grad_value_(params, 0.2 * scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        return params[0].detach().clone(), scaler.get_scale()

    with plain_torch():
        torch_param, torch_scale = run()
    param, scale = run()
    assert torch_scale == SCALE and not torch.equal(torch_param, torch.zeros(3))  # torch stepped
    assert torch.equal(param, torch.zeros(3)) and scale == SCALE / 2  # skipped, backed off
