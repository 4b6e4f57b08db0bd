"""The scheduler_hold patch: LR schedulers hold on the optimizer steps a SafeGradScaler skipped.

A tiny model trains under fp16 autocast with the recipe (scale, backward,
step, update, scheduler.step); a gradient hook makes the gradients inf on
chosen iterations, as a real overflow would. The learning rates the optimizer
steps with must be those of the same schedule run in fp32 without the skipped
iterations.
"""

from __future__ import annotations

import logging
import math
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from scheduler_support import ITERATIONS, OVERFLOWS, SCHEDULES, Run, successful_lrs, warmup_lambda
from torch import nn

import ampguard
import ampguard.scaler
import ampguard.scheduler_hold.hold
from ampguard.registry import applied_patch
from ampguard.scheduler_hold.patch import SchedulerHoldPatch
from ampguard.stats.counters import process_counters
from ampguard.syncs import HostReadCounter

TORCH_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def applied_hold() -> ampguard.scheduler_hold.hold.Hold:
    """The Hold of the applied scheduler_hold patch (a new one at each install)."""
    patch = applied_patch("scheduler_hold")
    assert isinstance(patch, SchedulerHoldPatch) and patch.hold is not None
    return patch.hold


@pytest.fixture(autouse=True)
def _no_scaler_left_mid_iteration() -> Iterator[None]:
    ampguard.scaler.scalers_in_iteration.clear()
    yield
    ampguard.scaler.scalers_in_iteration.clear()


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_warmup_after_n_successful_steps_is_the_fp32_runs(name: str) -> None:
    run = Run(SCHEDULES[name], OVERFLOWS).train(ITERATIONS)
    assert run.scaler.stats.skipped == len(OVERFLOWS)
    successful = ITERATIONS - len(OVERFLOWS)
    fp32 = Run(SCHEDULES[name], fp16=False).train(successful)
    assert successful_lrs(run) == fp32.lrs
    assert run.optimizer.param_groups[0]["lr"] == fp32.optimizer.param_groups[0]["lr"]
    assert run.scheduler.last_epoch == fp32.scheduler.last_epoch == successful


@pytest.mark.filterwarnings("ignore:Detected call of")  # torch's, for the skipped first step
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_disabled_patch_is_torchs_behaviour(name: str, reinstall: Callable) -> None:
    """The comparison above can fail: torch's schedulers advance on skipped steps."""
    reinstall(AMPGUARD_DISABLE="scheduler_hold")
    run = Run(SCHEDULES[name], OVERFLOWS).train(ITERATIONS)
    assert run.scheduler.last_epoch == ITERATIONS
    with_torch = Run(SCHEDULES[name]).train(ITERATIONS)  # the schedule does not depend on the gradients
    assert run.lrs == with_torch.lrs
    ampguard.uninstall()
    try:
        stock = Run(SCHEDULES[name], OVERFLOWS).train(ITERATIONS)
    finally:
        ampguard.install()
    assert stock.lrs == run.lrs and stock.scaler.get_scale() == run.scaler.get_scale() == 1024.0 / 2 ** len(OVERFLOWS)


def _first_step_warnings() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Run(warmup_lambda, {0}).train(3)
    return [str(w.message) for w in caught if TORCH_WARNING in str(w.message)]


def test_torchs_warning_is_not_raised_for_a_skipped_first_step(reinstall: Callable) -> None:
    assert _first_step_warnings() == []
    reinstall(AMPGUARD_DISABLE="scheduler_hold")
    assert len(_first_step_warnings()) == 1


def test_the_torch_warning_for_a_real_ordering_bug_is_kept() -> None:
    """scheduler.step() before any optimizer step, no skip involved: torch's warning, as it should."""

    def warned_from() -> list[str]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        scheduler = warmup_lambda(optimizer)
        with pytest.warns(UserWarning, match="Detected call of") as caught:
            scheduler.step()
        return [w.filename for w in caught]

    ampguard.uninstall()
    try:
        plain = warned_from()
    finally:
        ampguard.install()
    assert warned_from() == plain  # attributed where torch attributes it: this line (torch's own file before 2.4)


def test_a_step_kept_across_a_reinstall_holds_again() -> None:
    """A scheduler's bound ``step`` taken before an uninstall and install (a loop that keeps it) holds on skipped
    steps as one looked up afterwards does: the wrappers ask the patch, whichever install made them."""

    def lrs(keep: bool) -> list[float]:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (epoch + 1))
        kept = scheduler.step
        ampguard.uninstall()
        ampguard.install()
        step = kept if keep else scheduler.step
        scaler, seen = torch.amp.GradScaler("cpu"), []
        for i in range(4):
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(1, 2) * (math.inf if i in (1, 2) else 1.0)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            step()
            seen.append(optimizer.param_groups[0]["lr"])
        return seen

    assert lrs(keep=True) == lrs(keep=False) == [0.5, 0.5, 0.5, 1 / 3]  # held at the two skipped steps


