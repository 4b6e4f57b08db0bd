"""The headroom watch against plain torch: fp32 islands made before the first forward overflow, or at it.

The nets are those of tests/support/islands_support.py (attention blocks whose query/key
weights are scaled up by ``sharpness``: their logits, ``q @ k.T`` inside the
attention's forward, are the largest float16 values of the model, and no
module returns them). Every run is fp16 autocast on the CPU with torch's recipe
loop (``unscale_``, ``clip_grad_norm_``, ``step``, ``update``) and the default
settings unless a test says otherwise (``AMPGUARD_WATCH_EVERY=100``,
``AMPGUARD_HEADROOM=4``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import pytest
import torch
from islands_support import BATCH, CLASSES, DIM, EVERY, TOKENS, Net, batch, fresh_islands, make_net, train  # noqa: F401
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from torch import nn

import ampguard
import ampguard.config
import ampguard.scaler
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

HYPER = {"init_scale": 1024.0, "growth_interval": 100}
RAMP_STEPS = 200
# Sharpness of the ramped net's second block: plain torch's first overflow comes at step ~110 (0-based 109).
RAMP_SHARPNESS = 44.0


@dataclass
class Run:
    model: nn.Module
    scaler: torch.amp.GradScaler
    nonfinite: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


def recipe(model: nn.Module, batches, optimizer: torch.optim.Optimizer | None = None, stock: bool = False) -> Run:
    """torch's AMP recipe: scale, backward, unscale_, clip, step, update (``stock``: torch's own GradScaler)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    scaler_class = ampguard.scaler.TorchGradScaler if stock else torch.amp.GradScaler
    run = Run(model, scaler_class("cpu", **HYPER))
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        if not torch.isfinite(loss):
            run.nonfinite.append(step)
        run.scaler.scale(loss).backward()
        run.scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.scaler.step(optimizer)
        run.scaler.update()
        run.scales.append(run.scaler.get_scale())
    return run


def ramped_batches(steps: int = RAMP_STEPS):
    """Random batches whose scale grows from 1 to 4 over 200 steps: the attention logits grow with its square."""
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(BATCH, TOKENS, DIM, generator=gen) * (1 + 3 * step / RAMP_STEPS)
        yield x, torch.randint(0, CLASSES, (BATCH,), generator=gen)


def ramped_net() -> Net:
    torch.manual_seed(0)
    return Net(blocks=2, hot=1, sharpness=RAMP_SHARPNESS)


def test_slowly_growing_attention_logits_get_their_island_before_the_first_overflow(ampguard_log):
    reference = recipe(ramped_net(), ramped_batches(), stock=True)
    assert 100 <= reference.nonfinite[0] <= 120 and 60 <= len(reference.nonfinite) <= 90  # plain torch: 70 of 200 lost
    outputs: list[float] = []  # what blocks.1.attn returns: far below its logits (the watch sees inside it)
    model = ramped_net()
    model.blocks[1].attn.register_forward_hook(lambda m, a, out: outputs.append(float(out.detach().abs().max())))
    healed = recipe(model, ramped_batches())
    assert healed.nonfinite == []  # not one lost batch
    assert healed.scaler.stats.nonfinite_loss == 0 and healed.scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert min(healed.scales) >= 1024.0  # never lowered for a forward overflow
    assert not records(ampguard_log, logging.CRITICAL)
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention)")
    assert len(made) == 1
    message = made[0].getMessage()
    assert "before any overflow" in message and "against float16's 65,504" in message
    peak = float(re.search(r"a peak of ([\d,]+) against", message).group(1).replace(",", ""))
    step = int(re.search(r"forward pass of step (\d+)", message).group(1))
    assert 65504 / 4 <= peak < 65504 and step < reference.nonfinite[0]  # within AMPGUARD_HEADROOM=4, in time
    assert max(outputs[:step]) < peak / 100  # the peak is the logits inside the module, not its output
    assert 'model.get_submodule("blocks.1.attn")' in message


def test_report_mode_names_the_module_before_the_overflow_and_changes_nothing(reinstall, ampguard_log):
    reinstall(AMPGUARD_FP32_ISLANDS="report")
    run = recipe(ramped_net(), ramped_batches(120))
    named = records(ampguard_log, logging.WARNING, "headroom watch: blocks.1.attn (Attention) came within")
    assert len(named) == 1 and "AMPGUARD_FP32_ISLANDS=report: nothing changed" in named[0].getMessage()
    assert run.scaler.stats.fp32_islands == () and run.nonfinite  # it overflows as without ampguard's islands
    assert not records(ampguard_log, logging.WARNING, "fp32 island:")


