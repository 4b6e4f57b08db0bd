"""Buffers are put back: BatchNorm's running statistics after a forward overflow, against torch's scaler."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from islands_support import fresh_islands  # noqa: F401  (fixture)(fixture)
from scaler_support import ampguard_log, one_thread, recipe_step, records  # noqa: F401  (fixtures)(fixtures)
from torch import nn

import ampguard.scaler
from ampguard.fp32_islands.patch import applied_healing
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


class Masked(nn.Module):
    """The logits of class 3 masked out through a buffer that holds -inf by design, as attention masks do."""

    def __init__(self, persistent: bool = True) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([0.0, 0.0, 0.0, float("-inf")]), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(torch.isinf(self.mask), -30.0)


def run(scaler, steps: int = STEPS, poisoned: int | None = POISONED, make_optimizer=sgd, model=None):
    """Train; returns the model and every buffer as it was just before the poisoned step and just after it."""
    model = conv_net() if model is None else model
    optimizer = make_optimizer(model)
    before = after = None
    for step in range(steps):
        x, y = batch(step, poisoned=step == poisoned)
        if step == poisoned:
            before = {name: b.clone() for name, b in model.named_buffers()}
        iteration(model, optimizer, scaler, x, y)
        if step == poisoned:
            after = {name: b.clone() for name, b in model.named_buffers()}
    return model, before, after


def batch(step: int, poisoned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 3, 8, 8, generator=gen)
    if poisoned:
        x = x * 1e5  # beyond float16's 65504 once autocast casts it for the convolution
    return x, torch.randint(0, 4, (4,), generator=gen)


def iteration(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler, x: torch.Tensor, y: torch.Tensor, new_scale=None
) -> None:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update(new_scale)


def two_models(poisoned: str, make_optimizer=sgd) -> dict[str, tuple[nn.Module, dict, dict]]:
    """Models A and B with scalers of their own, trained in turn (A's iteration, then B's), as a GAN is.

    ``poisoned`` ("A" or "B"): whose batch overflows at step POISONED. Returns per model its buffers
    just before that step's round and just after it.
    """
    models = {name: conv_net() for name in "AB"}
    optimizers = {name: make_optimizer(model) for name, model in models.items()}
    scalers = {name: torch.amp.GradScaler("cpu") for name in "AB"}
    kept: dict[str, tuple[dict, dict]] = {}
    for step in range(STEPS):
        if step == POISONED:
            before = {name: {n: b.clone() for n, b in m.named_buffers()} for name, m in models.items()}
        for name, model in models.items():
            iteration(
                model, optimizers[name], scalers[name], *batch(step, poisoned=step == POISONED and name == poisoned)
            )
        if step == POISONED:
            after = {name: {n: b.clone() for n, b in m.named_buffers()} for name, m in models.items()}
            kept = {name: (before[name], after[name]) for name in models}
    for name, scaler in scalers.items():
        assert scaler.stats.nonfinite_loss == int(name == poisoned)  # the counters read: device mode restores here
    return {name: (models[name], *kept[name]) for name in models}


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


@pytest.mark.parametrize("poisoned", ["A", "B"])
def test_two_models_with_scalers_of_their_own_each_get_their_buffers_back(poisoned):
    """Discovery spans the first scaler's round of the loop, both models; any scaler's overflow restores."""
    for name, (model, before, after) in two_models(poisoned).items():
        for buffer_name, value in model.named_buffers():
            assert torch.isfinite(value.float()).all(), (name, buffer_name)
        if name == poisoned:  # put back to their values from before the overflowing forward pass
            assert all(torch.equal(after[n], before[n]) for n in before), name


def test_a_buffer_holding_inf_by_design_is_left_alone_and_does_not_stop_the_restore():
    scaler = torch.amp.GradScaler("cpu")
    model, before, after = run(scaler, model=nn.Sequential(conv_net(), Masked()))
    assert scaler.stats.buffers_restored == 1
    for name, value in after.items():
        assert torch.equal(value, before[name]), name
    assert torch.isinf(model[1].mask).sum() == 1


def test_buffers_left_out_of_the_state_dict_are_not_guarded():
    """Masks and rotary tables are registered persistent=False: no forward pass updates them."""
    model = nn.Sequential(conv_net(), Masked(persistent=False))
    run(torch.amp.GradScaler("cpu"), model=model, poisoned=None)
    guarded = {id(b) for b in applied_healing().buffers.buffers}
    assert id(model[1].mask) not in guarded
    assert {id(b) for b in model[0].buffers()} <= guarded


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


def test_an_overflow_in_the_discovery_iteration_step_2_is_put_back(ampguard_log):
    """The first forward overflow at step 2, the iteration in which ampguard learns which buffers to guard."""
    scaler = torch.amp.GradScaler("cpu")
    model, before, after = run(scaler, poisoned=1)
    assert not all(
        torch.isfinite(b.float()).all() for b in run(ampguard.scaler.TorchGradScaler("cpu"), poisoned=1)[2].values()
    )
    assert scaler.stats.nonfinite_loss == 1 and scaler.stats.buffers_restored == 1
    for name, value in after.items():
        assert torch.equal(value, before[name]), name  # their values from before step 2's forward pass
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())
    restored = records(ampguard_log, logging.WARNING, "step 2 overflowed in the forward pass")
    assert len(restored) == 1 and "back to their values from before that forward pass" in restored[0].getMessage()
    assert "evaluation stays finite" not in restored[0].getMessage()


def test_an_overflow_at_step_1_before_any_copy_is_reported_once_with_what_stays_nan(ampguard_log):
    scaler = torch.amp.GradScaler("cpu")
    model, _, _ = run(scaler, poisoned=0)
    damaged = sum(int((torch.isnan(b) | (b == float("inf"))).sum()) for b in model.buffers() if b.is_floating_point())
    assert damaged > 0  # nothing could put them back: torch leaves them so too
    unrestored = records(ampguard_log, logging.WARNING, "could not be put back")
    assert len(unrestored) == 1
    message = unrestored[0].getMessage()
    assert message.startswith("step 1 overflowed in the forward pass") and f" {damaged:,} values in " in message
    assert "BatchNorm2d.running_mean" in message and "BatchNorm2d.running_var" in message
    assert not records(ampguard_log, logging.WARNING, "small buffers it guards back")


# -- The buffer guard with modules called under torch.inference_mode(): a teacher, an evaluation. ----------------------


def test_a_teacher_under_inference_mode_neither_stops_the_probe_nor_leaves_a_stale_buffer_copy(ampguard_log):
    """Discovery copies each module's buffers before its first call of the second iteration: for a teacher
    called under torch.inference_mode() that copy is an inference tensor, and the next healthy update's
    torch._foreach_copy_ into it raises "Inplace update to inference tensor outside InferenceMode". Caught:
    "forward-overflow probe stopped after an error ... does not arm again" at step 2 (no island can be made
    for the rest of the run), and the copy is never refreshed, so the overflow at step 6 puts the student's
    running statistics back to their values from before step 2 (steps 2-5 lost from them)."""
    student = conv_net()
    teacher = copy.deepcopy(student)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    before = None
    for step in range(STEPS):
        x, y = batch(step, poisoned=step == POISONED)
        if step == POISONED:
            before = {name: b.clone() for name, b in student.named_buffers()}
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.inference_mode():
                target = teacher(x)
            out = student(x)
            loss = nn.functional.cross_entropy(out, y) + nn.functional.mse_loss(out, target.clone())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == POISONED:
            after = {name: b.clone() for name, b in student.named_buffers()}
    assert not records(ampguard_log, logging.WARNING, "probe stopped after an error")
    assert not applied_healing().stopped
    assert scaler.stats.buffers_restored == 1
    for name, value in after.items():
        assert torch.equal(value, before[name]), name


def test_an_evaluation_under_inference_mode_after_the_first_step_does_not_stop_the_probe(ampguard_log):
    """The everyday loop "evaluate every N steps, from the first" (Lightning validates under inference_mode):
    the evaluation runs in the discovery iteration, the model's buffers are first copied under inference
    mode, and from step 2 on the probe is off for the whole run ("stopped after an error ... does not arm
    again"): no forward overflow of this run can be healed."""
    model = conv_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        model.train()
        x, y = batch(step)
        recipe_step(optimizer, scaler, lambda: nn.functional.cross_entropy(model(x), y))  # noqa: B023  (called at once)
        if step % 100 == 0:
            model.eval()
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
                model(batch(99)[0])
    assert not records(ampguard_log, logging.WARNING, "probe stopped after an error")
    assert not applied_healing().stopped
