"""A fused optimizer's skips, known on the host without a sync: the ledger rows' host copies (ampguard.scaler.row_copies).

Before, with a fused optimizer (the HF Trainer's default), the host learned of a
forward overflow or a skipped step only at the next read of the device-side
counters (``AMPGUARD_STATS_EVERY``, default 500 steps): every overflowing batch
until then was lost, and LR schedulers advanced on skipped steps. On the CPU a
row is known at once; on CUDA an event is polled (mocked here: the GPU-only
part, ``..._mocked_cuda_event``), so a row is known an update or two later.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from islands_support import EVERY, fresh_islands, make_net, probe_only, train  # noqa: F401  (fixtures)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from test_islands_fused import fused_runs, reads_by_step
from test_scheduler_hold import OVERFLOWS, Run, warmup_lambda
from torch import nn

import ampguard.scaler
from ampguard import syncs
from ampguard.scaler.row_copies import RowCopies
from ampguard.stats.counters import process_counters

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_islands"), needs_fused_adam]


def fused(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


@pytest.mark.usefixtures("probe_only")  # with the headroom watch: 1 (tests/test_headroom_watch.py)
def test_a_fused_optimizer_heals_at_the_second_overflow_with_the_default_stats_interval(ampguard_log):
    """Every 10th batch overflows in blocks.1.attn: torch loses all 30, the probe alone 2 (was 3 with a read every
    20 steps, and all of them until the first read with the default AMPGUARD_STATS_EVERY=500)."""
    steps = 300
    reference, healed = fused_runs(steps)
    assert reference.nonfinite_losses == steps // EVERY == 30
    assert healed.nonfinite_losses == healed.scaler.stats.nonfinite_loss == 2
    assert healed.scaler.stats.fp32_islands == ("blocks.1.attn",)
    armed = records(ampguard_log, logging.INFO, "forward overflow in the step learned at step 10 (a fused optimizer")
    assert len(armed) == 1
    made = records(ampguard_log, logging.WARNING, "fp32 island:")
    assert len(made) == 1 and "step 20)" in made[0].getMessage()
    assert min(healed.scales) >= 1024.0  # never lowered for a forward overflow
    assert all(torch.isfinite(p).all() for p in healed.model.parameters())


@pytest.mark.usefixtures("probe_only")
def test_no_read_on_healthy_steps_and_one_per_step_only_while_the_probe_watches():
    reads_at, torch_reads, islands = reads_by_step(60)
    # Armed at step 10's update (its row known at once on the CPU); a read per step from 11 to the overflow
    # that names the block (20). No stats read in 60 steps (AMPGUARD_STATS_EVERY=500).
    assert reads_at == {step: 1 for step in range(11, 21)}
    assert torch_reads == 0
    assert islands == ("blocks.1.attn",)


def factors(run: Run) -> list[float]:
    """The schedule's factor at each step (the fused run's Adam and the plain run's SGD start from other rates)."""
    base = run.optimizer.param_groups[0]["initial_lr"]
    return [round(lr / base, 12) for lr in [*run.lrs, run.optimizer.param_groups[0]["lr"]]]


def _fused_run(overflows: set[int]) -> Run:
    try:
        return Run(warmup_lambda, overflows, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")


def test_a_fused_optimizer_s_schedulers_hold_on_its_skipped_steps():
    """On the CPU the skip is known before scheduler.step(): the same schedule as a non-fused optimizer's."""
    held_before = process_counters.scheduler_held
    fused_run = _fused_run(OVERFLOWS).train(14)
    plain = Run(warmup_lambda, OVERFLOWS).train(14)
    assert fused_run.scaler.stats.skipped == len(OVERFLOWS)
    assert factors(fused_run) == factors(plain)
    assert fused_run.scheduler.last_epoch == plain.scheduler.last_epoch == 14 - len(OVERFLOWS)
    assert process_counters.scheduler_held - held_before == 2 * len(OVERFLOWS)


@pytest.fixture
def rows_one_update_late(monkeypatch):
    """Each row becomes known one update after it was written, as a GPU's copy that has not landed yet."""
    known = RowCopies.known

    def one_late(self: RowCopies) -> list[Any]:
        if not self.pending:
            return []
        newest = self.pending.pop()
        try:
            return known(self)
        finally:
            self.pending.append(newest)

    monkeypatch.setattr(RowCopies, "known", one_late)


@pytest.mark.usefixtures("rows_one_update_late")
def test_a_skip_learned_an_update_late_holds_the_next_scheduler_step_instead():
    run = _fused_run({3, 7}).train(12)
    plain = Run(warmup_lambda, {3, 7}).train(12)
    assert run.scheduler.last_epoch == plain.scheduler.last_epoch == 10  # the schedule catches up
    ours, held_at_once = factors(run), factors(plain)
    assert ours[-1] == held_at_once[-1]
    # Iteration 4 ran one step ahead (its scheduler advanced after the skip of 3, not yet known); 5 is held.
    assert ours[:4] == held_at_once[:4] and ours[4] != held_at_once[4] and ours[5:8] == held_at_once[5:8]


@pytest.mark.usefixtures("rows_one_update_late", "probe_only")
def test_a_forward_overflow_learned_an_update_late_still_arms_the_probe():
    model = make_net()
    healed = train(60, model=model, optimizer=fused(model))
    assert healed.scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert healed.nonfinite_losses == 2  # 10 learned at 11, watched from 12, named at 20


class _Event:
    """torch.cuda.Event, mocked: ``query()`` is True once ``landed`` is set."""

    landed = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return _Event.landed


def test_a_row_copied_from_the_gpu_is_known_once_its_event_completed_mocked_cuda_event(monkeypatch):
    class MockedCudaCopy(syncs.HostCopy):
        """The copy into a pinned ring row, with an event the mocked GPU reaches when ``_Event.landed`` is set."""

        def __init__(self, tensor: torch.Tensor, into: torch.Tensor | None = None) -> None:
            super().__init__(tensor)
            assert into is not None  # a CUDA row is copied into the ring
            self.host, self.event = into.copy_(tensor), _Event()

    monkeypatch.setattr(ampguard.scaler.row_copies, "HostCopy", MockedCudaCopy)
    monkeypatch.setattr(RowCopies, "_host_row", lambda self: torch.empty(4))  # pinned memory needs CUDA
    copies = RowCopies(torch.device("cuda"))
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    before = syncs._reads_by_ampguard
    copies.add(torch.tensor([1.0, 1.0, float("nan"), 1024.0]), held=True, unread=[optimizer], read_skips=0)
    _Event.landed = False
    assert copies.known() == [] and len(copies.pending) == 1  # the GPU has not got there: nothing waits for it
    _Event.landed = True
    (row,) = copies.known()
    assert (row.skipped, row.found, row.nonfinite_loss, row.held, row.unread) == (1, True, True, True, [optimizer])
    assert copies.known() == [] and syncs._reads_by_ampguard == before
    assert len(copies._free) == 1  # the ring row is used again
