"""The underflow sampler against what real training loops do on a sampled step (issue 24).

Each test drives a tiny float16 model through SafeGradScaler on the CPU with ``AMPGUARD_UNDERFLOW=adapt`` and
compares with plain torch where results are concerned: the sample must never change a result, hold memory,
break a run or be skipped for good.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from scaler_support import DeviceSkipSGD, ampguard_log, one_thread, records, same_parameters, stock  # noqa: F401
from torch import nn
from underflow_support import AttentionNet, SlicesOfLinear, Tagged, TaggedNet, batches, train, transfers_known_after

import ampguard
import ampguard.containment as containment
import ampguard.scaler.listeners as listeners
import ampguard.underflow.nodes as node_kinds
from ampguard.underflow.counts import read
from ampguard.underflow.listener import UnderflowListener
from ampguard.underflow.measure import Sampler
from ampguard.underflow.policy import ScaleState

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _adapt(reinstall):
    reinstall(AMPGUARD_UNDERFLOW="adapt")


def state_of(scaler: Any) -> ScaleState:
    [listener] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    return listener.state_of(scaler._handle)  # (keyed by the handle the scaler gives its listeners)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train_step(
    model: Callable[[torch.Tensor], torch.Tensor],
    scaler: Any,
    optimizer: torch.optim.Optimizer,
    *,
    loss_factor: float = 1e-8,
    new_scale: float | None = None,
) -> None:
    """One float16-autocast iteration; the default loss factor sinks every gradient at a scale of 1024."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(4, 8))
    loss = out.float().pow(2).mean() * loss_factor
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update(new_scale)


def test_a_forward_with_grad_enabled_while_armed_is_freed_as_in_torch():
    """A validation forward without no_grad between two steps (the sampler armed): its graph dies with its output.
    Before: the sampler's set of visited nodes kept every graph walked alive until the sample's update."""
    model = TaggedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    train_step(model, scaler, optimizer)
    assert state_of(scaler).sampler.armed  # the first update arms the second step
    Tagged.markers.clear()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(64, 8))  # validation, grad enabled, never backwarded
    del out
    gc.collect()
    assert Tagged.markers and Tagged.markers[0]() is None


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")


def test_a_forward_that_raises_while_armed_leaves_no_hook_once_training_ends():
    """A loop that skips a batch whose forward raised (out of memory), then ends with the sample due: after the
    sampler's limit of outermost calls its hooks are gone. Before: the failed call's depth was never undone, no call
    counted as outermost again and the global hooks stayed for good."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    train_step(model, scaler, optimizer)
    sampler = state_of(scaler).sampler
    with pytest.raises(RuntimeError, match="simulated"):
        nn.Sequential(model, Fails())(torch.randn(4, 8))
    for _ in range(sampler.MAX_CALLS + 1):  # training is over; the model is used on
        model(torch.randn(4, 8))
    assert not sampler.armed


def test_an_iteration_of_more_than_64_module_calls_is_still_measured():
    """A forward that is no module call itself (a loop over 70 layers) and its backward: the sample counts them.
    Before: the sampler took the 65th outermost call for a sample nobody finishes, dropped it, and was armed again
    at every update (no sample ever measured, the hooks on every step)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(70))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    for _ in range(2):
        train_step(forward, scaler, optimizer)
    assert scaler.stats.underflow_samples == 1 and scaler.stats.underflow_values > 0


def test_a_sample_lost_to_a_long_validation_is_retried_after_the_interval_not_on_every_step(reinstall, monkeypatch):
    """A validation longer than the sampler's limit after every update: the armed sample is dropped each time.
    The next try comes AMPGUARD_UNDERFLOW_EVERY steps later. Before: armed again at every update, so every step
    ran with the hooks."""
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="5")
    monkeypatch.setattr(Sampler, "MAX_CALLS", 64)  # (the validation below: 70 batches, more than that)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    armed_after = []
    for _ in range(10):
        train_step(model, scaler, optimizer)
        armed_after.append(state_of(scaler).sampler.armed)
        with torch.no_grad():
            for _ in range(70):
                model(torch.randn(4, 8))
    assert sum(armed_after) <= 3, armed_after


