"""SafeGradScaler settings, floor and cap, collapse and stall, stats, the stats line, device mode."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from scaler_support import (  # noqa: F401
    DeviceSkipSGD,
    ampguard_log,
    iteration,
    one_thread,
    records,
    safe,
    stock,
    tiny,
    train,
)

import ampguard
import ampguard.scaler.settings
from ampguard.scaler import SafeGradScaler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_override_log(monkeypatch):
    monkeypatch.setattr(ampguard.scaler.settings, "_overrides_logged", set())


# -- defaults, explicit arguments, environment ------------------------------------------


def test_defaults_are_1024_and_100_the_rest_as_torch():
    for scaler in (SafeGradScaler("cpu"), torch.amp.GradScaler("cpu")):
        assert isinstance(scaler, SafeGradScaler)
        assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 100
        assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (2.0, 0.5)
        assert scaler.is_enabled()
    torch_scaler = stock()
    assert (torch_scaler.get_scale(), torch_scaler.get_growth_interval()) == (65536.0, 2000)


def test_explicit_arguments_win_over_ampguard_defaults():
    scaler = torch.amp.GradScaler("cpu", 65536.0, 3.0, 0.25, 2000)
    assert (
        scaler.get_scale(),
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (
        65536.0,
        3.0,
        0.25,
        2000,
    )
    scaler = SafeGradScaler("cpu", init_scale=8.0, growth_interval=3)
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (8.0, 3)


def test_a_number_where_the_device_goes_is_an_error_that_says_so():
    with pytest.raises(TypeError, match=r"init_scale=1024\.0"):
        torch.amp.GradScaler(1024.0)


def test_environment_overrides_explicit_arguments_and_logs_once(reinstall, ampguard_log):
    reinstall(AMPGUARD_INIT_SCALE="4096", AMPGUARD_GROWTH_INTERVAL="7")
    first = torch.amp.GradScaler("cpu", init_scale=65536.0, growth_interval=2000)
    second = SafeGradScaler("cpu", init_scale=128.0, growth_interval=50)
    plain = SafeGradScaler("cpu")
    for scaler in (first, second, plain):
        assert (scaler.get_scale(), scaler.get_growth_interval()) == (4096.0, 7)
    overrides = records(ampguard_log, logging.INFO, "overrides")
    assert len(overrides) == 2
    assert "AMPGUARD_INIT_SCALE=4096 overrides the 65536" in overrides[0].getMessage()
    assert "AMPGUARD_GROWTH_INTERVAL=7 overrides the 2000" in overrides[1].getMessage()


def test_environment_override_applies_to_a_loaded_growth_interval(reinstall):
    reinstall(AMPGUARD_GROWTH_INTERVAL="7")
    scaler = safe()
    scaler.load_state_dict(stock().state_dict())
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (65536.0, 7)


# -- cap and floor -----------------------------------------------------------------------


def test_scale_never_grows_past_the_cap():
    model, opt = tiny()
    scaler = safe(init_scale=2.0**22, growth_interval=1)
    seen = []
    for _ in range(5):
        iteration(scaler, model, opt)
        seen.append(scaler._scale.item())
        assert scaler._counters.mirror_scale == seen[-1]
    assert seen == [2.0**23, 2.0**24, 2.0**24, 2.0**24, 2.0**24]
    assert scaler.stats.max_scale_seen == 2.0**24
    assert safe(init_scale=2.0**30).get_scale() == 2.0**24


def test_cap_from_environment_and_argument(reinstall):
    reinstall(AMPGUARD_MAX_SCALE="4096")
    model, opt = tiny()
    scaler = safe(init_scale=2048.0, growth_interval=1)
    for _ in range(3):
        iteration(scaler, model, opt)
    assert scaler._scale.item() == scaler.stats.scale == 4096.0
    assert safe(max_scale=100.0, init_scale=1000.0).get_scale() == 100.0


def test_scale_never_falls_below_the_floor(ampguard_log):
    model, opt = tiny()
    scaler = safe(init_scale=8.0)
    for _ in range(10):
        iteration(scaler, model, opt, fault=True)
        assert scaler._scale.item() == scaler._counters.mirror_scale >= 1.0
    stats = scaler.stats
    assert (stats.scale, stats.min_scale_seen, stats.skipped, stats.consecutive_skipped) == (1.0, 1.0, 10, 10)


def test_floor_from_environment_and_zero_means_no_floor(reinstall):
    reinstall(AMPGUARD_MIN_SCALE="16")
    model, opt = tiny()
    scaler = safe(init_scale=64.0)
    for _ in range(5):
        iteration(scaler, model, opt, fault=True)
    assert scaler._scale.item() == 16.0
    reinstall(AMPGUARD_MIN_SCALE="0")
    scaler = safe(init_scale=4.0)
    torch_scaler = stock(init_scale=4.0, growth_interval=100)
    for _ in range(8):
        iteration(scaler, model, opt, fault=True)
        iteration(torch_scaler, model, opt, fault=True)
    assert scaler._scale.item() == scaler._counters.mirror_scale == torch_scaler.get_scale() == 4.0 / 2**8
    assert safe(min_scale=0.0, init_scale=0.5).get_scale() == 0.5  # argument, no env


# -- collapse and stall ------------------------------------------------------------------


def _criticals(caplog, text):
    return records(caplog, logging.CRITICAL, text)


def test_collapse_at_the_floor_is_critical_once_per_episode(ampguard_log):
    model, opt = tiny()
    scaler = safe(init_scale=4.0, growth_interval=3)
    for _ in range(6):  # 4 -> 2 -> 1 (floor) -> overflow at the floor: collapse
        iteration(scaler, model, opt, fault=True)
    collapse = _criticals(ampguard_log, "collapsed")
    assert len(collapse) == 1
    message = collapse[0].getMessage()
    assert "the floor, AMPGUARD_MIN_SCALE=1" in message and "step 3 overflowed" in message
    for cause in ("bf16", "learning rate", "clip"):
        assert cause in message
    # intermittent overflows while the scale stays at the floor: the same episode
    for _ in range(4):
        iteration(scaler, model, opt)
        iteration(scaler, model, opt, fault=True)
    assert len(_criticals(ampguard_log, "collapsed")) == 1
    # the scale recovers out of the zone (1 -> 2 -> 4), then collapses again: a new episode
    for _ in range(6):
        iteration(scaler, model, opt)
    assert scaler.stats.scale == 4.0
    for _ in range(3):
        iteration(scaler, model, opt, fault=True)
    assert len(_criticals(ampguard_log, "collapsed")) == 2


def test_collapse_without_floor_when_the_scale_would_fall_below_one(reinstall, ampguard_log):
    reinstall(AMPGUARD_MIN_SCALE="0")
    model, opt = tiny()
    scaler = safe(init_scale=4.0)
    iteration(scaler, model, opt, fault=True)  # 4 -> 2
    iteration(scaler, model, opt, fault=True)  # 2 -> 1
    assert not _criticals(ampguard_log, "collapsed")
    iteration(scaler, model, opt, fault=True)  # 1 -> 0.5: below 1
    collapse = _criticals(ampguard_log, "collapsed")
    assert len(collapse) == 1 and "the floor" not in collapse[0].getMessage()
    assert scaler.stats.scale == 0.5


def test_stall_is_critical_after_max_consecutive_skips_once_per_streak(reinstall, ampguard_log):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="5")
    model, opt = tiny()
    scaler = safe(init_scale=2.0**20)
    for i in range(12):
        iteration(scaler, model, opt, fault=True)
        assert len(_criticals(ampguard_log, "consecutive")) == (1 if i >= 4 else 0)
    stall = _criticals(ampguard_log, "consecutive")[0].getMessage()
    assert stall.startswith("5 consecutive optimizer steps were skipped") and "AMPGUARD_ON_STALL=raise" in stall
    iteration(scaler, model, opt)
    for _ in range(5):
        iteration(scaler, model, opt, fault=True)
    assert len(_criticals(ampguard_log, "consecutive")) == 2


def test_stall_message_says_when_the_loss_itself_was_nonfinite(reinstall, ampguard_log):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="3")
    model, opt = tiny()
    scaler = safe()
    for _ in range(3):
        iteration(scaler, model, opt, loss_factor=float("inf"))
    assert "loss itself was inf/NaN" in _criticals(ampguard_log, "consecutive")[0].getMessage()
    assert scaler.stats.nonfinite_loss == 3


def test_stall_raises_scale_collapse_error_with_on_stall_raise(reinstall, ampguard_log):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="4", AMPGUARD_ON_STALL="raise")
    model, opt = tiny()
    scaler = safe(init_scale=2.0**20)
    for _ in range(3):
        iteration(scaler, model, opt, fault=True)
    with pytest.raises(ampguard.ScaleCollapseError, match="4 consecutive optimizer steps were skipped"):
        iteration(scaler, model, opt, fault=True)
    assert isinstance(ampguard.ScaleCollapseError("x"), RuntimeError)
    assert not _criticals(ampguard_log, "consecutive")  # raised instead of logged
    # the iteration was completed before raising: the scaler can go on (or be saved)
    assert scaler.stats.skipped == 4 and scaler._scale.item() == 2.0**16
    assert set(scaler.state_dict()) >= {"scale", "ampguard"}
    iteration(scaler, model, opt)
    assert scaler.stats.consecutive_skipped == 0


def test_stall_raised_message_says_what_happened(reinstall):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="2", AMPGUARD_ON_STALL="raise")
    model, opt = tiny()
    scaler = safe(init_scale=2.0**20)
    iteration(scaler, model, opt, fault=True)
    with pytest.raises(ampguard.ScaleCollapseError) as raised:
        iteration(scaler, model, opt, fault=True)
    message = str(raised.value)
    assert "stopped here because AMPGUARD_ON_STALL=raise" in message and "AMPGUARD_MAX_CONSECUTIVE_SKIPS=2" in message
    assert "Set AMPGUARD_ON_STALL=raise" not in message


@pytest.mark.parametrize("streak", [3, 5], ids=["at_the_limit", "past_the_limit"])
def test_resume_mid_stall_raises_at_the_next_skipped_step(reinstall, streak):
    """The XTTS recipe resumed with --continue_path from a checkpoint saved mid-stall: the guard holds."""
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="3")  # the run that saved it only warned
    model, opt = tiny()
    saving = safe(init_scale=2.0**20)
    for _ in range(streak):
        iteration(saving, model, opt, fault=True)
    state = saving.state_dict()
    assert state["ampguard"]["consecutive_skipped"] == streak
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="3", AMPGUARD_ON_STALL="raise")
    resumed = safe()
    resumed.load_state_dict(state)
    with pytest.raises(ampguard.ScaleCollapseError, match=f"{streak + 1} consecutive optimizer steps"):
        iteration(resumed, model, opt, fault=True)
    iteration(resumed, model, opt, fault=True)  # once per streak
    iteration(resumed, model, opt)
    assert resumed.stats.consecutive_skipped == 0


def test_resume_mid_stall_with_a_healthy_step_does_not_raise(reinstall):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="3", AMPGUARD_ON_STALL="raise")
    model, opt = tiny()
    state = safe(init_scale=2.0**20).state_dict() | {}
    state["ampguard"] = dict(state.get("ampguard") or {}, consecutive_skipped=7)
    resumed = safe()
    resumed.load_state_dict(state)
    iteration(resumed, model, opt)  # the streak ends: nothing to raise
    assert resumed.stats.consecutive_skipped == 0


def test_loading_torchs_state_says_which_settings_it_keeps(ampguard_log):
    model, opt = tiny()
    torch_scaler = stock()  # torch's defaults: 65536, every 2000 steps
    iteration(torch_scaler, model, opt)
    scaler = safe()
    scaler.load_state_dict(torch_scaler.state_dict())
    notes = [r.getMessage() for r in ampguard_log.records if "saved without ampguard" in r.getMessage()]
    assert len(notes) == 1
    assert "scale 65536 and growth interval 2000 are kept" in notes[0] and "AMPGUARD_GROWTH_INTERVAL" in notes[0]
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (65536.0, 2000)
    scaler.load_state_dict(scaler.state_dict())  # ampguard's own state: nothing to say
    assert len([r for r in ampguard_log.records if "saved without ampguard" in r.getMessage()]) == 1


def test_device_mode_stall_and_collapse_found_at_the_next_read(reinstall, ampguard_log):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="4", AMPGUARD_STATS_EVERY="0")
    model = torch.nn.Linear(4, 1)
    opt = DeviceSkipSGD(model.parameters())
    scaler = safe(init_scale=4.0)
    for _ in range(6):
        iteration(scaler, model, opt, fault=True)
    for _ in range(3):
        iteration(scaler, model, opt)  # both episodes ended before anyone looked
    assert not _criticals(ampguard_log, "")
    stats = scaler.stats  # the one read
    assert (stats.skipped, stats.consecutive_skipped, stats.scale, stats.min_scale_seen) == (6, 0, 1.0, 1.0)
    assert len(_criticals(ampguard_log, "collapsed")) == 1
    stall = _criticals(ampguard_log, "consecutive")
    assert len(stall) == 1 and stall[0].getMessage().startswith("6 consecutive")
    _ = scaler.stats  # a second read
    assert len(_criticals(ampguard_log, "")) == 2  # reported once


def test_device_mode_stall_raises_from_the_next_update(reinstall):
    reinstall(AMPGUARD_MAX_CONSECUTIVE_SKIPS="3", AMPGUARD_ON_STALL="raise", AMPGUARD_STATS_EVERY="0")
    model = torch.nn.Linear(4, 1)
    opt = DeviceSkipSGD(model.parameters())
    scaler = safe(init_scale=2.0**20)
    for _ in range(5):
        iteration(scaler, model, opt, fault=True)  # the device does not tell the host
    assert scaler.stats.consecutive_skipped == 5  # reading stats never raises
    scaler.state_dict()
    with pytest.raises(ampguard.ScaleCollapseError):
        iteration(scaler, model, opt, fault=True)
    iteration(scaler, model, opt, fault=True)  # once per streak


# -- accounting --------------------------------------------------------------------------


def test_stats_snapshot_attributes_and_as_dict():
    stats = safe().stats
    assert stats.as_dict() == {
        "steps": 0,
        "skipped": 0,
        "no_grad_steps": 0,
        "nonfinite_loss": 0,
        "scale": 1024.0,
        "min_scale_seen": 1024.0,
        "max_scale_seen": 1024.0,
        "consecutive_skipped": 0,
        "fp32_islands": [],
        "buffers_restored": 0,
        "headroom": [],
        "underflow_share": 0.0,
        "underflow_subnormal": 0.0,
        "underflow_lost": 0.0,
        "underflow_lost_norm": 0.0,
        "underflow_grad_peak": 0.0,
        "underflow_values": 0,
        "underflow_step": 0,
        "underflow_scale": 0.0,
        "underflow_samples": 0,
        "underflow_growths": 0,
        "underflow_modules": [],
    }
    with pytest.raises(AttributeError):
        stats.steps = 3  # a snapshot


def test_counts_with_two_optimizers_and_nonfinite_losses():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.01)
    second = torch.optim.Adam(model[1].parameters(), lr=0.01)
    scaler, torch_scaler = safe(), stock(init_scale=1024.0, growth_interval=100)
    model.in_features = 4
    plan = [(False, 1.0), (True, 1.0), (False, float("inf")), (False, 1.0), (False, float("nan")), (True, 1.0)]
    for fault, factor in plan:
        for s in (scaler, torch_scaler):
            iteration(s, model, first, second, fault=fault, loss_factor=factor)
            assert scaler._counters.mirror_scale == scaler._scale.item()
    stats = scaler.stats
    # steps and skipped count optimizer steps; nonfinite_loss counts iterations
    assert (stats.steps, stats.skipped, stats.nonfinite_loss, stats.no_grad_steps) == (12, 6, 2, 0)
    # torch halves its scale for all four skipped iterations; ampguard only for the two backward overflows:
    # a non-finite loss was not caused by the scale (docs/islands.md).
    assert torch_scaler.get_scale() == 1024.0 / 16 and stats.scale == 1024.0 / 4


def test_nonfinite_loss_counted_in_device_mode():
    model = torch.nn.Linear(4, 1)
    opt = DeviceSkipSGD(model.parameters())
    scaler = safe()
    for factor in (1.0, float("inf"), 1.0, float("nan"), float("inf")):
        iteration(scaler, model, opt, loss_factor=factor)
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.nonfinite_loss, stats.consecutive_skipped) == (5, 3, 3, 2)


def test_disabled_scaler_counts_steps_and_is_torchs_passthrough():
    model, opt = tiny()
    scaler = safe(enabled=False)
    before = model.weight.detach().clone()
    iteration(scaler, model, opt)
    assert not torch.equal(before, model.weight)
    assert scaler.stats.steps == 1 and scaler.stats.scale == 1.0 and scaler.state_dict() == {}


# -- the stats line ----------------------------------------------------------------------

# Each figure under the words that say what it counts: the interval (since the previous line), the whole run, now.
LINE = re.compile(
    r"^stats step=(\d+) scale=(\S+) \| this interval: skipped=(\d+) \| whole run: skipped_total=(\d+) "
    r"\((\d+\.\d\d)% of \1 steps\) no_grad=(\d+) nonfinite_loss=(\d+) scale_range=\S+\.\.\S+ clip_skipped=\d+( buffers_restored=\d+)?( underflow_growths=\d+)? "
    r"\| now: consecutive_skipped=\d+( \| last headroom watch: peak_per_module=\S+)?( \| last underflow sample: .*)?$"
)


def _stats_lines(caplog):
    return [r.getMessage() for r in records(caplog, logging.INFO, "stats step=")]


@pytest.mark.parametrize("optimizer", ["sgd", "device_skip"])
def test_periodic_stats_line_every_n_optimizer_steps(optimizer, reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY="10")
    train(safe(), optimizer=optimizer, steps=25, faults={3, 12, 14}, nonfinite_loss_steps={15})
    lines = _stats_lines(ampguard_log)
    assert len(lines) == 2
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [m.group(1, 3, 4, 5, 7) for m in parsed] == [("10", "1", "1", "10.00", "0"), ("20", "3", "4", "20.00", "1")]


def test_stats_line_only_on_rank_zero_and_off_with_zero(reinstall, ampguard_log, monkeypatch):
    reinstall(AMPGUARD_STATS_EVERY="5")
    monkeypatch.setenv("RANK", "1")
    train(safe(), steps=10)
    assert _stats_lines(ampguard_log) == []
    monkeypatch.setenv("RANK", "0")
    train(safe(), steps=10)
    assert len(_stats_lines(ampguard_log)) == 2
    reinstall(AMPGUARD_STATS_EVERY="0")
    train(safe(), steps=10)
    assert len(_stats_lines(ampguard_log)) == 2


def test_scale_changes_logged_at_debug(ampguard_log):
    model, opt = tiny()
    scaler = safe(init_scale=64.0, growth_interval=2)
    iteration(scaler, model, opt, fault=True)
    iteration(scaler, model, opt)
    iteration(scaler, model, opt)
    changes = [r.getMessage() for r in records(ampguard_log, logging.DEBUG, "loss scale")]
    assert changes == ["loss scale 64 -> 32 at step 1", "loss scale 32 -> 64 at step 3"]


# -- device mode ---------------------------------------------------------------------------


def test_update_with_new_scale_goes_through_device_mode_within_floor_and_cap():
    model, opt = tiny()
    scaler = safe()
    iteration(scaler, model, opt, update=False)
    scaler.update(300.0)
    assert scaler._counters.mirror_scale is None and scaler._scale.item() == 300.0
    assert scaler.stats.scale == 300.0  # folded
    iteration(scaler, model, opt, update=False)
    scaler.update(torch.tensor(0.25))
    assert scaler.stats.scale == 1.0  # the floor
    iteration(scaler, model, opt, update=False)
    scaler.update(2.0**30)
    stats = scaler.stats
    assert (stats.scale, stats.min_scale_seen, stats.max_scale_seen, stats.steps) == (2.0**24, 1.0, 2.0**24, 3)
    # back in host mode: the mirror follows the device again
    iteration(scaler, model, opt, fault=True)
    assert scaler._counters.mirror_scale == scaler._scale.item() == 2.0**23


def test_mixed_fused_and_plain_optimizers_counted_exactly_after_folding():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model.in_features = 4
    fused = DeviceSkipSGD(model[0].parameters())
    plain = torch.optim.SGD(model[1].parameters(), lr=0.01)
    scaler = safe()
    torch_scaler = stock(init_scale=1024.0, growth_interval=100)
    faults = [False, True, False, True, True, False]
    for fault in faults:
        iteration(scaler, model, fused, plain, fault=fault)
        iteration(torch_scaler, model, fused, plain, fault=fault)
    stats = scaler.stats
    # as torch: only the optimizer whose gradients overflowed skips; the scale backs off for both
    assert (stats.steps, stats.skipped, stats.consecutive_skipped) == (12, 3, 0)
    assert stats.scale == torch_scaler.get_scale() == scaler._scale.item() == 1024.0 / 8


def test_unscale_without_step_counts_no_skip_but_backs_off_as_torch():
    model, opt = tiny()
    scaler = safe()
    iteration(scaler, model, opt, update=False)
    scaler.update()
    for _ in range(2):  # a user that unscales, sees inf and does not step
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(2, 4)).float().sum()
        scaler.scale(loss).backward()
        model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        scaler.update()
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (1, 0, 256.0)
