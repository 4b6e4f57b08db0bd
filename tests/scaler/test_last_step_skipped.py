"""``scaler.last_step_skipped`` against torch's own skips: the check to use instead of "did the scale drop?".

The reference is torch's GradScaler on the same iterations, where a skip is an
optimizer step that did not run (its step post-hook did not fire). Under torch
every skip also halves the scale, so ``get_scale() < scale_before`` finds
them all; under ampguard a forward overflow (the loss itself inf/NaN) is skipped
without lowering the scale, and that idiom misses it.
"""

from __future__ import annotations

import pytest
import torch
from scaler_support import DeviceSkipSGD, iteration, one_thread, safe, stock  # noqa: F401 (a fixture)

from ampguard import syncs
from ampguard.scaler.ledger import RowCopies
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread")

INF, NAN = float("inf"), float("nan")
# (gradient fault, loss factor) per iteration
GRADIENT_FAULTS = [(False, 1.0), (True, 1.0), (False, 1.0), (True, 1.0), (True, 1.0), (False, 1.0), (False, 1.0)]
FORWARD_OVERFLOWS = [(False, 1.0), (False, INF), (False, 1.0), (True, 1.0), (False, NAN), (False, INF), (False, 1.0)]
SETTINGS = {"init_scale": 1024.0, "growth_interval": 3}


def _model_and_optimizer(optimizer_class: type) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, optimizer_class(model.parameters(), lr=0.05)


def _sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def torch_s_skips(plan) -> tuple[list[bool], list[bool]]:
    """torch's GradScaler: which steps did not run, and where ``get_scale() < scale_before``."""
    model, optimizer = _model_and_optimizer(_sgd)
    scaler = stock(**SETTINGS)
    steps_run = []
    optimizer.register_step_post_hook(lambda *_: steps_run.append(True))
    skipped, scale_dropped = [], []
    for fault, factor in plan:
        ran_before, scale_before = len(steps_run), scaler.get_scale()
        iteration(scaler, model, optimizer, fault=fault, loss_factor=factor)
        skipped.append(len(steps_run) == ran_before)
        scale_dropped.append(scaler.get_scale() < scale_before)
    return skipped, scale_dropped


def ampguard_s_skips(plan, optimizer_class: type = _sgd) -> tuple[list[bool], list[bool]]:
    """SafeGradScaler: ``last_step_skipped`` after each update, and where ``get_scale() < scale_before``."""
    model, optimizer = _model_and_optimizer(optimizer_class)
    scaler = safe(**SETTINGS)
    flags, scale_dropped = [], []
    for fault, factor in plan:
        before = scaler.get_scale()
        iteration(scaler, model, optimizer, fault=fault, loss_factor=factor)
        flags.append(scaler.last_step_skipped)
        scale_dropped.append(scaler.get_scale() < before)
    return flags, scale_dropped


def test_on_inf_gradients_last_step_skipped_is_torch_s_skip_pattern():
    torch_skipped, torch_dropped = torch_s_skips(GRADIENT_FAULTS)
    flags, dropped = ampguard_s_skips(GRADIENT_FAULTS)
    assert torch_skipped == [fault for fault, _ in GRADIENT_FAULTS]
    assert flags == torch_skipped
    assert dropped == torch_dropped == torch_skipped  # here the scale idiom works under both


def test_on_a_forward_overflow_last_step_skipped_is_true_where_the_scale_idiom_sees_nothing():
    torch_skipped, torch_dropped = torch_s_skips(FORWARD_OVERFLOWS)
    flags, dropped = ampguard_s_skips(FORWARD_OVERFLOWS)
    assert torch_skipped == [True if factor != 1.0 else fault for fault, factor in FORWARD_OVERFLOWS]
    assert flags == torch_skipped
    assert torch_dropped == torch_skipped  # torch halves the scale on every skip
    # ampguard keeps the scale for a forward overflow: "did the scale drop?" sees only the inf gradients
    assert dropped == [fault for fault, _ in FORWARD_OVERFLOWS]


@pytest.mark.parametrize("copies", [True, False], ids=["row copied", "no row copy"])
def test_with_a_fused_optimizer_the_flag_is_the_same_and_asking_reads_the_device_at_most_once(
    reinstall, monkeypatch, copies
):
    # Without fp32 islands: its probe, armed at the first read that finds a forward overflow, would read
    # every step after it (the next test).
    reinstall(AMPGUARD_DISABLE="fp32_islands", AMPGUARD_STATS_EVERY="0")
    if not copies:  # an accelerator without events to poll (ampguard/scaler/ledger.py, RowCopies)
        monkeypatch.setattr(RowCopies, "supported", staticmethod(lambda device: False))
    torch_skipped, _ = torch_s_skips(FORWARD_OVERFLOWS)
    with HostReadCounter() as reads:
        flags, dropped = ampguard_s_skips(FORWARD_OVERFLOWS, DeviceSkipSGD)
    assert flags == torch_skipped
    assert dropped == [fault for fault, _ in FORWARD_OVERFLOWS]
    # On the CPU the row is known at its own update: no read. Without the copy, one read per question (each
    # update leaves the verdict on the device).
    assert reads.by_source["ampguard.read_to_host"] == (0 if copies else len(FORWARD_OVERFLOWS))

    model, optimizer = _model_and_optimizer(DeviceSkipSGD)
    scaler = safe(**SETTINGS)
    with HostReadCounter() as reads:
        for fault, factor in FORWARD_OVERFLOWS:
            iteration(scaler, model, optimizer, fault=fault, loss_factor=factor)
    assert reads.total == 0  # nobody asked: nothing read