def test_a_float16_nested_tensor_gradient_on_a_sampled_step_trains_as_without_the_patch(reinstall):
    """A float16 nested tensor through a module on a sampled step. Before: the backward pass raised from the
    sampler's node hook (aten::amax has no NestedTensor kernel)."""
    gradients = []
    for underflow in ("off", "adapt"):
        reinstall(AMPGUARD_UNDERFLOW=underflow)
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampguard.SafeGradScaler("cpu")
        train_step(model, scaler, optimizer)  # arms the next step (adapt)
        torch.manual_seed(1)
        lin = nn.Linear(8, 8).half()
        pieces = [torch.randn(2, 8, dtype=torch.float16), torch.randn(3, 8, dtype=torch.float16)]
        nested = torch.nested.nested_tensor(pieces, requires_grad=True)
        out = lin(nested)
        out.backward(torch.nested.nested_tensor([torch.ones(2, 8), torch.ones(3, 8)], dtype=torch.float16))
        train_step(model, scaler, optimizer)
        gradients.append(lin.weight.grad)
    assert torch.equal(gradients[0], gradients[1])


def test_a_failure_inside_the_samplers_hooks_falls_back_with_one_warning(monkeypatch, ampguard_log):
    """ampguard's own error in a node hook: one WARNING, the run goes on as torch's scaler would run it.
    Before: the error came out of the user's backward()."""
    from ampguard.underflow.gradients import Gradients

    def broken(self: Gradients, *args: object, **kwargs: object) -> None:
        raise ValueError("a bug in the sampler")

    monkeypatch.setattr(Gradients, "add", broken)
    monkeypatch.setattr(containment, "_reported", set())
    runs = []
    for scaler in (ampguard.SafeGradScaler("cpu"), stock(init_scale=1024.0, growth_interval=100)):
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(2)
        for _ in range(4):
            train_step(model, scaler, optimizer)
        runs.append((model, scaler.get_scale()))
    assert same_parameters(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] == 1024.0
    [warning] = records(ampguard_log, 30, "a bug in the sampler")
    assert "underflow" in warning.getMessage()


def test_update_with_a_new_scale_on_a_sampled_step_keeps_that_scale():
    """``update(new_scale)`` sets the scale, as torch's does, even when that update finishes a sample that would
    grow it. Before: 512 was asked for and 1024 set (grown for underflow)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    train_step(model, scaler, optimizer)
    assert state_of(scaler).sampler.armed
    train_step(model, scaler, optimizer, new_scale=512.0)
    assert scaler.get_scale() == 512.0


def test_the_float16_gradients_of_float16_parameters_are_counted():
    """A model held in float16 (``model.half()``, no autocast): its parameters' gradients are float16 gradients
    of the step. Linear(8, 4) on 16 rows: the output's 64 values, the weight's 32 and the bias's 4.
    Before: 64 (only the nodes' incoming gradients; a parameter's reaches no node but its accumulator)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = model(torch.randn(16, 8, dtype=torch.float16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.stats.underflow_values == 64 + 32 + 4


def test_a_module_running_in_another_thread_leaves_the_sampled_steps_module_names():
    """Another thread is inside a module's forward (a background encoder, a server) while the sampled step runs:
    the step's modules are still named by their qualified names. Before: the sampler's one call depth was shared
    by the threads, the step's outermost call was taken for a nested one and its modules were named by class."""
    entered, release = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            entered.set()
            release.wait(timeout=30)
            return x

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    train_step(model, scaler, optimizer)
    assert state_of(scaler).sampler.armed
    background = threading.Thread(target=lambda: Waits()(torch.zeros(1)))
    background.start()
    try:
        assert entered.wait(timeout=30)
        train_step(model, scaler, optimizer)
    finally:
        release.set()
        background.join(timeout=30)
    names = {name for name, _ in scaler.stats.underflow_modules}
    assert names and names <= {"0", "1", "2"}, names


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, DeviceSkipSGD])
def test_at_the_scale_cap_the_policy_stops_growing_and_sampling_every_step(reinstall, optimizer_class):
    """Underflow still material at AMPGUARD_MAX_SCALE: no growth is counted, and sampling goes back to every
    AMPGUARD_UNDERFLOW_EVERY steps. Before, in device mode (a fused optimizer): the growth refused on the device
    was counted as made, and every later step was sampled."""
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_MAX_SCALE="4096", AMPGUARD_UNDERFLOW_EVERY="100")
    model = tiny_model()
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    for _ in range(12):
        train_step(model, scaler, optimizer)
    stats = scaler.stats
    assert stats.scale == 4096.0  # 1024 -> 2048 -> 4096 at steps 2 and 3; step 4 finds the cap
    assert stats.underflow_growths == 2 and stats.underflow_samples == 3


