"""The clip_grad patch: clip_grad_norm_ acts on unscaled gradients, with float32 norms, and never poisons them.

Every scenario trains a small MLP for 50 steps on CPU under fp16 autocast and
compares with the documented recipe (scale -> backward -> unscale_ -> clip ->
step -> update) run on stock torch (ampguard uninstalled).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import pickle
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import wrapt
from clip_support import clip_state
from torch import nn

import ampguard
import ampguard.registry
import ampguard.scaler
from ampguard.log import RateLimiter
from ampguard.patch import torch_release
from ampguard.registry import applied_patch
from ampguard.stats.counters import process_counters, stats_line
from ampguard.syncs import HostReadCounter

STEPS = 50
MAX_NORM = 0.5
INIT_SCALE = 1024.0


def _fused_adam_on_cpu() -> bool:
    try:
        torch.optim.Adam([nn.Parameter(torch.zeros(1))], fused=True)
    except RuntimeError:
        return False
    return True


FUSED_ON_CPU = _fused_adam_on_cpu()  # torch 2.3 requires CUDA for fused Adam


@contextlib.contextmanager
def stock() -> Iterator[None]:
    """torch without ampguard inside the block; the installation as it was afterwards."""
    config = ampguard.registry._registry.config
    ampguard.uninstall()
    try:
        yield
    finally:
        ampguard.install()
        assert ampguard.registry._registry.config == config


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # These are tiny CPU models on a shared machine: intra-op threads only add contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_scaler_left_mid_iteration() -> Iterator[None]:
    # A scaler that scaled a loss and never reached update() (a test that stops
    # half-way, kept alive by a traceback) would put the next test in "scaler in play".
    ampguard.scaler.scalers_in_iteration.clear()
    yield
    ampguard.scaler.scalers_in_iteration.clear()


@pytest.fixture
def ampguard_log() -> Iterator[list[logging.LogRecord]]:
    """Records of logger ``ampguard`` (it does not propagate, so caplog would not see them)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep(logging.DEBUG)
    logger = logging.getLogger("ampguard")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# -- a small training loop, in every variant the issue names ---------------------------


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.to(dtype)