def test_a_sudden_overflow_is_blamed_at_once_on_the_module_the_watch_saw_closest(reinstall, ampguard_log):
    """Every 10th batch 8x louder (the logits 64x): no warning to act on. The first overflow's forward runs again and
    names the module (ampguard/fp32_islands/rerun.py); where it is not run again, the watch names it from what it saw
    at step 2 (a peak within 64x of the limit, the closest of all): 1 batch lost either way, not 2."""
    reference = recipe(make_net(), (batch(step) for step in range(3 * EVERY)), stock=True)
    assert reference.nonfinite == [9, 19, 29]
    healed = recipe(make_net(), (batch(step) for step in range(3 * EVERY)))
    assert healed.nonfinite == [9]
    assert healed.scaler.stats.fp32_islands == ("blocks.1.attn",) and min(healed.scales) >= 1024.0
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention) overflowed float16")
    assert len(made) == 1 and "step 10" in made[0].getMessage()
    reinstall(AMPGUARD_FORWARD_RERUN="off")
    ampguard_log.clear()
    healed = recipe(make_net(), (batch(step) for step in range(3 * EVERY)))
    assert healed.nonfinite == [9]
    assert healed.scaler.stats.fp32_islands == ("blocks.1.attn",) and min(healed.scales) >= 1024.0
    blamed = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention) is taken for")
    assert len(blamed) == 1 and "the headroom watch of step 2 saw it closest" in blamed[0].getMessage()
    assert not records(ampguard_log, logging.INFO, "watching the next forward passes")  # the probe never armed
    reinstall(AMPGUARD_WATCH_EVERY="off")  # the probe alone: one batch to arm it, one to name the module
    assert recipe(make_net(), (batch(step) for step in range(3 * EVERY))).nonfinite == [9, 19]


def healthy_net() -> Net:
    torch.manual_seed(0)
    return Net(blocks=2, hot=1, sharpness=0.3)  # logits in the tens: far from float16's limit


def test_a_healthy_model_gets_no_island_and_the_host_reads_of_torch():
    steps = 210  # the default watch's steps 2, 102 and 202, torch's growths at 100 and 200, and steps after each
    batches = [batch(step, healthy=True) for step in range(steps)]

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    reference_model = healthy_net()
    with HostReadCounter() as torch_reads:
        reference = recipe(reference_model, batches, adamw(reference_model), stock=True)
    model = healthy_net()
    with HostReadCounter() as ours:
        run = recipe(model, batches, adamw(model))
    assert ours.by_source == torch_reads.by_source  # watched steps (2, 102, 202) read nothing more
    assert run.scaler.stats.fp32_islands == () and run.nonfinite == reference.nonfinite == []
    assert run.scales == reference.scales
    for theirs, mine in zip(reference.model.parameters(), run.model.parameters()):
        assert torch.equal(theirs, mine)  # the watch observes, and changes nothing
    headroom = run.scaler.stats.headroom  # read when stats are read: the last watch (step 202) saw these
    assert len(headroom) == 3 and all(0 < peak < 65504 / 64 for _, peak in headroom)
    assert [peak for _, peak in headroom] == sorted((peak for _, peak in headroom), reverse=True)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("AMPGUARD_WATCH_EVERY", "-1"),
        ("AMPGUARD_WATCH_EVERY", "often"),
        ("AMPGUARD_WATCH_EVERY", "2.5"),
        ("AMPGUARD_HEADROOM", "0.5"),
        ("AMPGUARD_HEADROOM", "off"),
        ("AMPGUARD_HEADROOM", "inf"),
        ("AMPGUARD_HEADROOM", "1e6"),
        ("AMPGUARD_HEADROOM", "two bits"),
    ],
)
def test_bad_watch_settings_are_a_config_error(variable: str, value: str):
    with pytest.raises(ampguard.ConfigError) as caught:
        ampguard.config.load({variable: value})
    message = str(caught.value)
    assert caught.value.variable == variable and variable in message and repr(value) in message
    accepted = "a whole number >= 0, or off" if variable == "AMPGUARD_WATCH_EVERY" else "a number from 1 to 65504"
    assert accepted in message


@pytest.mark.parametrize(("value", "every"), [("0", 0), ("off", 0), ("1", 1), ("250", 250)])
def test_watch_every_values(value: str, every: int):
    assert ampguard.config.load({"AMPGUARD_WATCH_EVERY": value}).watch_every == every
    assert ampguard.config.load({}).watch_every == 100 and ampguard.config.load({}).headroom == 4.0


@needs_fused_adam
def test_with_a_fused_optimizer_the_first_overflow_is_blamed_at_its_own_update(reinstall, ampguard_log):
    """Device mode reads nothing per step: the step's row (ampguard/scaler/ledger.py, RowCopies) and the watch of step 2
    (its own host copy) are known without a read, so the first overflow (step 10) blames the block at its own
    update, after one read: did the batch hold inf/NaN? Before the row copies, the overflows waited for the
    counters' read at step 20: 2 lost."""
    import ampguard.syncs as syncs

    reinstall(AMPGUARD_STATS_EVERY="20")
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    reads: list[int] = []
    nonfinite: list[int] = []
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    with HostReadCounter() as torch_reads:
        for step in range(60):
            x, y = batch(step)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            before = syncs._reads_by_ampguard
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            reads.append(syncs._reads_by_ampguard - before)
            if not torch.isfinite(loss.detach()).item():
                nonfinite.append(step)
    # the overflow's inputs checked and its forward run again (step 10: one read each), then the counters' reads only
    assert {step: n for step, n in enumerate(reads, start=1) if n} == {10: 2, 20: 1, 40: 1, 60: 1}
    assert torch_reads.by_source["aten::_local_scalar_dense"] == 60  # the test's own .item(): torch reads nothing
    assert nonfinite == [9]  # blamed at its own update (the probe alone: also 19)
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)
    # named from step 10's forward run again (without it, the watch of step 2 blames the block: also at step 10)
    assert len(records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention) overflowed")) == 1


