"""The forward-overflow probe: which module turned finite inputs into inf/NaN, without a host read."""

from __future__ import annotations

import logging

import pytest
import torch
from islands_support import DIM, EVERY, Storm, batch, fresh_islands, make_net, probe_only, train  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)(fixtures)

from ampguard.fp32_islands import probe
from ampguard.fp32_islands.patch import applied_healing
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

OVERFLOWING = EVERY - 1  # batch 9 overflows inside blocks.1.attn


def _verdict(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, probe.Probe]:
    watcher = probe.Probe()
    watcher.arm()
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
        code = watcher.add_to(torch.zeros(()), 4.0)
        return int(code.item()) >> 2, watcher
    finally:
        watcher._hooks.disarm()  # the hooks off, the calls kept (disarm() forgets them)


def _named(model: torch.nn.Module, x: torch.Tensor) -> str | None:
    index, watcher = _verdict(model, x)
    call = watcher.call(index)
    return None if call is None else probe.qualified_name(call.module, call.root)


def test_names_the_innermost_module_whose_output_overflowed():
    assert _named(make_net(), batch(OVERFLOWING)[0]) == "blocks.1.attn"


def test_no_verdict_on_a_healthy_batch_or_one_that_is_already_nan():
    model = make_net()
    assert _verdict(model, batch(0)[0])[0] == 0
    poisoned = batch(0)[0]
    poisoned[0, 0, 0] = float("nan")
    assert _verdict(model, poisoned)[0] == 0  # inputs were not finite: no module is to blame


def test_modules_fed_inf_are_not_blamed():
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.Softmax(-1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x @ x.transpose(-1, -2))  # the overflow happens here, in Outer's own code

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.outer = Outer()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(x) + 1

    assert _named(Model(), torch.full((2, 3, 3), 300.0)) == "outer"  # not outer.norm, fed inf


def test_the_verdict_joins_the_scalers_one_read_and_costs_no_other():
    healthy = 2 * EVERY - 2
    with HostReadCounter() as reads:
        run = train(healthy, check_losses=False, after_update=lambda step: applied_healing().probe.arm())
    assert run.scaler.stats.steps == healthy
    assert reads.by_source["aten::_local_scalar_dense"] == healthy  # one per step: torch's own
    assert run.scaler.stats.nonfinite_loss == 1
    # diagnose at the skipped step, and whether its batch held inf/NaN (ampguard.fp32_islands.model_inputs)
    assert reads.by_source["ampguard.read_to_host"] == 2


def test_names_are_relative_to_the_model_inside_ddp(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        assert _named(torch.nn.parallel.DistributedDataParallel(make_net()), batch(OVERFLOWING)[0]) == "blocks.1.attn"
    finally:  # DDP is gone before the group: see examples/ddp_train.py (a rare gloo hang at exit on torch < 2.8)
        dist.destroy_process_group()


def test_a_compiled_model_is_reported_and_never_crashes(ampguard_log):
    compiled = torch.compile(make_net(), backend="eager")
    run = train(3 * EVERY, model=compiled)
    assert run.scaler.stats.fp32_islands == ()
    assert records(ampguard_log, logging.WARNING, "torch.compile'd model")
    assert all(torch.isfinite(p).all() for p in compiled.parameters())


# -- The fp32 islands' probe with an island that does not help (it overflows float32 too): it backs off. ---------------


@pytest.mark.usefixtures("probe_only")  # the probe's own behaviour (the watch would blame blocks.1.attn first)
def test_an_island_that_keeps_overflowing_makes_the_probe_back_off_not_re_arm_at_every_overflow(ampguard_log):
    """docs/islands.md: "Overflows that fp32 does not fix ... the steps stay skipped", and verdicts that make
    no island back the probe off (2, 4, 8 overflows let pass). Earlier, a verdict naming a module that already
    was an island counted as one that made an island (Healing.after_verdict: made_island=islands.holds(module)):
    the probe armed again at every other overflow for the whole run (here armed 6 times in 12 overflows, an INFO
    line each time, its hooks on every module call for half the run; with a fused optimizer a host read per step
    while armed), and nothing says the island did not help.
    """
    model = make_net()
    model.blocks[0].attn = Storm()
    armed: list[bool] = []
    run = train(12 * EVERY, model=model, after_update=lambda step: armed.append(applied_healing().probe.armed))
    assert run.scaler.stats.fp32_islands == ("blocks.0.attn",)
    assert run.nonfinite_losses == 12
    watching = sum(
        len(records(ampguard_log, level, "watching the next forward passes")) for level in (logging.INFO, logging.DEBUG)
    )
    assert watching <= 4  # as for a scripted block (test_islands): before, 6
    assert sum(armed) <= 4 * EVERY  # before: armed about half of the run's steps
