"""fp32 islands and buffer restores with a fused optimizer (the scaler's device mode), against torch's scaler.

A fused optimizer (``AdamW(fused=True)``, the HF Trainer's default on torch >= 2.8)
is stepped without any host read, and ampguard adds none on a healthy step. The
host learns of a forward overflow from the iteration's row copied to host memory
(tests/scaler/test_row_copies.py) or, where no copy can be polled (an accelerator other
than CUDA, the CPU here with the copies switched off: ``rows_known_at_reads_only``),
when it reads the device-side counters (every ``AMPGUARD_STATS_EVERY`` steps here).
These tests are of that second path: from that read on, the probe watches and the
next overflow names the block, as with other optimizers.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from islands_support import (  # noqa: F401  (fixture)
    EVERY,
    HYPER,
    Result,
    applied_islands,
    batch,
    fresh_islands,
    fused,
    fused_runs,
    make_net,
    probe_only,
    reads_by_step,
    train,
)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from test_buffers import Masked, conv_net, iteration, run, two_models
from test_islands import ISLAND, global_hooks, module_hooks
from torch import nn

import ampguard.scaler
import ampguard.scaler.ledger
from ampguard import syncs
from ampguard.fp32_islands.patch import applied_healing
from ampguard.syncs import HostReadCounter

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_islands", "rows_known_at_reads_only"), needs_fused_adam]


@pytest.fixture
def rows_known_at_reads_only(monkeypatch):
    """No ledger row copied to the host: the scaler learns of device-mode iterations only at its reads."""
    monkeypatch.setattr(ampguard.scaler.ledger.RowCopies, "supported", staticmethod(lambda device: False))


READ_EVERY = 20  # AMPGUARD_STATS_EVERY in these tests: the host reads the device-side counters that often


@pytest.mark.usefixtures("probe_only")  # with the watch: 2 lost (tests/headroom_watch/test_headroom_watch.py)
def test_a_block_overflowing_every_10th_batch_heals_after_the_next_read(reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY=str(READ_EVERY))
    steps = 300
    reference, healed = fused_runs(steps)
    assert reference.nonfinite_losses == steps // EVERY == 30  # torch loses every 10th batch
    # Overflows at steps 10 and 20 (1-based) are found at the read of step 20; the probe then watches,
    # and the overflow of step 30 names the block. None after that.
    assert healed.nonfinite_losses == healed.scaler.stats.nonfinite_loss == 3
    assert healed.scaler.stats.fp32_islands == ("blocks.1.attn",)
    armed = records(ampguard_log, logging.INFO, "forward overflow in 2 of the last 20 steps learned at step 20")
    assert len(armed) == 1
    made = records(ampguard_log, logging.WARNING, "fp32 island:")
    assert len(made) == 1 and made[0].getMessage().startswith(ISLAND) and "step 30)" in made[0].getMessage()
    assert min(healed.scales) >= 1024.0  # the scale was never lowered for a forward overflow
    assert all(torch.isfinite(p).all() for p in healed.model.parameters())
    assert module_hooks(healed.model) == 2 and global_hooks() == 0  # the island's pair; the probe disarmed


@pytest.mark.usefixtures("probe_only")  # the watch's reads: tests/headroom_watch/test_headroom_watch.py
def test_reads_cost_nothing_on_healthy_steps_and_one_per_step_only_while_the_probe_watches(reinstall):
    reinstall(AMPGUARD_STATS_EVERY=str(READ_EVERY))
    reads_at, torch_reads, islands = reads_by_step(60)
    # The counters' reads at steps 20, 40 and 60; one read per step while the probe watches, from the
    # step after the read that armed it (21) to the overflow that named the block (30).
    assert reads_at == {20: 1, 40: 1, 60: 1} | {step: 1 for step in range(21, 31)}
    assert torch_reads == 0  # torch's fused step reads nothing
    assert islands == ("blocks.1.attn",)


@pytest.mark.parametrize("copies", ["rows copied", "rows at reads only"])
def test_a_healthy_fused_run_matches_torch_bit_for_bit_without_any_read(reinstall, monkeypatch, copies):
    reinstall(AMPGUARD_STATS_EVERY="0")
    if copies == "rows copied":  # (the module's fixture switched them off)
        monkeypatch.setattr(ampguard.scaler.ledger.RowCopies, "supported", staticmethod(lambda device: True))
    reference_model, model = make_net(), make_net()
    with HostReadCounter() as torch_reads:
        reference = train(
            60,
            model=reference_model,
            optimizer=fused(reference_model),
            scaler=ampguard.scaler.TorchGradScaler("cpu", **HYPER),
            healthy=True,
            check_losses=False,
        )
    with HostReadCounter() as reads:
        guarded = train(60, model=model, optimizer=fused(model), healthy=True, check_losses=False)
    assert reads.total == torch_reads.total == 0
    assert global_hooks() == 0 and module_hooks(guarded.model) == 0
    for ours, theirs in zip(guarded.model.parameters(), reference.model.parameters()):
        assert torch.equal(ours, theirs)
    assert not applied_healing().probe.armed


def test_buffers_left_inf_by_a_forward_overflow_get_the_copy_from_the_previous_read(reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY="4")
    model, _, poisoned = run(torch.amp.GradScaler("cpu"), steps=8, poisoned=5, make_optimizer=fused)
    # (second: the buffers ampguard guards are those of the first model trained in the process)
    at_read, _, _ = run(torch.amp.GradScaler("cpu"), steps=4, make_optimizer=fused)  # as at the read of step 4
    assert not all(torch.isfinite(b.float()).all() for b in poisoned.values())  # the overflow (step 6) reached them
    for (name, value), kept in zip(model.named_buffers(), at_read.buffers()):
        assert torch.isfinite(value.float()).all(), name
        assert torch.equal(value, kept), name  # put back, at the read of step 8, to their values at step 4
    restored = records(ampguard_log, logging.WARNING, "back to their values at step 4")
    assert len(restored) == 1 and "learned of it at step 8" in restored[0].getMessage()


def test_a_buffer_holding_inf_by_design_does_not_stop_the_restore_at_the_read(reinstall):
    reinstall(AMPGUARD_STATS_EVERY="4")
    model = nn.Sequential(conv_net(), Masked())
    scaler = torch.amp.GradScaler("cpu")
    run(scaler, steps=8, poisoned=5, make_optimizer=fused, model=model)
    assert scaler.stats.buffers_restored == 1
    assert all(torch.isfinite(b.float()).all() for b in model[0].buffers())
    assert torch.isinf(model[1].mask).sum() == 1


@pytest.mark.parametrize("poisoned", ["A", "B"])
def test_two_models_with_scalers_of_their_own_each_get_their_buffers_back_at_the_read(reinstall, poisoned):
    """Another scaler's read between the overflow and its own keeps the copy finite where the buffers are not."""
    reinstall(AMPGUARD_STATS_EVERY="4")
    for name, (model, _, _) in two_models(poisoned, make_optimizer=fused).items():
        for buffer_name, value in model.named_buffers():
            assert torch.isfinite(value.float()).all(), (name, buffer_name)