def test_while_the_probe_watches_a_fused_step_s_verdict_rides_on_its_read(reinstall):
    # After a forward overflow is found, fp32 islands' probe reads once per update; the verdict comes along.
    reinstall(AMPGUARD_STATS_EVERY="0")
    model, optimizer = _model_and_optimizer(DeviceSkipSGD)
    scaler = safe(**SETTINGS)
    iteration(scaler, model, optimizer, loss_factor=INF)
    assert scaler.last_step_skipped  # read: the forward overflow arms the probe
    # These losses overflow outside any module: the probe's third verdict without a module (the last
    # iteration here) makes it back off, and from then on the question reads again.
    plan = FORWARD_OVERFLOWS[:-1]
    flags = []
    for fault, factor in plan:
        iteration(scaler, model, optimizer, fault=fault, loss_factor=factor)
        before = syncs._reads_by_ampguard
        flags.append(scaler.last_step_skipped)
        assert syncs._reads_by_ampguard == before  # known already: no read of its own
    assert flags == torch_s_skips(plan)[0]


def test_before_any_step_without_gradients_and_disabled_it_is_false():
    model, optimizer = _model_and_optimizer(_sgd)
    scaler = safe(**SETTINGS)
    assert scaler.last_step_skipped is False
    iteration(scaler, model, optimizer, fault=True)
    assert scaler.last_step_skipped is True
    with torch.autocast("cpu", dtype=torch.float16):  # an iteration whose loss reaches no parameter
        loss = torch.ones(2, requires_grad=True).sum()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_step_skipped is False and scaler.stats.no_grad_steps == 1
    disabled = safe(enabled=False)
    iteration(disabled, model, optimizer, fault=True)
    assert disabled.last_step_skipped is False  # torch steps everything when disabled


def test_a_pickled_scaler_keeps_the_answer_but_not_the_optimizer_ids():
    import pickle

    model, optimizer = _model_and_optimizer(_sgd)
    scaler = safe(**SETTINGS)
    iteration(scaler, model, optimizer, fault=True)
    assert scaler._counters.last_stepped == {id(optimizer)}
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.last_step_skipped is True
    assert copy._counters.last_stepped == frozenset()  # ids are this process's: accelerate's flag does not use them


@pytest.mark.parametrize("optimizer_class", [_sgd, DeviceSkipSGD], ids=["host_mode", "device_mode"])
def test_two_optimizers_one_skipped_the_flag_is_true_and_accelerate_s_per_optimizer_answer_claims_neither(
    optimizer_class,
):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    weight_optimizer = optimizer_class([model.weight], lr=0.05)
    bias_optimizer = optimizer_class([model.bias], lr=0.05)
    scaler = safe(**SETTINGS)
    iteration(scaler, model, weight_optimizer, bias_optimizer, fault=True)  # the weight's gradient is inf
    assert scaler.last_step_skipped is True and scaler.stats.skipped == 1
    # accelerate steps and updates one optimizer at a time; an iteration of two cannot say which skipped
    assert not scaler.knows_skipped(weight_optimizer) and not scaler.knows_skipped(bias_optimizer)
    iteration(scaler, model, weight_optimizer, fault=True)
    assert scaler.last_step_skipped and scaler.knows_skipped(weight_optimizer)
    assert not scaler.knows_skipped(bias_optimizer)


# -- update(new_scale) with a non-fused optimizer: torch's step() read the verdict (found by review) --

NEW_SCALE_PLAN = [False, True, False, True, False]  # inf gradients in iterations 2 and 4


def _flags_and_reads(new_scale: float | None) -> tuple[list[bool], int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = safe(init_scale=1024.0, growth_interval=3)
    flags, reads_of_questions = [], 0
    for fault in NEW_SCALE_PLAN:
        iteration(scaler, model, optimizer, fault=fault, update=False)
        scaler.update() if new_scale is None else scaler.update(new_scale)
        with HostReadCounter() as reads:
            flags.append(scaler.last_step_skipped)
        reads_of_questions += reads.total
    return flags, reads_of_questions


def test_last_step_skipped_after_update_new_scale_with_sgd_reads_nothing(reinstall):
    reinstall(AMPGUARD_DISABLE="fp32_islands", AMPGUARD_STATS_EVERY="0")
    assert _flags_and_reads(None) == (NEW_SCALE_PLAN, 0)  # update(): free, as documented
    assert _flags_and_reads(512.0) == (NEW_SCALE_PLAN, 0)  # update(new_scale): one read per question