def test_holds_are_counted_and_logged_once(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(applied_hold(), "logged", False)  # once per installation
    before = process_counters.scheduler_held
    with caplog.at_level(logging.DEBUG, logger="ampguard"):
        Run(warmup_lambda, OVERFLOWS).train(ITERATIONS)
    assert process_counters.scheduler_held - before == len(OVERFLOWS)
    held = [r for r in caplog.records if r.name == "ampguard" and "lr_scheduler.step() held" in r.getMessage()]
    assert [r.levelno for r in held] == [logging.INFO] + [logging.DEBUG] * (len(OVERFLOWS) - 1)


def test_an_epoch_scheduler_holds_only_when_the_whole_epoch_was_skipped() -> None:
    def per_epoch(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    run = Run(per_epoch, {1, 4, 5, 6, 7})  # epoch 0: one skip of 4; epoch 1: all 4 skipped
    for epoch in range(3):
        for index in range(4 * epoch, 4 * epoch + 4):
            run.iteration(index, step_scheduler=False)
        run.scheduler.step()
    assert run.scheduler.last_epoch == 2


def test_two_schedulers_on_one_optimizer_each_hold() -> None:
    run = Run(warmup_lambda, {2})
    second = torch.optim.lr_scheduler.StepLR(run.optimizer, step_size=1, gamma=1.0)  # only counts
    for index in range(5):
        run.iteration(index)
        second.step()
    assert run.scheduler.last_epoch == second.last_epoch == 4


def test_fused_optimizer_holds_too() -> None:
    """Fused optimizers skip on the device; the host learns of it from the step's row (tests/scaler/test_row_copies.py)."""
    try:
        run = Run(warmup_lambda, {1}, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")
    run.train(4)
    assert run.scheduler.last_epoch == 3  # torch: 4


def _host_reads(overflow_at: set[int]) -> int:
    run = Run(warmup_lambda, overflow_at)
    with HostReadCounter() as reads:
        run.train(3)
    return reads.total


@pytest.mark.parametrize("overflow_at", [set(), {1}], ids=["healthy", "one skip"])
def test_no_extra_host_read(overflow_at: set[int], reinstall: Callable) -> None:
    reads = _host_reads(overflow_at)
    if not overflow_at:
        assert reads == 3  # torch's own: one per non-fused scaler.step
    reinstall(AMPGUARD_DISABLE="scheduler_hold")
    assert _host_reads(overflow_at) == reads


def test_nothing_in_the_checkpoints() -> None:
    run = Run(warmup_lambda, {1}).train(3)
    state = run.scheduler.state_dict()
    assert not any("ampguard" in key for key in state)
    assert not any("ampguard" in key for key in pickle.loads(pickle.dumps(run.optimizer)).__dict__)


# -- accelerate ------------------------------------------------------------------------------------


@pytest.fixture
def accelerate() -> Iterator[Any]:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield accelerate
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerate_run(accelerate: Any, overflow_at: set[int], iterations: int) -> tuple[Any, list[bool]]:
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    # On CPU accelerate makes no scaler: do what Accelerator.__init__ does on CUDA
    # (tests/integration/test_accelerate_hf.py, hand_cpu_scaler).
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = Run(warmup_lambda, overflow_at, fp16=False)
    model, optimizer, scheduler = accelerator.prepare(run.model, run.optimizer, run.scheduler)
    skipped = []
    for index in range(iterations):
        run.index = index
        optimizer.zero_grad()
        run.lrs.append(optimizer.param_groups[0]["lr"])
        accelerator.backward((model(run.xs[index]).float() ** 2).mean())
        optimizer.step()
        skipped.append(accelerator.optimizer_step_was_skipped)
        scheduler.step()
    return run, skipped


def test_accelerate_prepared_scheduler_holds_once_not_twice(accelerate: Any) -> None:
    run, skipped = _accelerate_run(accelerate, OVERFLOWS, ITERATIONS)
    assert skipped == [i in OVERFLOWS for i in range(ITERATIONS)]  # accelerate saw the skips and held
    successful = ITERATIONS - len(OVERFLOWS)
    fp32 = Run(warmup_lambda, fp16=False).train(successful)
    assert run.scheduler.last_epoch == successful
    assert successful_lrs(run) == fp32.lrs


def test_a_failure_inside_the_hold_falls_back_to_torch_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(scheduler: Any) -> bool:
        raise RuntimeError("injected")

    monkeypatch.setattr(ampguard.scheduler_hold.hold, "should_hold", broken)
    monkeypatch.setattr(applied_hold(), "failed", False)
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        run = Run(warmup_lambda, {1, 2}).train(4)
    assert run.scheduler.last_epoch == 4  # torch's behaviour
    assert [r.getMessage() for r in caplog.records if "scheduler_hold failed" in r.getMessage()] == [
        "scheduler_hold failed; lr_scheduler.step() runs as in torch (traceback at DEBUG)"
    ]