def test_every_buffer_is_put_back_when_one_turned_inf_even_those_left_finite(reinstall):
    """A branch whose BatchNorm took the overflowing batch in with finite, huge statistics is put back too."""
    reinstall(AMPGUARD_STATS_EVERY="4")

    class TwoBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.main, self.side = conv_net(), nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.main(x) + self.side(x).mean((1, 2, 3))[:, None]  # side: finite at 1e5

    model = TwoBranches()
    run(torch.amp.GradScaler("cpu"), steps=8, poisoned=5, make_optimizer=fused, model=model)
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())
    assert model.side.running_var.max() < 10.0  # not the 1e10 variance of the overflowing batch


def test_an_overflow_seen_at_an_update_with_a_new_scale_does_not_hide_a_later_one(reinstall):
    """update(new_scale) does not hold a non-finite loss: the read must not count it against a held one."""
    reinstall(AMPGUARD_STATS_EVERY="4")
    model = conv_net()
    optimizer = fused(model)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(12):
        x, y = batch_of_conv(step)
        if step in (4, 8):
            x = x * 1e5  # the first arms the probe at the read of step 8... the second is seen while it watches
        if step == 9:
            x[0, 0, 0, 0] = float("nan")  # a corrupt batch, not seen by any update: found at the read of step 12
        iteration(model, optimizer, scaler, x, y, new_scale=1024.0 if step == 8 else None)
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())