@pytest.mark.parametrize(
    "optimizer_class",
    [
        torch.optim.SGD,
        DeviceSkipSGD,
    ],
)
def test_an_overflow_on_a_step_not_sampled_sets_the_ceiling(reinstall, monkeypatch, optimizer_class):
    """Step 5 overflows at 1024 (not a sampled step: samples at 2 and 7 with AMPGUARD_UNDERFLOW_EVERY=5): the
    next sample's decision sees 1024 as the ceiling, so underflow does not grow the scale back into it."""
    import ampguard.underflow.listener as listener_module

    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="5")
    ceilings: list[float] = []

    def never(
        scale: float, growth_factor: float, measurement: Any, ceiling: float = float("inf"), cap: float = float("inf")
    ) -> bool:
        ceilings.append(ceiling)
        return False

    monkeypatch.setattr(listener_module, "decide", never)
    model = tiny_model()
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    for step in range(1, 8):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8))
        scaler.scale(out.float().pow(2).mean() * 1e-8).backward()
        if step == 5:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == 512.0
    assert ceilings == [float("inf"), 1024.0]


def test_a_scalers_sample_counts_only_the_backward_passes_of_its_own_losses():
    """Two models with a scaler each, stepped in turn (a GAN's generator and discriminator): the loud model's
    gradients, scaled by its own scaler, are not the quiet scaler's underflow, and do not grow its scale. Before,
    each sample counted the other model's backward pass too: the quiet scaler measured 50% and grew to 2048."""
    quiet_model, loud_model = tiny_model(0), tiny_model(1)
    quiet_optimizer = torch.optim.SGD(quiet_model.parameters(), lr=0.1)
    loud_optimizer = torch.optim.SGD(loud_model.parameters(), lr=0.1)
    quiet, loud = ampguard.SafeGradScaler("cpu"), ampguard.SafeGradScaler("cpu")
    for _ in range(2):
        train_step(quiet_model, quiet, quiet_optimizer, loss_factor=1.0)
        train_step(loud_model, loud, loud_optimizer, loss_factor=1e-8)
    assert quiet.stats.underflow_share < 0.01 and quiet.get_scale() == 1024.0
    assert quiet.stats.underflow_values == loud.stats.underflow_values == 356  # each its own model's, as alone
    assert loud.stats.underflow_share > 0.5 and loud.get_scale() == 2048.0


