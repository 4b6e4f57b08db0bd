"""The buffer guard with modules called under torch.inference_mode(): a teacher, an evaluation."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from islands_support import fresh_islands  # noqa: F401  (fixture)
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from test_buffers import POISONED, STEPS, batch, conv_net
from torch import nn

from ampguard.fp32_islands import healing

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


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
    assert not healing._active.stopped
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
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 100 == 0:
            model.eval()
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
                model(batch(99)[0])
    assert not records(ampguard_log, logging.WARNING, "probe stopped after an error")
    assert not healing._active.stopped