@pytest.mark.usefixtures("probe_only")
def test_overflows_no_module_causes_make_the_probe_back_off_after_three_verdicts(reinstall, ampguard_log):
    """A corrupt batch every 30 steps: each verdict finds no module; then the probe looks less and less often."""
    reinstall(AMPGUARD_STATS_EVERY=str(READ_EVERY), AMPGUARD_PROBE_STEPS="50")
    model = make_net()
    optimizer = fused(model)
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    reads = []
    for step in range(300):
        x, y = batch(step, healthy=True)
        if step % 30 == 29:
            x = x.clone()
            x[0, 0, 0] = float("inf")
        before = syncs._reads_by_ampguard
        iteration(model, optimizer, scaler, x, y)
        reads.append(syncs._reads_by_ampguard - before)
    backing_off = records(ampguard_log, logging.INFO, "looks less often: its last 3 verdicts made no fp32 island")
    assert len(backing_off) == 1 and not applied_healing().probe.armed and global_hooks() == 0
    read_at = [step for step, n in enumerate(reads, start=1) if n and step % READ_EVERY]  # besides stats lines
    # Armed at the read of step 40 (the overflow of step 30), it watches through the verdicts of steps 60, 90
    # and 120 (a read per step), then lets 2 reads that found overflows pass (160, 180), arms at 220 (step 210),
    # watches to the 4th verdict (240), then lets 4 pass (260, 280, 300...).
    assert read_at == [step for step in [*range(41, 120), *range(221, 240)] if step % READ_EVERY]
    assert scaler.stats.nonfinite_loss == 10 and scaler.stats.fp32_islands == ()
    assert len(records(ampguard_log, logging.INFO, "watching the next forward passes")) == 1  # the rest at DEBUG


def _train_reading_stats(overflow_at: set[int], steps: int, read: str | None) -> tuple[nn.Module, Any]:
    model = make_net()
    optimizer = fused(model)
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    for step in range(steps):
        x, y = batch(step, healthy=True)
        if step in overflow_at:
            x = x * 8.0  # the hot block overflows float16 (islands_support's bad batch)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        if read == "before scale()":
            assert scaler.stats.steps == step  # a user logging the counters after the forward pass
        scaler.scale(loss).backward()
        if read == "after backward()":
            assert scaler.stats.steps == step
        scaler.step(optimizer)
        scaler.update()
    return model, scaler  # (islands are named while their module lives)


@pytest.mark.parametrize("read", ["after backward()", "before scale()"])
def test_a_read_in_the_middle_of_an_iteration_arms_the_probe_for_the_next_forward_pass(reinstall, ampguard_log, read):
    """The read in step 11 finds step 10's overflow; step 11's forward pass was over before the probe armed."""
    reinstall(AMPGUARD_STATS_EVERY="0")
    _model, scaler = _train_reading_stats({9, 10, 25}, steps=40, read=read)
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert not records(ampguard_log, logging.WARNING, "no module turned finite inputs into inf/NaN")


def test_the_ledger_s_forced_read_arms_the_probe_for_the_next_forward_pass(reinstall, monkeypatch, ampguard_log):
    """The read forced after MAX_ROWS iterations comes at the end of an update: the next forward is watched."""
    reinstall(AMPGUARD_STATS_EVERY="0")
    monkeypatch.setattr(ampguard.scaler.ledger.DeviceLedger, "MAX_ROWS", 5)
    _model, scaler = _train_reading_stats({2, 5}, steps=8, read=None)  # the forced read at the 5th update
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)  # named at step 6's overflow
    assert not records(ampguard_log, logging.WARNING, "no module turned finite inputs into inf/NaN")


