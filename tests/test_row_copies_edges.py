"""Rows known on the host without a sync (ampguard.scaler.row_copies), judged against what happened."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from islands_support import fresh_islands, probe_only  # noqa: F401  (fixtures)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from test_islands_fused import reads_by_step
from test_row_copies import rows_one_update_late  # noqa: F401  (fixture)
from test_scheduler_hold import Run, warmup_lambda
from torch import nn

import ampguard
from ampguard.syncs import HostReadCounter

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_islands"), needs_fused_adam]


@pytest.mark.usefixtures("rows_one_update_late", "probe_only")
def test_an_overflow_the_probe_read_is_not_learned_again_from_its_row_one_update_later(ampguard_log):
    """Rows known one update late (a GPU's copies, mocked as in test_row_copies): the overflow at step 20 that the
    armed probe read itself and turned into the island is told again by its row at step 21, as an overflow nobody
    saw: the probe arms again (a read at each of steps 22..40) although nothing overflows any more."""
    reads_at, _torch_reads, islands = reads_by_step(40)
    assert islands == ("blocks.1.attn",)
    armed = records(ampguard_log, logging.INFO, "forward overflow in the step learned at step")
    assert len(armed) == 1, [r.getMessage()[:60] for r in armed]
    assert reads_at == {step: 1 for step in range(12, 21)}  # ampguard: also one at each of steps 22..40


def _batchnorm_run(skip_or_overflow: str) -> tuple[list[torch.Tensor], ampguard.ScalerStats]:
    """10 steps of a Linear-BatchNorm net with fused AdamW; batch 5 is dropped ("drop") or overflows ("overflow")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    generator = torch.Generator().manual_seed(1)
    for step in range(10):
        x = torch.randn(16, 8, generator=generator)
        if step == 5 and skip_or_overflow == "drop":
            continue
        if step == 5:
            x = x * 1e6  # float16 overflows in the forward pass: the loss is inf, the step is skipped
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return [b.clone() for b in model[1].buffers()], scaler.stats  # the scaler is freed: the next run's discovers


def test_a_fused_optimizer_s_forward_overflow_puts_batchnorm_back_as_it_was_before_that_batch(reinstall):
    """The overflow at step 5 is known at once (CPU row), but the BatchNorm statistics are put back to the copy taken
    at discovery (step 1): the running statistics of steps 2..4 are lost and num_batches_tracked rolls back by 4 (up
    to AMPGUARD_STATS_EVERY=500 steps in general). With a non-fused optimizer they equal the run without that batch.
    (Without the overflow's forward run again: the island it makes would compute layer 0 in float32 after step 5.)"""
    reinstall(AMPGUARD_FORWARD_RERUN="off")
    without, _ = _batchnorm_run("drop")
    healed, stats = _batchnorm_run("overflow")
    assert stats.skipped == stats.buffers_restored == 1
    assert int(healed[2]) == int(without[2]) == 9  # ampguard: 5
    assert torch.equal(healed[0], without[0]) and torch.equal(healed[1], without[1])


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_forward_overflow_with_update_new_scale_does_not_leave_batchnorm_nan(fused):
    """``scaler.update(new_scale)`` (device mode, the row not "held"): the forward overflow at step 5 is skipped and
    counted, but its BatchNorm statistics stay NaN (buffers_restored=0; with ``update()`` they are put back)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for step in range(8):
        x = torch.randn(16, 8) * (1e6 if step == 5 else 1.0)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update(1024.0)
    assert scaler.stats.nonfinite_loss == scaler.stats.skipped == 1
    assert torch.isfinite(model[1].running_mean).all() and torch.isfinite(model[1].running_var).all()


@pytest.mark.usefixtures("rows_one_update_late")
def test_a_scheduler_created_while_a_skip_is_unknown_does_not_hold_for_it_gpu_rows_mocked():
    """Rows known an update late (a GPU's copies, mocked by ``rows_one_update_late``): iteration 3 is skipped, a
    second scheduler is created after it, and the skip becomes known at iteration 4. The scheduler that existed at
    iteration 3 holds once (the catch-up), as before; the new one never advanced for iteration 3 and does not hold
    (before: it held, ending one step behind a scheduler created at the same point of a non-fused run)."""
    try:
        run = Run(warmup_lambda, {3}, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")
    plain = Run(warmup_lambda, {3})  # non-fused: the skip is known at its own step, before the new scheduler exists
    counters = []
    for training in (run, plain):
        counter = None
        for index in range(8):
            training.iteration(index)
            if counter is not None:
                counter.step()
            if index == 3:
                counter = torch.optim.lr_scheduler.StepLR(training.optimizer, step_size=1, gamma=1.0)  # only counts
        counters.append(counter)
    assert [counter.last_epoch for counter in counters] == [4, 4]  # iterations 4..7 all stepped; ampguard was: 3, 4
    assert run.scheduler.last_epoch == plain.scheduler.last_epoch == 7  # the first scheduler held once for the skip


@pytest.mark.usefixtures("rows_one_update_late")
def test_a_skip_whose_row_had_not_landed_at_a_read_of_the_counters_still_holds_gpu_rows_mocked():
    """Rows known an update late (mocked as above): iteration 3 is skipped and ``scaler.stats`` is read right after
    its update, before its row's copy landed. The read folds the ledger: that step is told there, and the scheduler
    holds once, as a non-fused run's does (before: the pending copy was dropped with the ledger, the skip never told,
    the schedule one step ahead of the plain run's for good)."""
    try:
        run = Run(warmup_lambda, {3}, fused=True)
    except RuntimeError:
        pytest.skip(f"Adam(fused=True) needs CUDA on torch {torch.__version__}")
    plain = Run(warmup_lambda, {3})
    for training in (run, plain):
        for index in range(8):
            training.iteration(index)
            if index == 3:
                assert training.scaler is not None and training.scaler.stats.skipped == 1
    assert run.scheduler.last_epoch == plain.scheduler.last_epoch == 7


def _fused_training(model_seed: int, overflow_at: set[int], steps: int) -> list[int]:
    """ampguard's host reads at each step of a fresh model, fused AdamW and scaler (all freed on return)."""
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    reads = []
    for step in range(steps):
        with HostReadCounter() as counter:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(16, 8)).float()
            if step in overflow_at:
                out = out * float("inf")
            scaler.scale(out.square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        reads.append(counter.by_source["ampguard.read_to_host"])
    return reads


def test_a_probe_armed_for_a_model_that_is_gone_does_not_read_every_step_of_the_next_one():
    """A notebook or a sweep: the first model's forward overflow armed the probe; that model and its scaler are freed,
    and the next model's healthy fused steps each pay a host read (up to AMPGUARD_PROBE_STEPS=200 of them)."""
    _fused_training(0, {1}, 3)
    gc.collect()
    assert _fused_training(1, set(), 6) == [0] * 6  # ampguard: [1, 1, 1, 1, 1, 1]
