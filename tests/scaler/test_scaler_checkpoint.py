"""Checkpoints: torch's five keys plus ampguard's counters, loadable both ways, weights_only, pickling."""

from __future__ import annotations

import copy
import logging
import math
import pickle

import pytest
import torch
from scaler_support import (  # noqa: F401
    ampguard_log,
    iteration,
    one_thread,
    records,
    safe,
    same_parameters,
    stock,
    tiny,
    train,
)

from ampguard.scaler import SafeGradScaler

pytestmark = pytest.mark.usefixtures("one_thread")

TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
HYPER = {"init_scale": 4096.0, "growth_factor": 1.5, "backoff_factor": 0.4, "growth_interval": 20}
FAULTS_A = {2, 3, 17, 29}
FAULTS_B = {5, 9, 31}


def _plain(value) -> bool:
    """Python numbers, strings, lists and dicts only (what a weights_only load takes in every supported torch)."""
    if isinstance(value, list):  # fp32_islands: module names; the underflow measurement's counts
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return type(value) in (int, float, str)


def test_state_dict_keeps_torchs_five_keys_and_adds_plain_counters():
    torch_run = train(stock(**HYPER), steps=40, faults=FAULTS_A)
    safe_run = train(safe(**HYPER), steps=40, faults=FAULTS_A)
    state, torch_state = safe_run.scaler.state_dict(), torch_run.scaler.state_dict()
    assert set(state) == TORCH_KEYS | {"ampguard"} and set(torch_state) == TORCH_KEYS
    assert {k: state[k] for k in TORCH_KEYS} == torch_state
    assert all(_plain(v) for v in state.values())
    energy = state["ampguard"]["underflow_last"]["total"][6]
    assert state["ampguard"] == {
        "steps": 40,
        "skipped": 4,
        "no_grad_steps": 0,
        "nonfinite_loss": 0,
        "consecutive_skipped": 0,
        "min_scale_seen": safe_run.scaler.stats.min_scale_seen,
        "max_scale_seen": safe_run.scaler.stats.max_scale_seen,
        "fp32_islands": [],
        # The underflow policy's state (the suite runs it in report mode: sampled at step 2, next at 102; the
        # scale that overflowed last, 104.86 / 0.4, its ceiling): docs/underflow.md
        "underflow_ceiling": state["scale"] / 0.4,
        "underflow_samples": 1,
        "underflow_growths": 0,
        "underflow_next_sample_in": 102 - 40,
        "underflow_last": {
            "step": 2,
            "scale": 4096.0,
            # the counts, the peak, and the squared norm of the float16 gradients counted (their energy)
            "total": [450, 0, 0, 0, 0, safe_run.scaler.stats.underflow_grad_peak, energy],
            "modules": state["ampguard"]["underflow_last"]["modules"],
        },
    }
    assert energy > 0 and math.isfinite(energy)


@pytest.mark.parametrize("optimizer", ["sgd", "device_skip"])
def test_resume_into_torchs_scaler_and_into_safegradscaler_continues_identically(optimizer):
    first = train(safe(**HYPER), optimizer=optimizer, steps=40, faults=FAULTS_A)
    state = first.scaler.state_dict()
    assert state["ampguard"]["skipped"] == 4  # device-mode counters folded into the checkpoint
    resumed = []
    for scaler in (stock(), safe()):
        scaler.load_state_dict(copy.deepcopy(state))
        model = copy.deepcopy(first.model)
        resumed.append(train(scaler, optimizer=optimizer, steps=40, faults=FAULTS_B, model=model, seed=1))
    torch_resumed, safe_resumed = resumed
    assert same_parameters(torch_resumed.model, safe_resumed.model)
    assert torch_resumed.scaler.state_dict() == {
        k: v for k, v in safe_resumed.scaler.state_dict().items() if k != "ampguard"
    }
    stats = safe_resumed.scaler.stats
    assert (stats.steps, stats.skipped) == (80, 7)  # loaded counters continue, not reset


def test_stock_checkpoint_loads_into_safegradscaler_with_torchs_meaning():
    torch_run = train(stock(), steps=30, faults={4})
    state = torch_run.scaler.state_dict()
    assert state["scale"] == 32768.0 and state["growth_interval"] == 2000 and state["_growth_tracker"] == 25
    scaler = safe()
    scaler.load_state_dict(state)
    assert scaler.get_scale() == scaler.stats.scale == 32768.0
    assert (scaler.get_growth_interval(), scaler._counters.mirror_tracker) == (2000, 25)
    model = copy.deepcopy(torch_run.model)
    continued_torch = train(torch_run.scaler, steps=30, faults={7}, model=copy.deepcopy(torch_run.model), seed=2)
    continued_safe = train(scaler, steps=30, faults={7}, model=model, seed=2, check_every_step=True)
    assert same_parameters(continued_torch.model, continued_safe.model)
    assert continued_safe.mirror_mismatches == []
    assert scaler.stats.steps == 30 and scaler.stats.skipped == 1


def test_fresh_stock_checkpoint_65536_loads_as_65536():
    scaler = safe()
    scaler.load_state_dict(stock().state_dict())
    stats = scaler.stats
    assert scaler.get_scale() == stats.scale == stats.min_scale_seen == stats.max_scale_seen == 65536.0
    model, opt = tiny()
    iteration(scaler, model, opt, update=False)
    assert scaler._scale.item() == 65536.0


def test_loading_a_torch_checkpoint_keeps_the_counters_held():
    run = train(safe(), steps=12, faults={3})
    run.scaler.load_state_dict(stock(init_scale=2048.0).state_dict())
    stats = run.scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (12, 1, 2048.0)
    assert stats.min_scale_seen == 512.0 and stats.max_scale_seen == 2048.0


