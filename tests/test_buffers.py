"""Buffers stay finite: BatchNorm's running statistics after a forward overflow, against torch's scaler."""

from __future__ import annotations

import logging

import pytest
import torch
from islands_support import fresh_islands  # noqa: F401  (fixture)
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from torch import nn

import ampguard.scaler
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

STEPS = 8
POISONED = 5  # this batch overflows float16 in the first convolution


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


def run(scaler, steps: int = STEPS, poisoned: int | None = POISONED, make_optimizer=sgd):
    """Train; returns the model and every buffer as it was just before the poisoned step and just after it."""
    model = conv_net()
    optimizer = make_optimizer(model)
    before = after = None
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 8, 8, generator=gen)
        if step == poisoned:
            x = x * 1e5  # beyond float16's 65504 once autocast casts it for the convolution
            before = {name: b.clone() for name, b in model.named_buffers()}
        y = torch.randint(0, 4, (4,), generator=gen)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == poisoned:
            after = {name: b.clone() for name, b in model.named_buffers()}
    return model, before, after


def test_buffers_are_restored_after_a_forward_overflow(ampguard_log):
    scaler = torch.amp.GradScaler("cpu")
    model, before, after = run(scaler)
    assert scaler.stats.nonfinite_loss == 1 and scaler.stats.buffers_restored == 1
    for name, value in after.items():
        assert torch.isfinite(value.float()).all(), name
        assert torch.equal(value, before[name]), name
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())
    assert len(records(ampguard_log, logging.WARNING, "small buffers it guards back")) == 1


def test_a_model_trained_after_another_has_its_own_buffers_guarded(ampguard_log):
    run(torch.amp.GradScaler("cpu"), poisoned=None)  # the first model; its scaler is freed when run() returns
    scaler = torch.amp.GradScaler("cpu")
    _, before, after = run(scaler)
    assert scaler.stats.buffers_restored == 1
    for name, value in after.items():
        assert torch.equal(value, before[name]), name


def test_torch_leaves_them_poisoned_and_so_does_the_disabled_patch(reinstall):
    _, _, torch_after = run(ampguard.scaler.TorchGradScaler("cpu"))
    assert not all(torch.isfinite(b.float()).all() for b in torch_after.values())
    reinstall(AMPGUARD_DISABLE="fp32_islands")
    _, _, disabled_after = run(torch.amp.GradScaler("cpu"))
    assert not all(torch.isfinite(b.float()).all() for b in disabled_after.values())


def test_guarding_healthy_steps_reads_nothing_and_changes_nothing():
    with HostReadCounter() as torch_reads:
        reference, _, _ = run(
            ampguard.scaler.TorchGradScaler("cpu", init_scale=1024.0, growth_interval=100), poisoned=None
        )
    with HostReadCounter() as reads:
        guarded, _, _ = run(torch.amp.GradScaler("cpu"), poisoned=None)
    assert reads.total == torch_reads.total
    for (name, ours), theirs in zip(guarded.named_buffers(), reference.buffers()):
        assert torch.equal(ours, theirs), name
    for ours, theirs in zip(guarded.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