def test_an_overflow_after_a_read_in_the_middle_of_an_accumulated_iteration_still_gets_its_buffers_back(reinstall):
    """Two micro-batches; the read after the first arms the probe, the second overflows: its buffers come back."""
    reinstall(AMPGUARD_STATS_EVERY="0")
    model = conv_net()
    optimizer = fused(model)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(12):
        optimizer.zero_grad()
        for micro in range(2):
            x, y = batch_of_conv(10 * step + micro)
            if (step, micro) in {(4, 1), (5, 1)}:
                x = x * 1e5
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y) / 2
            scaler.scale(loss).backward()
            if (step, micro) == (5, 0):
                assert scaler.stats.nonfinite_loss == 1  # step 4's
        scaler.step(optimizer)
        scaler.update()
    assert scaler.stats.nonfinite_loss == 2 and scaler.stats.buffers_restored == 2
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())


def batch_of_conv(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def test_torch_leaves_the_buffers_poisoned_with_a_fused_optimizer(stock_torch):
    model, _, _ = run(torch.amp.GradScaler("cpu"), steps=8, poisoned=5, make_optimizer=fused)
    assert not all(torch.isfinite(b.float()).all() for b in model.buffers())


def test_islands_named_in_a_checkpoint_stop_being_looked_for_after_the_first_iteration(ampguard_log):
    applied_islands().checkpoint.restore(["blocks.9.attn"], None, full_names=True)  # as a loaded checkpoint does
    model = make_net()
    train(3, model=model, optimizer=fused(model), healthy=True)
    assert global_hooks() == 0
    assert len(records(ampguard_log, logging.WARNING, "the models being trained have no such module")) == 1


def test_an_overflow_in_the_discovery_iteration_step_2_is_put_back_at_the_read(reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY="4")
    scaler = torch.amp.GradScaler("cpu")
    model, _, poisoned = run(scaler, steps=8, poisoned=1, make_optimizer=fused)
    assert not all(torch.isfinite(b.float()).all() for b in poisoned.values())  # step 2's overflow reached them
    assert scaler.stats.buffers_restored == 1
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())
    restored = records(ampguard_log, logging.WARNING, "back to their values at step 1")
    assert len(restored) == 1 and "learned of it at step 4" in restored[0].getMessage()
    assert not records(ampguard_log, logging.WARNING, "could not be put back")


def test_an_overflow_at_step_1_is_reported_at_the_read_with_what_stays_nan(reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY="4")
    scaler = torch.amp.GradScaler("cpu")
    run(scaler, steps=8, poisoned=0, make_optimizer=fused)
    assert scaler.stats.buffers_restored == 0
    unrestored = records(ampguard_log, logging.WARNING, "could not be put back")
    assert len(unrestored) == 1 and "BatchNorm2d.running_var" in unrestored[0].getMessage()


@pytest.mark.parametrize("optimizer_kind", ["fused (rows copied)", "fused (rows at reads only)", "foreach (host mode)"])
def test_a_nonfinite_loss_with_finite_gradients_is_no_forward_overflow(
    reinstall, monkeypatch, ampguard_log, optimizer_kind
):
    """A loss made inf by a term without gradient (``+ inf``): the gradients are finite, the step is taken, as in
    torch, and no module overflowed, so the probe is not armed. Device mode counted every non-finite loss as a
    forward overflow (the probe watched the next forward passes), host mode only those whose step was skipped."""
    reinstall(AMPGUARD_STATS_EVERY="4")
    if optimizer_kind == "fused (rows copied)":
        monkeypatch.setattr(ampguard.scaler.ledger.RowCopies, "supported", staticmethod(lambda device: True))
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    fused_kind = optimizer_kind.startswith("fused")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused_kind, foreach=None if fused_kind else True)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(8):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4)).float().sum()
        if step == 2:
            loss = loss + torch.tensor(float("inf"))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    stats = scaler.stats
    assert (stats.nonfinite_loss, stats.skipped, stats.scale) == (1, 0, 1024.0)
    assert not records(ampguard_log, logging.INFO, "forward overflow")
    assert not applied_healing().probe.armed
