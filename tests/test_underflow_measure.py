"""The sampled measurement (ampguard.underflow.measure, ampguard.underflow.counts) and the policy's rule (ampguard.underflow.policy)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from underflow_support import AttentionNet, batches

from ampguard.underflow.counts import LOST_VALUE_SQUARE, Counts, Measurement, Tally, read
from ampguard.underflow.measure import Sampler
from ampguard.underflow.policy import HEADROOM, MATERIAL, ScaleState, decide


def test_tally_counts_zeros_subnormals_and_sunk_gradients_exactly():
    tally = Tally("layer", torch.device("cpu"))
    tiny = 2.0**-24
    # 2 zeros, one value at 2**-24 and one at 2**-23 (the density flat: half of one zero estimated flushed, 0),
    # 2 higher subnormals, 4 normal values
    gradients = [
        torch.tensor([0.0, -0.0, tiny, -2 * tiny, 3 * tiny, 2.0**-16, 2.0**-14, 1.0, -3.0, 100.0], dtype=torch.float16),
        # no normal value, but nonzero ones: subnormal, not lost whole (before issue 32's estimate: all 3 lost)
        torch.tensor([0.0, tiny, 2.0**-15], dtype=torch.float16),
        torch.tensor([0.0, 0.0], dtype=torch.float16),  # all zero, computed from no flushed one: true zeros
        # 10 zeros, 4 values at 2**-24, 1 at 2**-23: the density rises toward zero 4x: 4 / 2 * 4 = 8 zeros flushed
        torch.tensor([0.0] * 10 + [tiny] * 4 + [2 * tiny, 1.0], dtype=torch.float16),
    ]
    for gradient in gradients:
        tally.add(gradient)
    tally.fed = True
    tally.add(torch.tensor([0.0, 0.0, 0.0], dtype=torch.float16))  # all zero, computed from a flushed one: lost
    measurement, _ = read([tally], step=7, scale=1024.0)
    counts = measurement.modules["layer"]
    energy = sum(float(g.double().square().sum()) for g in gradients)  # the kept values' squared norm
    assert counts.energy == pytest.approx(energy, rel=1e-6)
    assert counts == Counts(values=34, zeros=15, low=15 + 8, below_normal=26, sunk=3, peak=100.0, energy=counts.energy)
    assert counts.subnormal == 11 and counts.flushed == 8 + 3 and counts.underflow == 22
    assert measurement.underflow_share == 22 / 34 and measurement.subnormal_share == 11 / 34
    # the 11 values lost, each as a value below 2**-25, against the kept ones' norm (100 and 3 dominate): tiny
    lost = 11 * LOST_VALUE_SQUARE
    assert measurement.lost_norm_share == pytest.approx(math.sqrt(lost / (energy + lost)), rel=1e-6)
    assert measurement.lost_norm_share < 1e-8 < measurement.flushed_share


def test_sampler_counts_each_float16_gradient_once_per_module_and_leaves_no_hook():
    torch.manual_seed(0)
    model = AttentionNet()
    tokens, labels = batches(1)[0]
    sampler = Sampler()
    sampler.arm()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(tokens).float(), labels)
    (loss * 1024).backward()
    measurement, _ = read(sampler.finish(), step=1, scale=1024.0)
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    names = set(measurement.modules)
    assert {"head", "blocks.0.qkv", "blocks.1.down", "blocks.0"} <= names
    # The head's float16 gradients: its output (32 x 4), the float16 copies of its weight (4 x 32), bias (4)
    # and input (32 x 32); the transposed weight's, the same values, is not counted again.
    assert measurement.modules["head"].values == 32 * 4 + 4 * 32 + 4 + 32 * 32
    # A step without the sampler armed counts nothing.
    gradients_before = [p.grad.clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(tokens).float(), labels)
    model.zero_grad()
    (loss * 1024).backward()
    assert sampler.finish() == []
    # Observing changes nothing: the gradients of the sampled step equal those of the unsampled one.
    assert all(torch.equal(a, p.grad) for a, p in zip(gradients_before, model.parameters()))


def test_decide_grows_only_for_material_underflow_with_headroom_below_the_ceiling():
    def measured(lost: int, peak: float, scale: float = 1024.0) -> Measurement:
        return Measurement(1, scale, Counts(values=10_000, zeros=0, low=0, below_normal=0, sunk=lost, peak=peak))

    material = int(10_000 * MATERIAL) + 1
    assert decide(1024.0, 2.0, measured(material, 1.0))
    assert not decide(1024.0, 2.0, measured(material - 1, 1.0))  # below the threshold: torch's schedule
    subnormal = Measurement(1, 1024.0, Counts(values=10_000, zeros=0, low=0, below_normal=9_000, peak=1.0))
    assert not decide(1024.0, 2.0, subnormal)  # subnormal values are kept (fewer bits): no growth for them
    room = 65504.0 / HEADROOM / 2.0
    assert decide(1024.0, 2.0, measured(material, room))
    assert not decide(1024.0, 2.0, measured(material, room * 1.01))  # no headroom
    assert not decide(2048.0, 2.0, measured(material, room))  # torch's update grew the scale since: peak doubles
    assert not decide(1024.0, 2.0, measured(material, math.inf))
    assert not decide(1024.0, 2.0, measured(material, 1.0), ceiling=2048.0)  # 2048 overflowed last
    state = ScaleState()
    state.note_scale(1024.0, overflowed=True, backoff_factor=0.5)
    assert state.ceiling == 2048.0
    state.note_scale(2048.0, overflowed=False, backoff_factor=0.5)  # torch's schedule grew back to it
    assert state.ceiling == math.inf


def test_a_sample_nobody_finishes_disarms_itself():
    """A scaler dropped with a sample due, or training over: the hooks go after MAX_CALLS outermost calls."""
    model = nn.Linear(4, 4)
    sampler = Sampler()
    sampler.arm()
    for _ in range(Sampler.MAX_CALLS):
        model(torch.randn(2, 4))
    assert sampler.armed
    model(torch.randn(2, 4))
    assert not sampler.armed and not nn.modules.module._global_forward_hooks
