"""The LR scheduler hold of fused optimizers (rows known on the host), judged against non-fused ones."""

from __future__ import annotations

import pytest
import torch
from scheduler_support import ITERATIONS, OVERFLOWS, Run, warmup_lambda, warmup_then_cosine
from test_scheduler_hold import _no_scaler_left_mid_iteration, accelerate  # noqa: F401  (fixtures)


def _fused(schedule, overflows: set[int]) -> Run:
    try:
        return Run(schedule, overflows, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")


def test_a_fused_optimizer_s_sequential_lr_holds_once_not_twice_per_skip():
    """A skipped fused step holds SequentialLR (right) and then its child again at the next step: the cosine lags."""
    fused = _fused(warmup_then_cosine, {5}).train(10)
    plain = Run(warmup_then_cosine, {5}).train(10)  # non-fused: the schedule of 9 successful steps
    assert [s.last_epoch for s in plain.scheduler._schedulers] == [2, 6]
    assert fused.scheduler.last_epoch == plain.scheduler.last_epoch == 9
    assert [s.last_epoch for s in fused.scheduler._schedulers] == [2, 6]  # ampguard: [2, 5]


def warmup_chained(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    return torch.optim.lr_scheduler.ChainedScheduler([warm, decay])


def test_a_fused_optimizer_s_chained_scheduler_holds_once_not_twice_per_skip():
    """The same with ChainedScheduler: its children hold again at the step after the chain held."""
    fused = _fused(warmup_chained, {2}).train(6)
    plain = Run(warmup_chained, {2}).train(6)
    assert [s.last_epoch for s in plain.scheduler._schedulers] == [5, 5]
    assert [s.last_epoch for s in fused.scheduler._schedulers] == [5, 5]


def test_a_fused_optimizer_s_epoch_scheduler_holds_only_when_the_whole_epoch_was_skipped():
    """As test_scheduler_hold's non-fused case: epoch 0 skips one step of 4, epoch 1 all 4, epoch 2 none. The fused
    optimizer's per-epoch StepLR holds one epoch per skipped step instead (5 skips: it never advances in 3 epochs)."""

    def per_epoch(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    plain, fused = Run(per_epoch, {1, 4, 5, 6, 7}), _fused(per_epoch, {1, 4, 5, 6, 7})
    for run in (plain, fused):
        for epoch in range(3):
            for index in range(4 * epoch, 4 * epoch + 4):
                run.iteration(index, step_scheduler=False)
            run.scheduler.step()
    assert plain.scheduler.last_epoch == 2
    assert fused.scheduler.last_epoch == 2  # ampguard: 0


def test_accelerate_prepared_scheduler_of_a_fused_optimizer_holds_once_not_twice(accelerate):
    """accelerate's step_was_skipped (ampguard's known_skip: the row is known at once on the CPU) keeps the prepared
    scheduler from stepping on the skipped step, and the late skip ampguard noted holds its next step as well."""
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.native_amp = True  # as test_scheduler_hold._accelerate_run: accelerate makes no scaler on the CPU
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = _fused_run_without_scaler()
    model, optimizer, scheduler = accelerator.prepare(run.model, run.optimizer, run.scheduler)
    skipped = []
    for index in range(ITERATIONS):
        run.index = index
        optimizer.zero_grad()
        accelerator.backward((model(run.xs[index]).float() ** 2).mean())
        optimizer.step()
        skipped.append(accelerator.optimizer_step_was_skipped)
        scheduler.step()
    assert skipped == [i in OVERFLOWS for i in range(ITERATIONS)]  # accelerate saw the skips and held
    assert run.scheduler.last_epoch == ITERATIONS - len(OVERFLOWS)  # ampguard: 2 (held twice per skip)


def _fused_run_without_scaler() -> Run:
    try:
        return Run(warmup_lambda, OVERFLOWS, fp16=False, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")


def test_the_user_s_own_skip_check_and_a_fused_optimizer_s_scheduler_hold_once_per_skip():
    """The common idiom ``if scaler.get_scale() >= scale_before: scheduler.step()`` already holds on a backward
    overflow; with a fused optimizer ampguard's late skip then holds the next step too (non-fused: once)."""
    runs = {"foreach": Run(warmup_lambda, {2, 5}), "fused": _fused(warmup_lambda, {2, 5})}
    for run in runs.values():
        for index in range(10):
            scale_before = run.scaler.get_scale()
            run.iteration(index, step_scheduler=False)
            if run.scaler.get_scale() >= scale_before:
                run.scheduler.step()
    assert runs["foreach"].scheduler.last_epoch == 8
    assert runs["fused"].scheduler.last_epoch == 8  # ampguard: 6
