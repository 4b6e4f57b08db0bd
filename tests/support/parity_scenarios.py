"""Training loops that ampguard must run exactly as torch does, or refuse as torch does.

Each scenario is a function returning plain data (parameters, norms, counters) or
raising. :func:`outcome` turns either into a JSON-able dict. The module imports
only torch, so that ``python tests/support/parity_scenarios.py [NAME ...]`` gives plain torch's
outcome in another process (no ampguard anywhere in it), and the tests compare
it with the same function run under ampguard in the test process
(tests/parity/test_torch_parity.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {}


def scenario(function: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    SCENARIOS[function.__name__] = function
    return function


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=data), torch.randn(4, 3, generator=data)) for _ in range(count)]


def _params(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _scaler(**options: Any) -> Any:
    # Explicit settings, so that ampguard's defaults (1024 / 100) and torch's agree.
    return torch.amp.GradScaler("cpu", init_scale=options.pop("init_scale", 1024.0), growth_interval=100, **options)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y) * factor


# -- gradient accumulation with unscale_ on every micro-step -----------------------------

MICRO_STEPS = 4
ITERATIONS = 3
OVERFLOW = 1e38  # a finite loss whose scaled value (x 1024) is inf in float32: inf gradients


def _accumulate(
    unscale_every_micro_step: bool, clip: float | None, overflow_at: tuple[int, int] | None
) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler()
    batches = iter(_batches(ITERATIONS * MICRO_STEPS))
    norms = []
    for iteration in range(ITERATIONS):
        opt.zero_grad()
        for micro in range(MICRO_STEPS):
            x, y = next(batches)
            factor = OVERFLOW if (iteration, micro) == overflow_at else 1.0 / MICRO_STEPS
            scaler.scale(_loss(model, x, y, factor)).backward()
            if unscale_every_micro_step or micro == MICRO_STEPS - 1:
                scaler.unscale_(opt)
                if clip is not None:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        scaler.step(opt)
        scaler.update()
    return {"params": _params(model), "scale": scaler.get_scale(), "norms": norms}


@scenario
def accumulate_unscale_each_micro_step() -> dict[str, Any]:
    return _accumulate(True, None, None)


@scenario
def accumulate_unscale_once() -> dict[str, Any]:
    return _accumulate(False, None, None)


@scenario
def accumulate_unscale_each_micro_step_later_overflow() -> dict[str, Any]:
    return _accumulate(True, None, (1, 2))


@scenario
def accumulate_unscale_once_later_overflow() -> dict[str, Any]:
    return _accumulate(False, None, (1, 2))


@scenario
def accumulate_clip_each_micro_step() -> dict[str, Any]:
    """What accelerate's ``clip_grad_norm_`` does on every micro-step without the ``sync_gradients`` guard."""
    return _accumulate(True, 0.05, None)


@scenario
def accumulate_clip_each_micro_step_fp32() -> dict[str, Any]:
    """The reference: the same loop in float32 without a scaler."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = iter(_batches(ITERATIONS * MICRO_STEPS))
    norms = []
    for _ in range(ITERATIONS):
        opt.zero_grad()
        for _ in range(MICRO_STEPS):
            x, y = next(batches)
            _loss(model, x, y, 1.0 / MICRO_STEPS).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
    return {"params": _params(model), "scale": 1024.0, "norms": norms}


# -- a closure passed positionally --------------------------------------------------------


@scenario
def step_with_positional_closure() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler()
    ((x, y),) = _batches(1)
    scaler.scale(_loss(model, x, y))  # scaled, never back-propagated: no gradient yet

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, x, y)
        scaler.scale(loss).backward()
        return loss

    scaler.step(opt, closure)
    scaler.update()
    return {"params": _params(model)}


# -- a non-finite loss inside a list -------------------------------------------------------


@scenario
def nan_loss_in_a_list() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler()
    for step, (x, y) in enumerate(_batches(4)):
        opt.zero_grad()
        first = _loss(model, x, y)
        second = _loss(model, y[:, :1].expand(4, 6), y) * (float("nan") if step == 2 else 1.0)
        scaled = scaler.scale([first, [second]])
        (scaled[0] + scaled[1][0]).backward()
        scaler.step(opt)
        scaler.update()
    return {"params": _params(model), "scale": scaler.get_scale()}


# -- clipping still-scaled gradients with a scaled threshold (torch's test_grad_scaling_clipping) --


def _clip_with_scaled_threshold(optimizer: str) -> dict[str, Any]:
    model = _model()
    if optimizer == "fused_adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler(init_scale=128.0)
    norms = []
    for step, (x, y) in enumerate(_batches(6)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(_loss(model, x, y) + torch.nn.functional.mse_loss(out.float(), y)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * scaler.get_scale())))
        if step == 3:
            model[2].weight.grad.fill_(float("inf"))  # a skipped step, as torch's test has
        scaler.step(opt)
        scaler.update()
    return {"params": _params(model), "scale": scaler.get_scale(), "norms": norms}


@scenario
def clip_scaled_threshold_sgd() -> dict[str, Any]:
    return _clip_with_scaled_threshold("sgd")


@scenario
def clip_scaled_threshold_fused_adam() -> dict[str, Any]:
    return _clip_with_scaled_threshold("fused_adam")


def outcome(name: str) -> dict[str, Any]:
    """``{"result": ...}`` or ``{"error": type name, "message": ...}``."""
    try:
        found: dict[str, Any] = {"result": SCENARIOS[name]()}
    except Exception as error:  # the outcome under test
        found = {"error": type(error).__name__, "message": str(error)}
    found["ampguard_loaded"] = "ampguard" in sys.modules
    return found


if __name__ == "__main__":
    # One process for all of them: each run would otherwise pay torch's import.
    print(json.dumps({name: outcome(name) for name in (sys.argv[1:] or SCENARIOS)}))
