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