def test_loading_a_torch_checkpoint_keeps_device_mode_counters():
    run = train(safe(), optimizer="device_skip", steps=12, faults={3, 4})
    assert run.scaler._counters.ledger is not None
    run.scaler.load_state_dict(stock().state_dict())
    assert (run.scaler.stats.steps, run.scaler.stats.skipped) == (12, 2)


def test_loaded_scale_outside_floor_and_cap_is_bounded(ampguard_log):
    scaler = safe()
    scaler.load_state_dict(stock(init_scale=2.0**30).state_dict())
    assert scaler.get_scale() == scaler.stats.scale == 2.0**24
    assert records(ampguard_log, logging.INFO, "outside")
    scaler.load_state_dict(stock(init_scale=2.0**-3).state_dict())
    assert scaler.get_scale() == 1.0


def test_empty_state_raises_as_torch_and_disabled_scaler_saves_nothing():
    with pytest.raises(RuntimeError, match="empty"):
        safe().load_state_dict({})
    disabled = safe(enabled=False)
    assert disabled.state_dict() == {}
    disabled.load_state_dict({})


def test_weights_only_load_of_a_saved_state_dict(tmp_path):
    run = train(safe(), optimizer="device_skip", steps=15, faults={1, 2})
    path = tmp_path / "scaler.pt"
    torch.save({"scaler": run.scaler.state_dict()}, path)
    loaded = torch.load(path, weights_only=True)["scaler"]
    assert loaded == run.scaler.state_dict()
    scaler = safe()
    scaler.load_state_dict(loaded)
    assert scaler.stats == run.scaler.stats
    torch_scaler = stock()
    torch_scaler.load_state_dict(loaded)
    assert torch_scaler.get_scale() == run.scaler.get_scale()


def test_stats_lines_continue_on_schedule_after_loading(reinstall, ampguard_log):
    reinstall(AMPGUARD_STATS_EVERY="10")
    state = train(safe(), steps=7).scaler.state_dict()
    scaler = safe()
    scaler.load_state_dict(state)
    train(scaler, steps=5)
    lines = [r.getMessage() for r in records(ampguard_log, logging.INFO, "stats step=")]
    assert lines[-1].startswith("stats step=10 ")


@pytest.mark.parametrize("optimizer", ["sgd", "device_skip"])
def test_pickling_between_iterations_like_torch(optimizer):
    run = train(safe(**HYPER), optimizer=optimizer, steps=25, faults=FAULTS_A)
    restored = pickle.loads(pickle.dumps(run.scaler))
    assert type(restored) is SafeGradScaler
    assert restored.stats == run.scaler.stats
    assert restored.get_scale() == run.scaler.get_scale() and restored._scale is None  # lazily re-created, as torch
    a = train(run.scaler, optimizer=optimizer, steps=20, faults=FAULTS_B, model=copy.deepcopy(run.model), seed=4)
    b = train(restored, optimizer=optimizer, steps=20, faults=FAULTS_B, model=copy.deepcopy(run.model), seed=4)
    assert same_parameters(a.model, b.model)
    assert a.scaler.stats == b.scaler.stats


def test_a_scaler_pickled_with_the_earlier_per_iteration_attributes_unpickles_and_trains_the_same():
    """Before scaler/iteration.py the iteration in progress was six attributes of the scaler's ``__dict__``."""
    run = train(safe(**HYPER), steps=25, faults=FAULTS_A)
    earlier = run.scaler.__getstate__()
    earlier.update(
        _loss_check=None,
        _host_found={},
        _unscaled_optimizers=[],
        _iteration_loss_nonfinite=False,
        _scale_read_in_iteration=False,
        _scaling_thread=None,
    )
    restored = SafeGradScaler.__new__(SafeGradScaler)
    restored.__setstate__(earlier)
    assert not {"_loss_check", "_host_found", "_unscaled_optimizers"} & set(vars(restored))
    a = train(run.scaler, steps=20, faults=FAULTS_B, model=copy.deepcopy(run.model), seed=4)
    b = train(restored, steps=20, faults=FAULTS_B, model=copy.deepcopy(run.model), seed=4)
    assert same_parameters(a.model, b.model)
    assert a.scaler.stats == b.scaler.stats


def _pickle_refused_mid_iteration(scaler) -> None:
    model, opt = tiny()
    iteration(scaler, model, opt, update=False)
    with pytest.raises(AssertionError, match="may only be pickled"):
        pickle.dumps(scaler)
    scaler.update()
    pickle.dumps(scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(1, 4)).float().sum()
    scaler.scale(loss)
    pickle.dumps(scaler)  # after scale() alone, as torch allows


def test_pickling_mid_iteration_refused_like_torch():
    _pickle_refused_mid_iteration(safe())


def test_torch_refuses_pickling_mid_iteration(stock_torch):
    _pickle_refused_mid_iteration(stock())


def test_torch_scaler_pickled_before_install_unpickles_as_a_working_safegradscaler(stock_torch):
    model, opt = tiny()
    torch_scaler = stock(init_scale=256.0, growth_interval=3)
    iteration(torch_scaler, model, opt)
    blob = pickle.dumps(torch_scaler)
    import ampguard

    ampguard.install()
    restored = pickle.loads(blob)
    assert type(restored) is torch.amp.GradScaler and isinstance(restored, SafeGradScaler)
    assert (restored.get_scale(), restored.get_growth_interval(), restored._counters.mirror_tracker) == (256.0, 3, 1)
    for _ in range(2):
        iteration(restored, model, opt)
    iteration(restored, model, opt, fault=True)
    stats = restored.stats
    assert (stats.steps, stats.skipped, stats.scale) == (3, 1, 256.0)  # grew at the 3rd good step, then backed off
    assert restored._scale.item() == 256.0