def test_the_watch_never_runs_while_the_probe_is_armed(reinstall):
    """They share the bits of the scaler's read. A block that overflows in any precision (a Storm: inf on loud
    batches) and no block near the limit: no suspect, so the probe arms at each overflow; the watch, due every 5
    steps, waits for it to disarm."""
    from islands_support import Storm

    from ampguard.fp32_islands.patch import applied_healing

    reinstall(AMPGUARD_WATCH_EVERY="5", AMPGUARD_FORWARD_RERUN="off")  # (run again, the first overflow names it)
    torch.manual_seed(0)
    model = Net(sharpness=0.3)
    model.blocks[0].attn = Storm()
    states: list[tuple[bool, bool]] = []
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    train(
        6 * EVERY,
        model=model,
        scaler=scaler,
        check_losses=False,
        after_update=lambda _: states.append((applied_healing().probe.armed, applied_healing().watch.watching)),
    )
    assert any(probe for probe, _ in states) and any(watch for _, watch in states)
    assert not any(probe and watch for probe, watch in states)
    assert scaler.stats.fp32_islands == ("blocks.0.attn",)  # found by the probe


def test_an_error_inside_the_watch_stops_it_with_one_warning_and_training_goes_on(monkeypatch, ampguard_log):
    from ampguard.headroom_watch.watched_pass import WatchedPass

    def broken(self, output):
        raise RuntimeError("broken")

    monkeypatch.setattr(WatchedPass, "measure", broken)
    run = recipe(make_net(), (batch(step) for step in range(3 * EVERY)))
    stopped = records(ampguard_log, logging.WARNING, "headroom watch stopped after an error")
    assert len(stopped) == 1 and "(RuntimeError: broken)" in stopped[0].getMessage()
    assert run.nonfinite == [9, 19]  # the probe, as without the watch
    assert run.scaler.stats.fp32_islands == ("blocks.1.attn",) and run.scaler.stats.headroom == ()


def test_the_host_copy_on_a_mocked_cuda_device_is_read_only_when_its_event_is_not_reached(monkeypatch):
    """On CUDA the watch's summary travels to pinned memory with a non-blocking copy and an event: used as it is
    once the event is reached (no read), read as anything else (counted) before. The device is mocked."""
    from ampguard import syncs

    class FakeEvent:
        reached = False

        def record(self) -> None:
            pass

        def query(self) -> bool:
            return FakeEvent.reached

    class FakeCudaTensor:
        device = type("Device", (), {"type": "cuda"})()
        shape = (3,)
        dtype = torch.float32

    pinned = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        pinned.append(pin_memory)
        return real_empty(*args, **kwargs)

    reads = []
    monkeypatch.setattr(syncs, "read_to_host", lambda tensor: reads.append(tensor) or [1.0, 2.0, 3.0])
    with monkeypatch.context() as patched:
        patched.setattr(torch, "empty", empty)
        patched.setattr(torch.cuda, "Event", FakeEvent)
        patched.setattr(torch.Tensor, "copy_", lambda self, source, non_blocking=False: self.fill_(7.0))
        copy = syncs.HostCopy(FakeCudaTensor())  # type: ignore[arg-type]
    assert pinned == [True]
    assert copy.values() == [1.0, 2.0, 3.0] and len(reads) == 1  # the event not reached: read (one sync)
    FakeEvent.reached = True
    assert copy.values() == [7.0, 7.0, 7.0] and len(reads) == 1  # reached: the host copy, no read


def test_the_islands_limit_applies_to_the_watch(reinstall, ampguard_log):
    from islands_support import applied_islands

    reinstall(AMPGUARD_MAX_ISLANDS="1")
    elsewhere = nn.Linear(2, 2)
    applied_islands().make(elsewhere, "elsewhere")  # the one island allowed
    run = recipe(ramped_net(), ramped_batches(105))
    assert run.scaler.stats.fp32_islands == ("elsewhere",) and run.nonfinite == []  # (the ramp's overflows: later)
    limit = records(ampguard_log, logging.WARNING, "AMPGUARD_MAX_ISLANDS=1: this model does not suit float16")
    assert len(limit) == 1 and limit[0].getMessage().startswith("blocks.1.attn (Attention) came within")
    assert not records(ampguard_log, logging.WARNING, "fp32 island:")
