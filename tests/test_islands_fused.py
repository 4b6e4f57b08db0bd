"""fp32 islands and buffer restores with a fused optimizer (the scaler's device mode), against torch's scaler.

A fused optimizer (``AdamW(fused=True)``, the HF Trainer's default on torch >= 2.8)
is stepped without any host read, and ampguard adds none on a healthy step: the
host learns of a forward overflow when it reads the device-side counters (every
``AMPGUARD_STATS_EVERY`` steps here). From that read on, the probe watches and the
next overflow names the block, as with other optimizers.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from islands_support import EVERY, fresh_islands, make_net, train  # noqa: F401  (fixture)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from test_buffers import run
from test_islands import HYPER, ISLAND, global_hooks, module_hooks
from torch import nn

import ampguard.scaler
from ampguard import healing, syncs
from ampguard.syncs import HostReadCounter

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_islands"), needs_fused_adam]

READ_EVERY = 20  # AMPGUARD_STATS_EVERY in these tests: the host reads the device-side counters that often


def fused(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def test_a_block_overflowing_every_10th_batch_heals_after_the_next_read(reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY=str(READ_EVERY))
    steps = 300
    reference_model = make_net()
    reference = train(
        steps,
        model=reference_model,
        optimizer=fused(reference_model),
        scaler=ampguard.scaler.TorchGradScaler("cpu", **HYPER),
    )
    model = make_net()
    healed = train(steps, model=model, optimizer=fused(model))
    assert reference.nonfinite_losses == steps // EVERY == 30  # torch loses every 10th batch
    # Overflows at steps 10 and 20 (1-based) are found at the read of step 20; the probe then watches,
    # and the overflow of step 30 names the block. None after that.
    assert healed.nonfinite_losses == healed.scaler.stats.nonfinite_loss == 3
    assert healed.scaler.stats.fp32_islands == ("blocks.1.attn",)
    armed = records(ampguard_log, logging.INFO, "forward overflow in 2 of the last 20 steps (found at step 20")
    assert len(armed) == 1
    made = records(ampguard_log, logging.WARNING, "fp32 island:")
    assert len(made) == 1 and made[0].getMessage().startswith(ISLAND) and "step 30)" in made[0].getMessage()
    assert min(healed.scales) >= 1024.0  # the scale was never lowered for a forward overflow
    assert all(torch.isfinite(p).all() for p in healed.model.parameters())
    assert module_hooks(healed.model) == 2 and global_hooks() == 0  # the island's pair; the probe disarmed


def test_reads_cost_nothing_on_healthy_steps_and_one_per_step_only_while_the_probe_watches(reinstall):
    reinstall(AMPGUARD_STATS_EVERY=str(READ_EVERY))
    model = make_net()
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    reads_so_far: list[int] = []
    with HostReadCounter() as torch_reads:
        train(
            60,
            model=model,
            optimizer=fused(model),
            scaler=scaler,
            check_losses=False,
            after_update=lambda step: reads_so_far.append(syncs._reads_by_ampguard),
        )
    per_step = [now - before for before, now in itertools.pairwise(reads_so_far)]  # steps 2..60
    reads_at = {step: n for step, n in enumerate(per_step, start=2) if n}
    # The counters' reads at steps 20, 40 and 60; one read per step while the probe watches, from the
    # step after the read that armed it (21) to the overflow that named the block (30).
    assert reads_at == {20: 1, 40: 1, 60: 1} | {step: 1 for step in range(21, 31)}
    assert torch_reads.by_source["aten::_local_scalar_dense"] == 0  # torch's fused step reads nothing
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)


def test_a_healthy_fused_run_matches_torch_bit_for_bit_without_any_read(reinstall):
    reinstall(AMPGUARD_STATS_EVERY="0")
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
    assert not healing._active.probe.armed


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
    assert len(restored) == 1 and "here at step 8" in restored[0].getMessage()


def test_torch_leaves_the_buffers_poisoned_with_a_fused_optimizer(stock_torch):
    model, _, _ = run(torch.amp.GradScaler("cpu"), steps=8, poisoned=5, make_optimizer=fused)
    assert not all(torch.isfinite(b.float()).all() for b in model.buffers())


def test_islands_named_in_a_checkpoint_stop_being_looked_for_after_the_first_iteration(ampguard_log):
    healing.restore_islands(["blocks.9.attn"])
    model = make_net()
    train(3, model=model, optimizer=fused(model), healthy=True)
    assert global_hooks() == 0
    assert len(records(ampguard_log, logging.WARNING, "no module called since has them")) == 1
