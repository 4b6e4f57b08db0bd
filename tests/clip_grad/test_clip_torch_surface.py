"""What a caller sees of torch around the clip under a SafeGradScaler: torch's messages, warnings and wrappers.

Each test runs the documented recipe (scale -> backward -> unscale_ -> clip ->
step -> update) on a small model under fp16 autocast on CPU and compares with
torch without ampguard (``ampguard.uninstall()``), or with what another
library installed on torch's GradScaler.
"""

from __future__ import annotations

import functools
import inspect
import logging
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import wrapt
from scaler_support import ampguard_log, records  # noqa: F401  (a fixture)
from torch import nn

import ampguard
import ampguard.clip_grad.norm as norm
import ampguard.scaler
from ampguard import containment


@pytest.fixture(autouse=True)
def _no_scaler_left_mid_iteration() -> Iterator[None]:
    ampguard.scaler.scalers_in_iteration.clear()
    yield
    ampguard.scaler.scalers_in_iteration.clear()


def _without_ampguard(run: Callable[[], Any]) -> Any:
    """``run()`` on torch as it is without ampguard (the autouse fixture puts the installation back after a test)."""
    ampguard.uninstall()
    try:
        return run()
    finally:
        ampguard.install()


def _model() -> nn.Sequential:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def _recipe(clip: Callable[[nn.Module], Any], steps: int = 2) -> list[Any]:
    """The recipe for ``steps``; what ``clip(model)`` returned or raised (as ``repr``) at each step."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    generator = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8, generator=generator))
        scaler.scale(out.float().square().mean()).backward()
        scaler.unscale_(optimizer)
        try:
            seen.append(clip(model))
        except RuntimeError as error:
            seen.append(repr(error))
        scaler.step(optimizer)
        scaler.update()
    return seen


def test_a_nonfinite_norm_raises_torchs_message_for_an_int_norm_type() -> None:
    """``clip_grad_norm_(params, 1.0, 2, True)`` with an inf gradient: torch says "order 2.0" (it takes
    ``float(norm_type)`` first), and so must ampguard's clip after ``unscale_`` (its short path for the recipe)."""

    def clip(model: nn.Module) -> Any:
        model[0].weight.grad[0, 0] = float("inf")
        return torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, 2, True)

    expected = _without_ampguard(lambda: _recipe(clip))
    seen = _recipe(clip)
    assert all("order 2.0 " in message for message in expected), expected
    assert seen == expected


@pytest.mark.parametrize("given", [list, tuple])
def test_a_nonfinite_norm_raises_torchs_error_once_and_nothing_else(
    given: type, ampguard_log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``error_if_nonfinite=True`` with an inf gradient after ``unscale_``: torch's RuntimeError, raised once by torch's
    own clip as without ampguard (nothing chained to it), and not reported as a failure of ampguard's."""
    monkeypatch.setattr(containment, "_reported", set())  # (a failure is reported once per process)

    def clip(model: nn.Module) -> Any:
        model[0].weight.grad[0, 0] = float("inf")
        try:
            return torch.nn.utils.clip_grad_norm_(given(model.parameters()), 1.0, error_if_nonfinite=True)
        except RuntimeError as error:  # (what the caller's traceback shows: one error, no other chained to it)
            shown = "".join(traceback.format_exception(error))
            return str(error), shown.count("Traceback"), "During handling" in shown or "direct cause" in shown

    expected = _without_ampguard(lambda: _recipe(clip))
    seen = _recipe(clip)
    assert seen == expected and all(tracebacks == 1 and not chained for _, tracebacks, chained in seen), seen
    assert not records(ampguard_log, logging.WARNING)


BAD_ARGUMENTS: dict[str, Callable[[nn.Module], Any]] = {
    "clip_grad_norm_, max_norm=None": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), None),
    "clip_grad_norm_, norm_type='foo'": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, "foo"),
    "clip_grad_value_, clip_value=None": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), None),
}
if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
    BAD_ARGUMENTS["get_total_norm, norm_type='foo'"] = lambda m: torch.nn.utils.get_total_norm(
        [p.grad for p in m.parameters()], "foo"
    )
    BAD_ARGUMENTS["clip_grads_with_norm_, max_norm=None"] = lambda m: torch.nn.utils.clip_grads_with_norm_(
        m.parameters(), None, torch.tensor(1.0)
    )