def make_data(steps: int = STEPS, micro: int = 1, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(steps, micro, 8, 16, generator=generator), torch.randn(
        steps, micro, 8, 4, generator=generator
    ) * 3


def fp16_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return ((out.float() - y) ** 2).mean()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


class AcceleratedOptimizerLike:
    """What accelerate hands the user: the inner optimizer wrapped, stepped through the scaler."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        self.optimizer = optimizer
        self.scaler = scaler

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.scaler.step(self.optimizer)


def accelerator_clip_grad_norm_(
    optimizers: list[AcceleratedOptimizerLike], parameters: Any, max_norm: float
) -> torch.Tensor:
    """``Accelerator.clip_grad_norm_``: unscale_ every prepared (inner) optimizer, then torch's clip."""
    for wrapped in optimizers:
        wrapped.scaler.unscale_(wrapped.optimizer)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


@dataclass(frozen=True)
class Loop:
    """One way of writing the training loop.

    unscale: "all" (the documented recipe), "none" (unscale_ forgotten),
    "first" (only the first optimizer unscaled: a mixed clip), "accelerate".
    """

    unscale: str = "all"
    micro: int = 1
    optimizers: int = 1
    joint_clip: bool = True
    fused: bool = False
    fresh_scaler: bool = False

    def recipe(self) -> Loop:
        return Loop("all", self.micro, self.optimizers, self.joint_clip, self.fused, self.fresh_scaler)


def train(loop: Loop, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameters after ``steps`` steps and every norm clip_grad_norm_ returned."""
    model = make_model()
    xs, ys = make_data(steps, loop.micro)
    if loop.fused:
        groups = [list(model.parameters())]
        optimizers = [torch.optim.Adam(groups[0], lr=1e-2, fused=True)]
    elif loop.optimizers == 2:
        groups = [list(model[0].parameters()), list(model[2].parameters())]
        optimizers = [torch.optim.SGD(g, lr=0.05, momentum=0.9) for g in groups]
    else:
        groups = [list(model.parameters())]
        optimizers = [torch.optim.SGD(groups[0], lr=0.05, momentum=0.9)]

    def new_scaler() -> Any:
        return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=100)

    scaler = new_scaler()
    norms: list[torch.Tensor] = []
    for step in range(steps):
        if loop.fresh_scaler:
            scaler = new_scaler()
        for optimizer in optimizers:
            optimizer.zero_grad()
        for m in range(loop.micro):
            scaler.scale(fp16_loss(model, xs[step, m], ys[step, m]) / loop.micro).backward()
        if loop.unscale == "accelerate":
            wrapped = [AcceleratedOptimizerLike(o, scaler) for o in optimizers]
            norms.append(accelerator_clip_grad_norm_(wrapped, model.parameters(), MAX_NORM))
            for w in wrapped:
                w.step()
            scaler.update()
            continue
        to_unscale = {"all": optimizers, "none": [], "first": optimizers[:1]}[loop.unscale]
        for optimizer in to_unscale:
            scaler.unscale_(optimizer)
        if loop.joint_clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        else:
            norms.extend(torch.nn.utils.clip_grad_norm_(g, MAX_NORM) for g in groups)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    return flat(model), torch.stack(norms)


SCENARIOS = {
    "forgotten unscale_": Loop("none"),
    "explicit unscale_": Loop("all"),
    "accelerate-style unscale then clip": Loop("accelerate"),
    "accumulation over 4 micro-batches": Loop("none", micro=4),
    "two optimizers, one unscaled, joint clip": Loop("first", optimizers=2),
    "two optimizers, none unscaled, clip each": Loop("none", optimizers=2, joint_clip=False),
    "fused Adam": Loop("none", fused=True),
    "first iteration (a new scaler every step)": Loop("none", fresh_scaler=True),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_matches_the_documented_recipe(name: str) -> None:
    loop = SCENARIOS[name]
    if loop.fused and not FUSED_ON_CPU:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch_release()}")
    with stock():
        expected_params, expected_norms = train(loop.recipe())
    params, norms = train(loop)
    assert norms.shape == expected_norms.shape
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(params, expected_params, rtol=1e-5, atol=1e-7)
    # Clipping was active: otherwise this would not test much.
    assert (expected_norms > MAX_NORM).float().mean() > 0.5


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("given", ["generator", "list", "a group's list"])
def test_the_recipe_clips_as_torch_bit_for_bit(norm_type: float, foreach: bool | None, given: str) -> None:
    """scale -> backward -> unscale_ -> clip -> step, every clipped parameter held by the one optimizer unscaled:
    ampguard's clip there is torch's own functions (``clip_grad.norm._recipe_case``). The norms and the
    parameters are torch's bits, over steps that clip and one whose loss is inf (skipped by both)."""

    def recipe() -> tuple[torch.Tensor, torch.Tensor]:
        model = make_model()
        xs, ys = make_data(8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)
        norms = []
        for step in range(8):
            optimizer.zero_grad()
            loss = fp16_loss(model, xs[step, 0], ys[step, 0]) * (math.inf if step == 4 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            params = {
                "generator": model.parameters(),
                "list": list(model.parameters()),
                "a group's list": optimizer.param_groups[0]["params"],
            }[given]
            norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=norm_type, foreach=foreach))
            scaler.step(optimizer)
            scaler.update()
        return flat(model), torch.stack(norms)

    with stock():
        expected_params, expected_norms = recipe()
    params, norms = recipe()
    assert torch.equal(params, expected_params)
    torch.testing.assert_close(norms, expected_norms, rtol=0, atol=0, equal_nan=True)
    assert norms[4].isnan() and (expected_norms[torch.arange(8) != 4] > MAX_NORM).all()  # skipped; clipped


@pytest.mark.parametrize("name", ["forgotten unscale_", "accumulation over 4 micro-batches"])
def test_stock_torch_gets_these_scenarios_wrong(name: str) -> None:
    """The comparison above can fail: without ampguard the same loop clips scaled gradients."""
    loop = SCENARIOS[name]
    with stock():
        expected_params, expected_norms = train(loop.recipe())
        params, norms = train(loop)
    # Same first batch: the norm it returns is the scaled one; from there the runs part.
    assert norms[0].item() == pytest.approx(expected_norms[0].item() * INIT_SCALE, rel=1e-3)
    assert not torch.allclose(params, expected_params, rtol=1e-3)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf, 0.0])
