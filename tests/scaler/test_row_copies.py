"""A fused optimizer's skips, known on the host without a sync: the ledger rows' host copies (ampguard.scaler.ledger.RowCopies).

Before, with a fused optimizer (the HF Trainer's default), the host learned of a
forward overflow or a skipped step only at the next read of the device-side
counters (``AMPGUARD_STATS_EVERY``, default 500 steps): every overflowing batch
until then was lost, and LR schedulers advanced on skipped steps. On the CPU a
row is known at once; on CUDA an event is polled (mocked here: the GPU-only
part, ``..._mocked_cuda_event``), so a row is known an update or two later.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
from islands_support import EVERY, fresh_islands, fused_runs, make_net, probe_only, reads_by_step, train  # noqa: F401  (fixtures)(fixtures)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, recipe_step, records  # noqa: F401  (fixtures)(fixtures)
from scheduler_support import OVERFLOWS, Run, warmup_lambda
from torch import nn

import ampguard
import ampguard.scaler
from ampguard import syncs
from ampguard.scaler.ledger import RowCopies
from ampguard.stats.counters import process_counters
from ampguard.syncs import HostReadCounter

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_islands"), needs_fused_adam]


def fused(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


@pytest.mark.usefixtures("probe_only")  # with the headroom watch: 1 (tests/headroom_watch/test_headroom_watch.py)
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

    monkeypatch.setattr(ampguard.scaler.ledger, "HostCopy", MockedCudaCopy)
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


# -- Rows known on the host without a sync (ampguard.scaler.ledger.RowCopies), judged against what happened. -----------------


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
        recipe_step(optimizer, scaler, lambda: model(x).float().square().mean())  # noqa: B023  (called at once)
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