class ReentrantNet(nn.Module):
    """Two blocks under reentrant activation checkpointing (each recomputed, and differentiated, inside the
    backward pass)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return self.head(h)


def test_a_backward_pass_nested_in_the_scalers_is_counted():
    """Reentrant checkpointing runs a backward pass of its own inside the scaler's, through the nodes of the
    blocks recomputed there: a sample that counts only its scaler's backward passes counts it too, as many values
    as a sampler counting every backward pass (no scaler) on the same model."""
    model = ReentrantNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    for _ in range(2):
        train_step(model, scaler, optimizer)
    sampler = Sampler()
    sampler.arm()
    fresh = ReentrantNet()
    with torch.autocast("cpu", dtype=torch.float16):
        out = fresh(torch.randn(4, 8))
    (out.float().pow(2).mean() * 1e-8 * 1024).backward()
    sampler.count_parameters(fresh.parameters())
    measurement, _ = read(sampler.finish(), step=2, scale=1024.0)
    assert scaler.stats.underflow_values == measurement.total.values > 0
    # the blocks' first forward runs without grad: each is counted once, in its recomputation, as without
    # checkpointing (embed 8 x 16 + 16 x 8 + 16, per block 4 x 16 + 256 + 16 and the ReLU's 4 x 16, head 84)
    assert measurement.total.values == 208 + 2 * (336 + 64) + 84
    assert {name for name, _ in scaler.stats.underflow_modules} & {"blocks.0.0", "blocks.1.0", "blocks.0.1"}


def test_a_parameters_accumulator_kept_alive_across_samples_is_never_hooked(reinstall, monkeypatch):
    """DistributedDataParallel (and other hook users) keep each parameter's AccumulateGrad node for the whole run.
    The sample hooks none: a parameter's gradient is counted once per sampled step, when its scaler is about to
    unscale it; the output's node is hooked on the sampled steps only (2 and 5)."""
    reinstall(AMPGUARD_UNDERFLOW="report", AMPGUARD_UNDERFLOW_EVERY="3")
    calls: list[int] = []
    count = Sampler.count
    monkeypatch.setattr(Sampler, "count", lambda self, *args: calls.append(1) or count(self, *args))
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]  # as DDP keeps them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    per_step = []
    for _ in range(6):
        calls.clear()
        optimizer.zero_grad(set_to_none=True)
        loss = model(torch.randn(16, 8, dtype=torch.float16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        per_step.append(len(calls))
    assert scaler.stats.underflow_samples == 2 and scaler.stats.underflow_values == 64 + 32 + 4
    assert per_step == [0, 1, 0, 0, 1, 0], per_step  # the output's node
    assert len(accumulators) == 2


def test_a_slices_gradient_is_counted_once_as_its_bases():
    """Slices and in-place writes through a slice are views: their gradients' values are their base's, counted
    once (docs/underflow.md). On 5 rows: lin's output 40, weight 64, bias 8, and the concatenation's output
    (5 x 9). Before: 292 (the four slices' 45 values, the two CopySlices' 40 each and the in-place view's
    10 counted again)."""
    sampler = Sampler()
    sampler.arm()
    torch.manual_seed(0)
    model = SlicesOfLinear()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(5, 8))
    out.float().sum().backward()
    sampler.count_parameters(model.parameters())
    measurement, _ = read(sampler.finish(), step=1, scale=1.0)
    assert measurement.total.values == 40 + 64 + 8 + 45


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_is_stepped_aside_and_trains_as_torch(how, ampguard_log, monkeypatch):
    """A model compiled whole (aot_eager: the backward is compiled too) has one backward node, whose incoming
    gradient is the model's output's only: the sample counts none of it and says so once, naming the region, and
    the scale follows torch's schedule. Before: ``torch.compile(model)``'s 16 output values of 356 were counted
    (6% lost where eager mode measures 100%) and the scale grew for them; ``model.compile()`` counted nothing,
    silently."""
    monkeypatch.setattr(node_kinds, "_said", set())
    values, scales = [], []
    for compiled in (False, True):
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampguard.SafeGradScaler("cpu")
        forward: Callable[[torch.Tensor], torch.Tensor] = model
        if compiled and how == "model.compile()":
            model.compile(backend="aot_eager")
        elif compiled:
            forward = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            train_step(forward, scaler, optimizer)
        values.append(scaler.stats.underflow_values)
        scales.append(scaler.get_scale())
    assert values == [356, 0] and scales == [2048.0, 1024.0]  # eager: all lost, grown; compiled: torch's 1024
    said = [r.getMessage() for r in records(ampguard_log, logging.INFO, "underflow sample")]
    if how == "torch.compile(model)":
        assert said == [node_kinds.COMPILED.format(region="OptimizedModule (torch.compile of Sequential)")]
    else:  # its module calls run compiled, where the sample cannot see them
        assert said == [node_kinds.UNSEEN]


def _fused_gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * x


class CallsACompiledFunction(nn.Module):
    """A layer whose forward calls a helper function (a fused activation), compiled or not."""

    def __init__(self, layer: nn.Module, helper: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.layer, self.helper = layer, helper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.helper(self.layer(x))


def half_compiled(how: str, compiled: bool) -> nn.Module:
    """Three layers; the middle one is a compiled submodule, or calls a compiled function, when ``compiled``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    if how == "submodule" and compiled:
        model[1] = torch.compile(model[1], backend="aot_eager")
    elif how == "function":
        helper = torch.compile(_fused_gelu, backend="aot_eager") if compiled else _fused_gelu
        model[1] = CallsACompiledFunction(model[1], helper)
    return model


@pytest.mark.parametrize("how", ["submodule", "function"])
def test_a_compiled_region_inside_an_eager_model_is_stepped_aside_and_the_rest_measured(how, ampguard_log, monkeypatch):
    """A submodule compiled on its own, or a helper function compiled inside an eager module: the region's
    gradients are not counted (one INFO line naming where it is), and every eager module is measured exactly as
    in the same model run eagerly (the reference: its counts per module, without the region's)."""
    monkeypatch.setattr(node_kinds, "_said", set())
    measured = []
    for compiled in (False, True):
        model = half_compiled(how, compiled)
        sampler = Sampler()
        sampler.arm()
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8))
        (out.float().pow(2).mean() * 1e-5).backward()
        measurement, _ = read(sampler.finish(), step=1, scale=1.0)
        measured.append(measurement.modules)
    eager, compiled_run = measured
    region = "1" if how == "submodule" else "called in 1 (a compiled function)"
    assert "1" in eager and "0" in eager and "2" in eager  # the region is measured when eager
    assert compiled_run == {name: counts for name, counts in eager.items() if name != "1"}
    said = [r.getMessage() for r in records(ampguard_log, logging.INFO, "compiled region")]
    if how == "submodule":
        region += " (torch.compile of Linear)"
    assert said == [node_kinds.COMPILED.format(region=region)]


def test_a_host_mode_sample_known_at_an_update_with_a_new_scale_is_read_mocked_cuda_event(monkeypatch, ampguard_log):
    """CUDA (mocked): a sample's counts are known one update late, and that update is ``update(new_scale)``
    (device mode for that iteration). The measurement is recorded, the caller's scale kept, nothing reported as
    ampguard's failure. Before: the listener unpacked the device mode's extra values from a host-mode sample
    (ValueError, contained: a WARNING calling it a bug, the measurement lost)."""
    import ampguard.underflow.listener as listener_module

    monkeypatch.setattr(listener_module, "Transfer", transfers_known_after(1))  # known an update late
    monkeypatch.setattr(containment, "_reported", set())
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    train_step(model, scaler, optimizer)  # arms step 2
    train_step(model, scaler, optimizer)  # step 2 sampled; its counts not known yet
    train_step(model, scaler, optimizer, new_scale=512.0)
    assert not records(ampguard_log, 30, "failed")
    assert scaler.stats.underflow_samples == 1 and scaler.stats.underflow_step == 2
    assert scaler.get_scale() == 512.0


def test_two_scalers_training_in_turn_each_measure_their_own_model(reinstall, one_thread):
    """Two models, each with its own scaler, trained in turn in one loop (a GAN's generator and discriminator;
    or two scalers loaded from one checkpoint): both samplers are armed at the same step, and each counts its
    own model's gradients only. Before, each counted both models' (the sampler's hooks are global): the quiet
    model (loss x 1) showed the loud one's underflow (loss x 1e-8), and under adapt would be grown for it."""
    reinstall(AMPGUARD_UNDERFLOW="report", AMPGUARD_UNDERFLOW_EVERY="5")
    alone = train(ampguard.SafeGradScaler("cpu"), steps=3).scaler.stats
    torch.manual_seed(0)
    models = [AttentionNet(), AttentionNet()]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    scalers = [ampguard.SafeGradScaler("cpu"), ampguard.SafeGradScaler("cpu")]
    for tokens, labels in batches(3):
        for model, optimizer, scaler, factor in zip(models, optimizers, scalers, (1.0, 1e-8)):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(tokens).float(), labels)
            scaler.scale(loss * factor).backward()
            scaler.step(optimizer)
            scaler.update()
    quiet, loud = (scaler.stats for scaler in scalers)
    assert loud.underflow_share > 0.5 and alone.underflow_share < 0.01
    assert quiet.underflow_values == loud.underflow_values == alone.underflow_values
    assert quiet.underflow_share < 0.01
