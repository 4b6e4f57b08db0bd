"""Shared helpers of the SafeGradScaler tests: a tiny fp16-autocast training loop on CPU.

Every run is deterministic: the model, the data and the fault steps come from
fixed seeds, so two runs that differ only in the scaler class must end with
bit-identical parameters.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import ampguard
import ampguard.scaler
from ampguard.commands.selftest.runner import plain_torch as plain_torch  # torch exactly as without ampguard
from ampguard.scaler import SafeGradScaler

# torch's class is looked up on ampguard.scaler at each call: a module global bound to it
# here would itself be rebound to SafeGradScaler by the next install (names bound earlier).


def fused_adam_available() -> bool:
    """``Adam(fused=True)`` takes CPU parameters from torch 2.4 on."""
    try:
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


needs_fused_adam = pytest.mark.skipif(
    not fused_adam_available(), reason="Adam(fused=True) has no CPU kernel in this torch"
)


class DeviceSkipSGD(torch.optim.Optimizer):
    """A plain-torch optimizer that follows torch's fused contract (``_step_supports_amp_scaling``).

    GradScaler gives it ``grad_scale`` and ``found_inf`` tensors and no host read:
    it unscales and skips on the device, as ``Adam(fused=True)`` does. It runs on
    every torch (``Adam(fused=True)`` has no CPU kernel before 2.4).
    """

    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[Any], lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if grad_scale is None else param.grad / grad_scale
                update = grad * group["lr"]
                if isinstance(found_inf, torch.Tensor):
                    update = torch.where(found_inf > 0, torch.zeros_like(update), update)
                param.sub_(update)


OPTIMIZERS: dict[str, Callable[[Iterable[Any]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "fused_adam": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    "device_skip": lambda params: DeviceSkipSGD(params, lr=0.05),
}

OPTIMIZER_PARAMS = [
    "sgd",
    "adam",
    pytest.param("fused_adam", marks=needs_fused_adam),
    "device_skip",
]


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dtype)


def fault_steps(k: int, steps: int, seed: int = 3) -> set[int]:
    return set(random.Random(seed).sample(range(steps), k))


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    scales: list[float] = field(default_factory=list)
    mirror_mismatches: list[tuple[int, float | None, float]] = field(default_factory=list)


def train(
    scaler: Any,
    *,
    optimizer: str = "sgd",
    steps: int = 500,
    faults: Iterable[int] = (),
    seed: int = 0,
    clip: bool = False,
    check_every_step: bool = False,
    model: torch.nn.Module | None = None,
    nonfinite_loss_steps: Iterable[int] = (),
) -> Run:
    """Train ``steps`` optimizer steps under fp16 autocast; poison the gradients on the ``faults`` steps.

    Faults alternate inf and NaN, written into one scaled gradient after backward.
    With ``check_every_step``: assert every parameter stays finite, and record
    every step where the host mirror of a SafeGradScaler differs from its device scale.
    """
    model = make_model(seed) if model is None else model
    opt = OPTIMIZERS[optimizer](model.parameters())
    run = Run(model, opt, scaler)
    faults = set(faults)
    nonfinite_loss_steps = set(nonfinite_loss_steps)
    data = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        x = torch.randn(8, 8, generator=data)
        y = torch.randn(8, 2, generator=data)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if step in nonfinite_loss_steps:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if step in faults:
            model[0].weight.grad[step % 16, 0] = float("inf") if step % 2 else float("nan")
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if check_every_step:
            for p in model.parameters():
                assert torch.isfinite(p).all(), f"parameter became non-finite at step {step}"
            device_scale = scaler._scale.item()
            run.scales.append(device_scale)
            mirror = scaler._counters.mirror_scale if hasattr(scaler, "_counters") else device_scale
            if mirror != device_scale:
                run.mirror_mismatches.append((step, mirror, device_scale))
    return run


def recipe_step(
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    forward: Callable[[], torch.Tensor],
    *,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """One iteration of torch's AMP recipe on the CPU, the suite's one copy of it: ``zero_grad()``, the loss
    (``forward()``) under autocast, ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``.

    Returns the (unscaled) loss. A test that needs something between these calls (an ``unscale_`` and a clip, a
    fault written into a gradient, a check before ``step``) writes its loop out instead.
    """
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        loss = forward()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def stock(**kwargs: Any) -> Any:
    """torch's own GradScaler on CPU (the class ampguard captured before patching)."""
    return ampguard.scaler.TorchGradScaler("cpu", **kwargs)


@pytest.fixture
def no_scaler_left_mid_iteration() -> Iterator[None]:
    """A scaler that scaled a loss and never reached update() would put the next test's clip "in play"."""
    ampguard.scaler.scalers_in_iteration.clear()
    yield
    ampguard.scaler.scalers_in_iteration.clear()


def safe(**kwargs: Any) -> SafeGradScaler:
    return SafeGradScaler("cpu", **kwargs)


@pytest.fixture
def ampguard_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """caplog that sees logger ``ampguard`` (which does not propagate) down to DEBUG."""
    logger = logging.getLogger("ampguard")
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.DEBUG, logger="ampguard")
    return caplog


def records(caplog: pytest.LogCaptureFixture, level: int, contains: str = "") -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ampguard" and r.levelno == level and contains in r.getMessage()]


@pytest.fixture(autouse=False)
def one_thread():
    """One intra-op thread: the machine is shared, and small ops are faster so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def iteration(
    scaler: Any,
    model: torch.nn.Module,
    *optimizers: torch.optim.Optimizer,
    fault: bool = False,
    loss_factor: float = 1.0,
    update: bool = True,
) -> None:
    """One fp16-autocast iteration; ``fault`` poisons a gradient, ``loss_factor=inf`` the loss itself."""
    for opt in optimizers:
        opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.ones(2, model.in_features))
    loss = out.float().pow(2).mean() * 1e-4 * loss_factor  # small: no natural fp16 overflow below the cap
    scaler.scale(loss).backward()
    if fault:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    for opt in optimizers:
        scaler.step(opt)
    if update:
        scaler.update()
