"""SafeGradScaler against torch's GradScaler: same parameters bit for bit, exact skip counts, no extra host reads."""

from __future__ import annotations

import pytest
import torch
from scaler_support import OPTIMIZER_PARAMS, fault_steps, one_thread, safe, same_parameters, stock, train  # noqa: F401

import ampguard.scaler
import ampguard.scaler.diagnose
from ampguard.scaler import SafeGradScaler, next_scale
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread")

# Identical hyperparameters for both scalers; with these, neither ampguard's
# floor (1) nor its cap (2**24) is reached in 500 steps (checked below).
HYPER = {"init_scale": 512.0, "growth_factor": 1.5, "backoff_factor": 0.4, "growth_interval": 60}
STEPS = 500
# With injected faults: a faster growth so that the scale recovers between faults,
# without ever reaching the floor, the cap, or a natural fp16 overflow.
FAULT_HYPER = {"init_scale": 4096.0, "growth_factor": 1.5, "backoff_factor": 0.4, "growth_interval": 20}


def test_stock_scaler_is_torch_class():
    assert ampguard.scaler.TorchGradScaler.__module__ == "torch.amp.grad_scaler"
    assert not issubclass(ampguard.scaler.TorchGradScaler, SafeGradScaler)
    assert type(stock()) is ampguard.scaler.TorchGradScaler


@pytest.mark.parametrize("optimizer", OPTIMIZER_PARAMS)
def test_no_faults_parameters_bit_identical_to_torch(optimizer):
    torch_run = train(stock(**HYPER), optimizer=optimizer, steps=STEPS)
    safe_run = train(safe(**HYPER), optimizer=optimizer, steps=STEPS)
    assert same_parameters(torch_run.model, safe_run.model)
    assert not same_parameters(torch_run.model, train(stock(**HYPER), optimizer=optimizer, steps=0).model)
    stats = safe_run.scaler.stats
    assert stats.steps == STEPS and stats.skipped == 0 and stats.no_grad_steps == 0
    assert stats.scale == torch_run.scaler.get_scale() == safe_run.scaler.get_scale() == 512.0 * 1.5**8
    assert stats.min_scale_seen > 1.0 and stats.max_scale_seen < 2.0**24  # floor and cap never hit


@pytest.mark.parametrize("optimizer", OPTIMIZER_PARAMS)
def test_injected_faults_counted_exactly_and_parameters_bit_identical(optimizer):
    k = 12
    faults = fault_steps(k, STEPS)
    host_mode = optimizer in ("sgd", "adam")
    torch_run = train(stock(**FAULT_HYPER), optimizer=optimizer, steps=STEPS, faults=faults, check_every_step=True)
    safe_run = train(safe(**FAULT_HYPER), optimizer=optimizer, steps=STEPS, faults=faults, check_every_step=True)
    stats = safe_run.scaler.stats
    assert stats.skipped == k
    assert stats.steps == STEPS and stats.nonfinite_loss == 0
    assert same_parameters(torch_run.model, safe_run.model)
    assert safe_run.scales == torch_run.scales  # the device scale followed torch's every step
    assert min(torch_run.scales) > 1.0 and max(torch_run.scales) < 2.0**24
    assert stats.min_scale_seen == min(torch_run.scales) and stats.max_scale_seen == max([4096.0, *torch_run.scales])
    if host_mode:
        assert safe_run.mirror_mismatches == []  # the host mirror equals the device scale after every update


def test_injected_faults_with_clipping_counted_exactly():
    faults = fault_steps(12, STEPS, seed=11)
    torch_run = train(
        stock(**FAULT_HYPER), optimizer="sgd", steps=STEPS, faults=faults, clip=True, check_every_step=True
    )
    safe_run = train(safe(**FAULT_HYPER), optimizer="sgd", steps=STEPS, faults=faults, clip=True, check_every_step=True)
    assert safe_run.scaler.stats.skipped == 12
    assert same_parameters(torch_run.model, safe_run.model)
    assert safe_run.mirror_mismatches == []


def test_next_scale_replays_torch_update_rule():
    scale = torch.full((), 3.0, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    host_scale, host_tracker = 3.0, 0
    pattern = [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0] * 8
    for factors in ((2.0, 0.5), (1.7, 0.3), (3.0, 0.999)):
        for found in pattern:
            torch._amp_update_scale_(scale, tracker, torch.full((), float(found)), factors[0], factors[1], 3)
            host_scale, host_tracker = next_scale(host_scale, host_tracker, bool(found), factors[0], factors[1], 3)
            assert (host_scale, host_tracker) == (scale.item(), tracker.item())
    # growth that would overflow float32 keeps the scale and resets the tracker, as torch does
    big = torch.full((), 3e38, dtype=torch.float32)
    tracker.fill_(0)
    torch._amp_update_scale_(big, tracker, torch.zeros(()), 2.0, 0.5, 1)
    assert next_scale(big.item(), 0, False, 2.0, 0.5, 1) == (big.item(), tracker.item())


# -- host-device synchronisations ------------------------------------------------------

N = 60
EVERY = 20


def _count_reads(scaler, optimizer: str, faults=()) -> tuple[int, object]:
    with HostReadCounter() as reads:
        run = train(scaler, optimizer=optimizer, steps=N, faults=faults)
    return reads.total, run


@pytest.mark.parametrize("optimizer", OPTIMIZER_PARAMS)
def test_host_reads_at_most_torch_plus_one_per_stats_report(optimizer, reinstall):
    reinstall(AMPGUARD_STATS_EVERY=str(EVERY))
    torch_reads, _ = _count_reads(stock(**HYPER), optimizer)
    safe_reads, run = _count_reads(safe(**HYPER), optimizer)
    reports = N // EVERY
    assert torch_reads == {"sgd": N, "adam": N * 5}.get(optimizer, 0)  # Adam also reads its CPU step counters
    assert safe_reads <= torch_reads + reports
    if optimizer in ("sgd", "adam"):
        assert safe_reads == torch_reads  # host mode: the stats lines are free too
    else:
        assert safe_reads == reports  # device mode: one packed read per report
        with HostReadCounter() as reads:
            _ = run.scaler.stats
        assert reads.total == 0  # just folded by the last report
    assert run.scaler.stats.steps == N


@pytest.mark.parametrize("optimizer", OPTIMIZER_PARAMS)
def test_skipped_steps_cost_no_extra_host_read(optimizer, reinstall, monkeypatch):
    reinstall(AMPGUARD_STATS_EVERY="0")
    # diagnose (another module) may read once per interval to name parameters; the scaler itself must not.
    monkeypatch.setattr(ampguard.scaler.diagnose, "on_skipped_step", lambda *a, **k: None)
    faults = fault_steps(9, N, seed=5)
    torch_reads, _ = _count_reads(stock(**HYPER), optimizer, faults)
    safe_reads, run = _count_reads(safe(**HYPER), optimizer, faults)
    assert safe_reads == torch_reads
    with HostReadCounter() as reads:
        assert run.scaler.stats.skipped == 9
    assert reads.total == (0 if optimizer in ("sgd", "adam") else 1)


def test_stats_report_is_the_only_extra_read_in_device_mode(reinstall):
    reinstall(AMPGUARD_STATS_EVERY="7")
    scaler = safe(**HYPER)
    with HostReadCounter() as reads:
        train(scaler, optimizer="device_skip", steps=21)
    assert reads.by_source["ampguard.read_to_host"] == 3
    assert reads.by_source["aten::_local_scalar_dense"] == 0