@pytest.mark.parametrize("unscale", ["none", "first"], ids=["forgotten", "mixed"])
def test_norm_types(norm_type: float, unscale: str) -> None:
    """One step: the norm of any order, and the clipped gradients, are the recipe's."""

    def one_step(unscale: str) -> tuple[torch.Tensor, torch.Tensor]:
        model = make_model()
        xs, ys = make_data(1)
        optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        scaler.scale(fp16_loss(model, xs[0, 0], ys[0, 0])).backward()
        for optimizer in {"all": optimizers, "none": [], "first": optimizers[:1]}[unscale]:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        return norm, flat(model)

    with stock():
        expected_norm, expected_params = one_step("all")
    norm, params = one_step(unscale)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    torch.testing.assert_close(params, expected_params, rtol=1e-5, atol=1e-7)


def test_default_fp32_training_is_bit_identical_to_stock() -> None:
    """No scaler, float32 gradients, finite norms: ampguard's clip is torch's op for op."""

    def fp32_train() -> tuple[torch.Tensor, torch.Tensor]:
        model = make_model()
        xs, ys = make_data()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        norms = []
        for step in range(STEPS):
            optimizer.zero_grad()
            ((model(xs[step, 0]) - ys[step, 0]) ** 2).mean().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            optimizer.step()
        return flat(model), torch.stack(norms)

    with stock():
        expected = fp32_train()
    got = fp32_train()
    assert clip_state().guard_active()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# -- float32 norms ------------------------------------------------------------------


def _fp16_trap_params() -> list[nn.Parameter]:
    # 4096 float16 gradients of 2048 each: every one finite, the norm 131072 > 65504.
    param = nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    param.grad = torch.full((4096,), 2048.0, dtype=torch.float16)
    return [param]


def test_fp16_trap_stock_torch_zeroes_the_gradients() -> None:
    with stock():
        params = _fp16_trap_params()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert math.isinf(norm.item())
    assert torch.isfinite(params[0].grad).all() and (params[0].grad == 0).all()


def test_fp16_trap_ampguard_clips_with_a_float32_norm() -> None:
    params = _fp16_trap_params()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(2048.0 * 64)
    assert params[0].grad is not None and (params[0].grad != 0).all()
    assert torch.linalg.vector_norm(params[0].grad.float()).item() == pytest.approx(1.0, rel=1e-3)


def test_fp16_trap_with_a_scaler_the_optimizer_steps_on_clipped_gradients(ampguard_log: list) -> None:
    """float16 parameters, unscale_ forgotten: torch's norm would be inf and the step a step on zeros."""
    param = nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scaler.scale((param.float() * 2.0).sum()).backward()  # scaled gradient 2048 per element
    norm = torch.nn.utils.clip_grad_norm_([param], 1.0)
    scaler.step(optimizer)
    scaler.update()
    assert norm.item() == pytest.approx(2.0 * 64)  # the unscaled norm
    assert scaler.stats.skipped == 0
    assert torch.linalg.vector_norm(param.detach().float()).item() == pytest.approx(0.1 * 1.0, rel=1e-2)


def test_bf16_norm_is_computed_in_float32() -> None:
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(1000, generator=generator).to(torch.bfloat16)
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params])).item()
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(exact, rel=1e-6)
    with stock():
        assert abs(torch.nn.utils.clip_grad_norm_(params, 1e9).item() - exact) > 1e-6 * exact


# -- non-finite norms: with a scaler ---------------------------------------------------


