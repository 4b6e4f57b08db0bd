"""The sampled measurement (ampguard.underflow.measure, ampguard.underflow.counts) and the policy's rule (ampguard.underflow.policy)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from underflow_support import AttentionNet, batches

from ampguard.underflow.counts import LOST_VALUE_SQUARE, Counts, Measurement, read
from ampguard.underflow.gradients import Gradients
from ampguard.underflow.measure import Sampler
from ampguard.underflow.policy import HEADROOM, MATERIAL, ScaleState, decide


class Node:
    """An autograd node as the sample's judgement of all-zero gradients walks it: what it feeds."""

    def __init__(self, *feeds: Node) -> None:
        self.next_functions = tuple((node, 0) for node in feeds)


def test_a_samples_rows_count_zeros_subnormals_and_sunk_gradients_exactly():
    sample = Gradients()
    sample.names[0] = "layer"
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
    # the second gradient (subnormal only: flushed) feeds, through a node no gradient was counted at, the last one
    # (all zero: lost whole); the third (all zero) is fed by a gradient with normal values
    fed, flushed, healthy = Node(), Node(), Node()
    flushed.next_functions = ((Node(fed), 0),)
    nodes = [healthy, flushed, Node(), Node()]
    healthy.next_functions = ((nodes[2], 0),)
    for node, gradient in zip(nodes, gradients):
        sample.add(0, node, gradient, counted=True)
    sample.add(0, fed, torch.tensor([0.0, 0.0, 0.0], dtype=torch.float16), counted=True)
    measurement, _ = read(sample, step=7, scale=1024.0)
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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = Sampler()
    sampler.arm()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(tokens).float(), labels)
    (loss * 1024).backward()
    sampler.count_parameters(optimizer)  # (its scaler's unscale_() has it count them)
    sampler.count_parameters(optimizer)  # once a sample
    measurement, _ = read(sampler.finish(), step=1, scale=1024.0)
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    names = set(measurement.modules)
    assert {"head", "blocks.0.qkv", "blocks.1.down"} <= names and "embed" not in names
    # the blocks' outputs are the float32 residual stream under autocast: not counted
    assert "blocks.0" not in names
    # The head's float16 gradients: its output's (32 x 4) and those of its float32 weight (4 x 32) and bias (4),
    # made of the float16 copies' (autocast's); its input's is counted as its caller's output.
    assert measurement.modules["head"].values == 32 * 4 + 4 * 32 + 4
    # A float32 module under autocast (a LayerNorm) has float32 gradients: neither its output's nor its
    # parameters' are counted.
    assert not any(name.endswith("norm") for name in names)
    # A step without the sampler armed counts nothing.
    gradients_before = [p.grad.clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(tokens).float(), labels)
    model.zero_grad()
    (loss * 1024).backward()
    assert not sampler.finish()
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


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_scaler_tells_its_listeners_of_an_unscale_before_the_gradients_are_unscaled(fused):
    """``on_unscale``: once per optimizer and iteration, before the gradients are divided (they still hold the
    scaled values), whether ``unscale_()`` is called by the user, by ``step()``, or inside a fused optimizer's step;
    never for a disabled scaler."""
    import ampguard
    from ampguard.scaler import listeners

    heard: list[float] = []

    class Listener(listeners.StepListener):
        def on_unscale(self, scaler, optimizer):  # type: ignore[no-untyped-def]
            heard.append(float(optimizer.param_groups[0]["params"][0].grad.abs().max()))

    model = nn.Linear(4, 4)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    except RuntimeError as error:  # (torch 2.3: no fused AdamW on the CPU)
        pytest.skip(f"no fused AdamW on this torch's CPU: {error}")
    listener = Listener()
    listeners.add(listener)
    try:
        for explicit in (True, False):
            scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0)
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            scaled = float(model.weight.grad.abs().max())
            if explicit:
                scaler.unscale_(optimizer)
                scaler.unscale_(optimizer)  # (a no-op: heard once)
            scaler.step(optimizer)
            scaler.update()
            assert heard == [scaled] and scaled == 1024.0 * 2.0  # (each weight's gradient: the batch's 2 ones)
            heard.clear()
        disabled = ampguard.SafeGradScaler("cpu", enabled=False)
        disabled.scale(model(torch.ones(2, 4)).sum()).backward()
        disabled.step(optimizer)
        assert heard == []
    finally:
        listeners.remove(listener)


class ViewOfChild(nn.Module):
    """Returns a view of a view of its child's output; its parent reshapes it again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(8, 2, 16).transpose(1, 2)


class Reshaping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = ViewOfChild()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x).reshape(8, 32)


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "full_backward_hook"])
def test_views_of_a_childs_output_at_any_depth_are_counted_once_in_the_child(hooked):
    """A module returning a view of a view of its child's output, a parent reshaping it, and a full backward hook
    (which wraps the module's outputs): the output's gradient is counted once, in the innermost module. Before:
    2-3 times (800 -> 1312 values)."""
    torch.manual_seed(0)
    model = Reshaping()
    if hooked:
        model.child.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    sampler = Sampler()
    sampler.arm()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(8, 16))
    out.float().pow(2).mean().backward()
    sampler.count_parameters(model.parameters())
    modules = read(sampler.finish(), step=2, scale=1.0)[0].modules
    assert set(modules) == {"child.lin"} and modules["child.lin"].values == 8 * 32 + 16 * 32 + 32


def test_a_backward_pass_that_raises_midway_lets_go_of_its_graph_at_the_next_forward():
    """An out-of-memory retry on a sampled step: the failed backward pass's nodes still hold the saved tensors
    below the failure; the sample lets go of them at the next forward pass's first module call (the retry),
    where it would otherwise keep the failed batch's activations until update(). A backward pass that completes
    keeps its nodes (their saved tensors freed) for the judgement of its all-zero gradients."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    sampler = Sampler()
    sampler.arm()
    with torch.autocast("cpu", dtype=torch.float16):
        hidden = model[0](torch.randn(8, 16))  # (saved by the second layer's node, below the failure)
        middle = model[1](hidden)
        out = model[2](middle)
    watched = weakref.ref(hidden)

    def out_of_memory(gradient: torch.Tensor) -> None:
        raise RuntimeError("out of memory (simulated)")

    middle.register_hook(out_of_memory)
    with pytest.raises(RuntimeError, match="simulated"):
        out.float().sum().backward()
    del hidden, middle, out
    gc.collect()
    assert watched() is not None  # (the failed pass's nodes: let go of at the next forward)
    with torch.autocast("cpu", dtype=torch.float16):
        retry = model(torch.randn(4, 16))
    gc.collect()
    assert watched() is None
    retry.float().sum().backward()
    entries = sampler.finish().entries
    assert [entry.node is not None for entry in entries] == [False, True, True, True]  # (failed: model[2]'s)
