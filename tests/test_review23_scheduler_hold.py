"""Review 23: the LR scheduler hold of fused optimizers (rows known on the host), judged against non-fused ones."""

from __future__ import annotations

import pytest
import torch
from test_scheduler_hold import Run, _no_scaler_left_mid_iteration, warmup_then_cosine  # noqa: F401  (fixture)


def _fused(schedule, overflows: set[int]) -> Run:
    try:
        return Run(schedule, overflows, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")


def test_review23_a_fused_optimizer_s_sequential_lr_holds_once_not_twice_per_skip():
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


def test_review23_a_fused_optimizer_s_chained_scheduler_holds_once_not_twice_per_skip():
    """The same with ChainedScheduler: its children hold again at the step after the chain held."""
    fused = _fused(warmup_chained, {2}).train(6)
    plain = Run(warmup_chained, {2}).train(6)
    assert [s.last_epoch for s in plain.scheduler._schedulers] == [5, 5]
    assert [s.last_epoch for s in fused.scheduler._schedulers] == [5, 5]