def _one_step_with_injection(unscale: bool, value: float) -> tuple[nn.Sequential, torch.Tensor, Any, torch.Tensor]:
    model = make_model()
    xs, ys = make_data(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    before = flat(model)
    scaler.scale(fp16_loss(model, xs[0, 0], ys[0, 0])).backward()
    model[0].weight.grad[0, 0] = value  # an overflow in the backward pass
    if unscale:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    return model, before, scaler, norm


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("unscale", [False, True], ids=["forgotten", "explicit"])
def test_scaler_nonfinite_step_is_skipped_and_the_norm_is_honest(unscale: bool, value: float) -> None:
    with stock():
        model, before, scaler, norm = _one_step_with_injection(True, value)
        assert torch.equal(flat(model), before) and scaler.get_scale() == INIT_SCALE / 2
        stock_norm = norm.item()
    model, before, scaler, norm = _one_step_with_injection(unscale, value)
    assert torch.equal(flat(model), before)
    assert scaler.stats.skipped == 1 and scaler.stats.scale == INIT_SCALE / 2
    assert not math.isfinite(norm.item()) and math.isnan(norm.item()) == math.isnan(stock_norm)
    assert math.isinf(norm.item()) == math.isinf(stock_norm)


@pytest.mark.parametrize("bad", ["unscaled", "still scaled"])
def test_scaler_nonfinite_joint_clip_skips_every_optimizer_in_it(bad: str) -> None:
    """Two optimizers, the first unscaled, one clip over both, an overflow in either: neither steps on garbage."""
    model = make_model()
    xs, ys = make_data(1)
    first = torch.optim.SGD(model[0].parameters(), lr=0.05)
    second = torch.optim.SGD(model[2].parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    before = flat(model)
    scaler.scale(fp16_loss(model, xs[0, 0], ys[0, 0])).backward()
    (model[0] if bad == "unscaled" else model[2]).weight.grad[0, 0] = math.inf
    scaler.unscale_(first)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(first)
    scaler.step(second)
    scaler.update()
    assert math.isinf(norm.item())
    assert torch.equal(flat(model), before)
    assert scaler.stats.skipped == 2


def test_scaler_error_if_nonfinite_raises_like_torch() -> None:
    def attempt() -> tuple[str, torch.Tensor]:
        param = nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([math.inf, 1.0, 2.0])
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        scaler.scale(param.sum())
        with pytest.raises(RuntimeError) as raised:
            torch.nn.utils.clip_grad_norm_([param], 1.0, error_if_nonfinite=True)
        return str(raised.value), param.grad

    with stock():
        expected_message, expected_grad = attempt()
    message, grad = attempt()
    assert message == expected_message
    assert torch.equal(grad, expected_grad)  # untouched


# -- non-finite norms: no scaler (bf16 / fp32 training) --------------------------------


def _adam_state(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, ...]]:
    return [
        tuple(v.clone() if torch.is_tensor(v) else torch.tensor(v) for v in s.values())
        for s in optimizer.state.values()
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_scaler_nonfinite_norm_skips_the_step(
    dtype: torch.dtype, ampguard_log: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clip_state(), "skip_log", RateLimiter(60.0))
    model = make_model(dtype=dtype)
    xs, ys = make_data(4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(index: int, poison: float | None) -> torch.Tensor:
        optimizer.zero_grad()
        ((model(xs[index, 0].to(dtype)).float() - ys[index, 0]) ** 2).mean().backward()
        if poison is not None:
            model[2].bias.grad[0] = poison
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        return norm

    step(0, None)
    params, state = flat(model), _adam_state(optimizer)
    skipped = process_counters.clip_skipped
    assert math.isnan(step(1, math.nan).item())
    assert math.isinf(step(2, math.inf).item())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(flat(model), params)
    after = _adam_state(optimizer)
    assert len(after) == len(state) and all(
        torch.equal(a, b) for sa, sb in zip(after, state) for a, b in zip(sa, sb)
    ), "Adam's moments or step count changed on a skipped step"
    assert process_counters.clip_skipped == skipped + 2
    assert f"clip_skipped={skipped + 2}" in stats_line(torch.amp.GradScaler("cpu").stats, 0)
    warnings_logged = [r for r in ampguard_log if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    assert len(warnings_logged) == 1, "rate-limited: one warning for two skips in a row"
    assert "nan" in warnings_logged[0].getMessage()
    assert f"{skipped + 1} step(s) skipped so far in this run" in warnings_logged[0].getMessage()
    step(3, None)  # training goes on
    assert not torch.equal(flat(model), params)
    assert all(s["step"].item() == 2 for s in optimizer.state.values())


def test_no_scaler_guard_logs_a_stats_line(reinstall: Callable, ampguard_log: list) -> None:
    """bf16/fp32 training has no scaler stats line: the guard logs its own, every AMPGUARD_STATS_EVERY calls,
    each figure under the words that say what it counts (the interval, the whole run), as a scaler's line does."""
    reinstall(AMPGUARD_STATS_EVERY="3")
    param = nn.Parameter(torch.zeros(2))
    skipped = process_counters.clip_skipped
    for value in (1.0, 1.0, math.nan, 1.0, math.inf, 1.0, 1.0, 1.0, 1.0, 1.0):
        param.grad = torch.tensor([value, 1.0])
        torch.nn.utils.clip_grad_norm_([param], 1.0)
    lines = [r.getMessage() for r in ampguard_log if r.getMessage().startswith("stats clip_calls=")]
    assert lines == [
        "stats clip_calls=3 | this interval: clip_skipped=1 of 3 calls | whole run: clip_skipped=1 (33.33% of 3 calls)",
        "stats clip_calls=6 | this interval: clip_skipped=1 of 3 calls | whole run: clip_skipped=2 (33.33% of 6 calls)",
        "stats clip_calls=9 | this interval: clip_skipped=0 of 3 calls | whole run: clip_skipped=2 (22.22% of 9 calls)",
    ]
    assert process_counters.clip_skipped == skipped + 2  # the scaler's stats line and the exit tally count them too


def test_no_scaler_error_if_nonfinite_raises_like_torch() -> None:
    def attempt() -> tuple[str, torch.Tensor]:
        param = nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([math.nan, 1.0, 2.0])
        with pytest.raises(RuntimeError) as raised:
            torch.nn.utils.clip_grad_norm_([param], 1.0, error_if_nonfinite=True)
        assert param.grad is not None
        return str(raised.value), param.grad

    with stock():
        expected_message, expected_grad = attempt()
    message, grad = attempt()
    assert message == expected_message
    assert torch.equal(grad.isnan(), expected_grad.isnan()) and torch.equal(grad[1:], expected_grad[1:])


def test_a_torch_scaler_made_before_install_turns_the_guard_off(ampguard_log: list) -> None:
    """A GradScaler of torch's class (made while ampguard was not installed) needs the gradients to see the overflow."""
    with stock():
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    assert type(scaler) is ampguard.scaler.TorchGradScaler and clip_state().guard_active()
    model = make_model()
    xs, ys = make_data(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = flat(model)
    scaler.scale(fp16_loss(model, xs[0, 0], ys[0, 0])).backward()
    model[0].weight.grad[0, 0] = math.inf
    assert not clip_state().guard_active()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(optimizer)  # torch's "No inf checks were recorded" if the gradients had been hidden
    scaler.update()
    assert math.isinf(norm.item()) and torch.equal(flat(model), before)
    assert scaler.get_scale() == INIT_SCALE / 2
    assert any("not ampguard's" in r.getMessage() for r in ampguard_log)


# -- never in the way -----------------------------------------------------------------


def _torch_scaler_loop(unscale: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    model = make_model()
    xs, ys = make_data(12)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=4)
    norms = []
    for step in range(12):
        optimizer.zero_grad()
        scaler.scale(fp16_loss(model, xs[step, 0], ys[step, 0])).backward()
        if step in (3, 7):
            model[2].weight.grad[1, 1] = math.inf if step == 3 else math.nan
        if unscale:
            scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        scaler.step(optimizer)
        scaler.update()
    return flat(model), torch.stack(norms), scaler.get_scale()


@pytest.mark.parametrize("unscale", [True, False], ids=["recipe", "forgotten"])
def test_grad_scaler_disabled_torch_scaler_loop_is_bit_identical_to_stock(unscale: bool, reinstall: Callable) -> None:
    with stock():
        expected_params, expected_norms, expected_scale = _torch_scaler_loop(unscale)
    statuses = {s.name: s.state for s in reinstall(AMPGUARD_DISABLE="grad_scaler")}
    assert statuses == {**statuses, "grad_scaler": "disabled", "clip_grad": "applied"}
    assert isinstance(torch.nn.utils.clip_grad_norm_, wrapt.FunctionWrapper)
    assert not clip_state().guard_active()
    params, norms, scale = _torch_scaler_loop(unscale)
    assert type(torch.amp.GradScaler("cpu")) is ampguard.scaler.TorchGradScaler
    assert torch.equal(params, expected_params)
    assert torch.equal(norms.isnan(), expected_norms.isnan())
    assert torch.equal(norms.nan_to_num(), expected_norms.nan_to_num())
    assert scale == expected_scale


def test_grad_scaler_disabled_an_explicit_safe_scaler_still_gets_the_safe_clip(reinstall: Callable) -> None:
    reinstall(AMPGUARD_DISABLE="grad_scaler")
    assert _forgotten_unscale_norm(torch.nn.utils.clip_grad_norm_) == pytest.approx(5.0 * INIT_SCALE)  # torch's scaler
    safe = lambda: ampguard.SafeGradScaler("cpu", init_scale=INIT_SCALE)  # noqa: E731
    assert _forgotten_unscale_norm(torch.nn.utils.clip_grad_norm_, safe) == pytest.approx(5.0)


def test_grad_scaler_disabled_never_hides_gradients(reinstall: Callable) -> None:
    def clip() -> torch.Tensor:
        param = nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([math.inf, 1.0, 2.0])
        torch.nn.utils.clip_grad_norm_([param], 1.0)
        assert param.grad is not None
        return param.grad

    with stock():
        expected = clip()
    reinstall(AMPGUARD_DISABLE="grad_scaler")
    assert torch.equal(clip().nan_to_num(123.0), expected.nan_to_num(123.0))  # [nan, 0, 0], as torch leaves them


# -- host reads -----------------------------------------------------------------------


def _iteration(loop: Loop, count_clip_only: bool) -> int:
    model = make_model()
    xs, ys = make_data(1)
    params = list(model.parameters())
    optimizers = (
        [torch.optim.SGD(params[:2], lr=0.05), torch.optim.SGD(params[2:], lr=0.05)]
        if loop.optimizers == 2
        else [torch.optim.Adam(params, lr=1e-2, fused=True) if loop.fused else torch.optim.SGD(params, lr=0.05)]
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    with HostReadCounter() as whole:
        scaler.scale(fp16_loss(model, xs[0, 0], ys[0, 0])).backward()
        to_unscale = {"all": optimizers, "none": [], "first": optimizers[:1]}[loop.unscale]
        for optimizer in to_unscale:
            scaler.unscale_(optimizer)
        with HostReadCounter() as clip:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    return clip.total if count_clip_only else whole.total


@pytest.mark.parametrize(
    "loop",
    [Loop("none"), Loop("all"), Loop("first", optimizers=2), Loop("none", fused=True)],
    ids=["forgotten", "explicit", "mixed", "fused"],
)
def test_no_extra_host_reads_with_a_scaler(loop: Loop) -> None:
    if loop.fused and not FUSED_ON_CPU:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch_release()}")
    assert _iteration(loop, count_clip_only=True) == 0
    with stock():
        expected = _iteration(loop.recipe(), count_clip_only=False)
    assert _iteration(loop, count_clip_only=False) == expected
    # torch's own: one read per non-fused optimizer step (in _maybe_opt_step), none for a fused one.
    assert expected == (0 if loop.fused else loop.optimizers)


def test_no_scaler_guard_reads_the_norm_once() -> None:
    model = make_model()
    xs, ys = make_data(1)
    ((model(xs[0, 0]) - ys[0, 0]) ** 2).mean().backward()
    with HostReadCounter() as reads:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert reads.total == 1


def test_idle_without_guard_adds_no_host_read(reinstall: Callable) -> None:
    reinstall(AMPGUARD_DISABLE="grad_scaler")
    model = make_model()
    xs, ys = make_data(1)
    ((model(xs[0, 0]) - ys[0, 0]) ** 2).mean().backward()
    with HostReadCounter() as reads:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert reads.total == 0


# -- names, signature, uninstall ------------------------------------------------------


EARLY_MODULE = """
from torch.nn.utils import clip_grad_norm_
from torch.nn.utils import clip_grad_norm


def clip(parameters, max_norm):
    return clip_grad_norm_(parameters, max_norm)


def clip_deprecated(parameters, max_norm):
    return clip_grad_norm(parameters, max_norm)
"""


@pytest.fixture
def early_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A user module that bound clip_grad_norm_ before ``import ampguard``."""
    (tmp_path / "ampguard_early_user.py").write_text(textwrap.dedent(EARLY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    with stock():
        import ampguard_early_user

        assert not isinstance(ampguard_early_user.clip_grad_norm_, wrapt.FunctionWrapper)
    try:
        yield ampguard_early_user
    finally:
        sys.modules.pop("ampguard_early_user", None)


def _forgotten_unscale_norm(
    clip: Callable[[list[nn.Parameter], float], torch.Tensor], make_scaler: Callable[[], Any] | None = None
) -> float:
    param = nn.Parameter(torch.tensor([3.0, 4.0]))
    scaler = make_scaler() if make_scaler else torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scaler.scale((param * param.detach()).sum()).backward()  # gradient (3, 4) * 1024
    return clip([param], 1.0).item()


def test_name_bound_before_import_gets_the_safe_clip(early_module: Any) -> None:
    assert early_module.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_
    assert _forgotten_unscale_norm(early_module.clip) == pytest.approx(5.0)
    with pytest.warns((FutureWarning, UserWarning), match="deprecated"):
        assert _forgotten_unscale_norm(early_module.clip_deprecated) == pytest.approx(5.0)
    ampguard.uninstall()
    try:
        assert early_module.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_
        assert not isinstance(early_module.clip_grad_norm_, wrapt.FunctionWrapper)
        assert _forgotten_unscale_norm(early_module.clip) == pytest.approx(5.0 * INIT_SCALE)
    finally:
        ampguard.install()


def test_deprecated_clip_grad_norm_warns_as_torch_and_is_safe() -> None:
    with stock(), warnings.catch_warnings(record=True) as expected:
        warnings.simplefilter("always")
        stock_norm = _forgotten_unscale_norm(torch.nn.utils.clip_grad_norm)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        norm = _forgotten_unscale_norm(torch.nn.utils.clip_grad_norm)
    assert stock_norm == pytest.approx(5.0 * INIT_SCALE) and norm == pytest.approx(5.0)
    assert [(w.category, str(w.message)) for w in got] == [(w.category, str(w.message)) for w in expected]
    assert got and got[0].filename == __file__


def test_wrappers_keep_signature_docstring_and_name() -> None:
    for name in ("clip_grad_norm_", "clip_grad_norm"):
        wrapper = getattr(torch.nn.utils, name)
        assert isinstance(wrapper, wrapt.FunctionWrapper)
        original = wrapper.__wrapped__
        assert inspect.signature(wrapper) == inspect.signature(original)
        assert wrapper.__doc__ == original.__doc__ and wrapper.__name__ == original.__name__ == name
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_


def test_uninstall_restores_the_original_objects() -> None:
    wrapper = torch.nn.utils.clip_grad_norm_
    deprecated_wrapper = torch.nn.utils.clip_grad_norm
    original, deprecated = wrapper.__wrapped__, deprecated_wrapper.__wrapped__
    scale = vars(ampguard.scaler.TorchGradScaler)["scale"]
    ampguard.uninstall()
    try:
        assert torch.nn.utils.clip_grad_norm_ is original
        assert torch.nn.utils.clip_grad.clip_grad_norm_ is original
        assert torch.nn.utils.clip_grad_norm is deprecated and torch.nn.utils.clip_grad.clip_grad_norm is deprecated
        assert vars(ampguard.scaler.TorchGradScaler)["scale"] is scale.__wrapped__
        assert applied_patch("clip_grad") is None
        # A wrapper somebody still holds behaves as torch's function.
        assert _forgotten_unscale_norm(wrapper) == pytest.approx(5.0 * INIT_SCALE)
    finally:
        ampguard.install()
    assert torch.nn.utils.clip_grad_norm_ is not original and _forgotten_unscale_norm(wrapper) == pytest.approx(5.0)


def test_patch_can_be_disabled(reinstall: Callable) -> None:
    statuses = {s.name: s for s in reinstall(AMPGUARD_DISABLE="clip_grad")}
    assert statuses["clip_grad"].state == "disabled"
    assert not isinstance(torch.nn.utils.clip_grad_norm_, wrapt.FunctionWrapper)


# -- inputs torch accepts --------------------------------------------------------------


def test_generator_single_tensor_and_empty_inputs() -> None:
    param = nn.Parameter(torch.tensor([3.0, 4.0]))
    param.grad = torch.tensor([3.0, 4.0])
    assert torch.nn.utils.clip_grad_norm_(param, 10.0).item() == pytest.approx(5.0)
    assert torch.nn.utils.clip_grad_norm_((p for p in [param]), 1.0).item() == pytest.approx(5.0)
    assert param.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    with stock(), warnings.catch_warnings(record=True) as expected:
        warnings.simplefilter("always")
        expected_norm = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        norm = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert torch.equal(norm, expected_norm)
    assert [str(w.message) for w in got] == [str(w.message) for w in expected]


def test_two_scalers_with_still_scaled_gradients_clip_as_torch(
    ampguard_log: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clip_state(), "warned_ambiguous", False)
    param = nn.Parameter(torch.tensor([3.0, 4.0]))
    first = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    second = torch.amp.GradScaler("cpu", init_scale=2 * INIT_SCALE)
    first.scale((param * param.detach()).sum()).backward()
    second.scale(torch.zeros((), requires_grad=True))
    assert torch.nn.utils.clip_grad_norm_([param], 1e9).item() == pytest.approx(5.0 * INIT_SCALE)
    assert any("GradScalers scaled a loss" in r.getMessage() for r in ampguard_log)


def test_wrappers_copy_and_pickle_like_functions() -> None:
    import copy
    import pickle

    for wrapper in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_norm):
        assert copy.copy(wrapper) is wrapper and copy.deepcopy({"clip": wrapper})["clip"] is wrapper
        assert pickle.loads(pickle.dumps(wrapper)) is wrapper
    assert b"ampguard" not in pickle.dumps(torch.nn.utils.clip_grad_norm_)  # loads without ampguard


def test_a_wrapper_held_across_an_uninstall_pickles_as_torchs_function_does() -> None:
    """A config holding ``torch.nn.utils.clip_grad_norm_`` taken while installed, pickled after an uninstall: the
    wrapper, torch's function in behaviour now, pickles as torch's function (it was pickled as a reference to the
    module attribute, which is torch's function again: pickle refused it, "not the same object"). Found by review."""
    held = {"clip": torch.nn.utils.clip_grad_norm_}
    ampguard.uninstall()
    try:
        original = torch.nn.utils.clip_grad.clip_grad_norm_
        data = pickle.dumps(held)
        loaded = pickle.loads(data)
    finally:
        ampguard.install()
    assert loaded["clip"] is original and b"ampguard" not in data


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-break", "fullgraph"])
def test_torch_compile_of_code_that_clips(fullgraph: bool) -> None:
    """dynamo must not take the wrapper for torch's function (it crashed building guards on the proxy)."""

    def clip(params: list[nn.Parameter]) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, 1.0) * 2

    def fresh() -> list[nn.Parameter]:
        param = nn.Parameter(torch.zeros(2))
        param.grad = torch.tensor([3.0, 4.0])
        return [param]

    torch._dynamo.reset()
    with stock():
        try:
            expected = torch.compile(clip, backend="eager", fullgraph=fullgraph)(fresh())
        except Exception as error:  # torch 2.3 cannot trace clip_grad_norm_ in one graph
            pytest.skip(f"stock torch {torch_release()} cannot compile it either: {type(error).__name__}")
    torch._dynamo.reset()
    params = fresh()
    assert torch.equal(torch.compile(clip, backend="eager", fullgraph=fullgraph)(params), expected)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.8]))
    torch._dynamo.reset()
