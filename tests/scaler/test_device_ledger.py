"""Device mode (fused optimizers): the rows written on the device replay to the host mode's numbers.

The reference is the same loop with a plain optimizer, whose iterations the
host sees one by one (host mode): the counts, the streak, the scale and its
range must be the same, over several rings of rows and across the read forced
after ``DeviceLedger.MAX_ROWS`` iterations.
"""

from __future__ import annotations

import pytest
import torch
from scaler_support import DeviceSkipSGD, ampguard_log, iteration, safe  # noqa: F401 (a fixture)

from ampguard.scaler import ledger
from ampguard.syncs import HostReadCounter

# (gradient fault, loss factor) per iteration: backward overflows, forward overflows (inf and NaN losses),
# a streak of four, healthy iterations in between.
PLAN = [
    (False, 1.0),
    (True, 1.0),
    (False, float("inf")),
    (False, 1.0),
    (True, 1.0),
    (True, 1.0),
    (False, float("nan")),
    (True, 1.0),
    (False, 1.0),
    (False, 1.0),
    (True, 1.0),
    (False, float("inf")),
    (False, 1.0),
    (False, 1.0),
]


def _run(optimizer_class: type, plan: list[tuple[bool, float]]):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = optimizer_class(model.parameters(), lr=0.05)
    scaler = safe(init_scale=2.0**10, growth_interval=3)
    scales = []
    for fault, factor in plan:
        iteration(scaler, model, optimizer, fault=fault, loss_factor=factor)
        scales.append(scaler._scale.item())
    return scaler, scales, model


def _host_sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def _numbers(stats):
    return (
        stats.steps,
        stats.skipped,
        stats.nonfinite_loss,
        stats.consecutive_skipped,
        stats.scale,
        stats.min_scale_seen,
        stats.max_scale_seen,
    )


def test_rows_replay_to_the_host_modes_counts_and_scale_range():
    host, host_scales, _ = _run(_host_sgd, PLAN)
    device, device_scales, _ = _run(DeviceSkipSGD, PLAN)
    assert device._counters.ledger is not None  # nothing read yet
    assert _numbers(device.stats) == _numbers(host.stats)
    # A forward overflow keeps the scale in both modes; only the backward ones halve it.
    assert min(device_scales) == min(host_scales) and device_scales[2] == device_scales[1]


def test_a_forward_overflow_neither_backs_off_nor_counts_toward_growth_in_both_modes():
    plan = [(False, 1.0), (False, float("inf")), (False, float("nan")), (True, 1.0), (False, float("inf"))]
    _, host_scales, _ = _run(_host_sgd, plan)
    _, device_scales, _ = _run(DeviceSkipSGD, plan)
    # growth_interval=3: the two forward overflows keep the scale and the growth tracker (before a fix in
    # issue 26 they counted toward growth: 2048 at the third); the backward fault halves it.
    assert device_scales == host_scales == [1024.0, 1024.0, 1024.0, 512.0, 512.0]


def test_rows_over_several_rings_and_the_read_forced_after_max_rows(monkeypatch, reinstall):
    # Without fp32 islands: the forward overflows would arm the probe at the first read, and while it
    # watches each update reads once more (tests/fp32_islands/test_islands_fused.py counts those reads).
    reinstall(AMPGUARD_DISABLE="fp32_islands")
    monkeypatch.setattr(ledger.DeviceLedger, "RING_ROWS", 3)
    monkeypatch.setattr(ledger.DeviceLedger, "MAX_ROWS", 5)
    plan = PLAN * 2
    host, _, _ = _run(_host_sgd, plan)
    with HostReadCounter() as reads:
        device, _, _ = _run(DeviceSkipSGD, plan)
    assert reads.by_source["ampguard.read_to_host"] == len(plan) // 5  # one read per 5 iterations, none between
    assert _numbers(device.stats) == _numbers(host.stats)


@pytest.mark.parametrize(("limit", "reports"), [(3, 1), (4, 1), (5, 0)])  # PLAN's longest streak: 4
def test_a_stall_between_two_reads_is_reported_once(limit, reports, reinstall, ampguard_log):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS=str(limit), AMPGUARD_STATS_EVERY="0")
    _ = _run(DeviceSkipSGD, PLAN)[0].stats  # the read
    stalls = [r for r in ampguard_log.records if "consecutive" in r.getMessage() and r.levelname == "CRITICAL"]
    assert len(stalls) == reports