@pytest.mark.parametrize("unscaled", [False, True], ids=["still scaled", "after unscale_"])
@pytest.mark.parametrize("call", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_arguments_torch_refuses_get_torchs_error_and_no_report(
    call: Callable[[nn.Module], Any], unscaled: bool, ampguard_log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clip call torch itself refuses raises torch's error, whatever ampguard's own code made of the arguments:
    no "failure of ampguard's" is reported for the caller's mistake."""
    monkeypatch.setattr(containment, "_reported", set())

    def one_step() -> str:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(model(torch.ones(2, 8)).square().mean()).backward()
        if unscaled:
            scaler.unscale_(optimizer)
        try:
            call(model)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        finally:
            ampguard.scaler.scalers_in_iteration.clear()
        return "no error"

    expected = _without_ampguard(one_step)
    assert expected != "no error"
    assert one_step() == expected
    assert not records(ampguard_log, logging.WARNING)


def test_a_failure_of_ampguards_clip_is_reported_also_where_torchs_clip_then_raises(
    ampguard_log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ampguard's clip fails (a bug, simulated) on gradients torch's own clip refuses for their values (inf, with
    ``error_if_nonfinite=True``): the caller gets torch's error, and ampguard's failure is still reported once
    (only an error torch raises the same way is the caller's, as in the test above)."""

    def bug(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("simulated ampguard bug")

    monkeypatch.setattr(containment, "_reported", set())
    monkeypatch.setattr(norm, "scaled_total_norm", bug)
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(2, 8)).square().mean()).backward()  # (unscale_ forgotten: still scaled)
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    ampguard.scaler.scalers_in_iteration.clear()
    warnings = records(ampguard_log, logging.WARNING, "safe clip_grad_norm_ failed (IndexError: simulated")
    assert len(warnings) == 1


def test_the_empty_generator_warning_points_at_the_callers_line() -> None:
    """torch warns about an empty generator of parameters at the line that called ``clip_grad_norm_``; under
    ampguard (a scaler in play) the same warning must point at the same line, not into ampguard."""
    line = inspect.currentframe().f_lineno + 3  # type: ignore[union-attr]

    def clip(model: nn.Module) -> Any:
        return torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)

    def caught() -> list[tuple[str, str, int]]:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            _recipe(clip, steps=1)
        return [(str(r.message), r.filename, r.lineno) for r in records if "empty generator" in str(r.message)]

    expected = _without_ampguard(caught)
    warns = "empty generator" in inspect.getsource(torch.nn.utils.clip_grad)  # (torch 2.3 does not)
    assert [(filename, lineno) for _, filename, lineno in expected] == [(__file__, line)] * warns
    assert caught() == expected


def test_another_librarys_wrapper_of_torchs_scale_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library (a profiler, a tracer) that wraps torch's ``GradScaler.scale`` after ampguard installed, with
    ``functools.wraps`` as usual, is called at every ``scale()`` of a SafeGradScaler, as it was before issue 34:
    ampguard's own pass past its foreign-scaler watch must not skip a wrapper it did not install."""
    # torch's own class, as SafeGradScaler subclasses it (a name bound to it elsewhere is rebound at each install)
    torchs = next(c for c in ampguard.SafeGradScaler.__mro__ if c.__module__ == "torch.amp.grad_scaler")
    calls: list[str] = []
    original = torchs.scale

    @functools.wraps(original)
    def traced(self: Any, outputs: Any) -> Any:
        calls.append(type(self).__name__)
        return original(self, outputs)

    monkeypatch.setattr(torchs, "scale", traced)
    _recipe(lambda model: torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0), steps=3)
    assert len(calls) == 3, calls


def test_a_tracers_wrapt_wrapper_of_torchs_scale_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with ``wrapt`` (how tracers such as ddtrace and OpenTelemetry wrap methods): its bound wrapper
    proxies ``__func__`` and every attribute of the function it wraps, ampguard's own wrapper, yet it is not that
    wrapper and must run at every ``scale()``, as before issue 34."""
    torchs = next(c for c in ampguard.SafeGradScaler.__mro__ if c.__module__ == "torch.amp.grad_scaler")
    calls: list[str] = []

    def traced(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append(type(instance).__name__)
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(torchs, "scale", wrapt.FunctionWrapper(vars(torchs)["scale"], traced))
    _recipe(lambda model: torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0), steps=3)
    assert len(calls) == 3, calls
