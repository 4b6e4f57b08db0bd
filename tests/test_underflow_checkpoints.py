"""The underflow policy's state across checkpoints, pickles and deep copies: a resumed run goes on as the run would.

The 2-block attention net of issue 24 (tests/underflow_support.py) with its loss multiplied by 1e-8, in adapt
mode, sampled every 5 steps: the scale grows for underflow from 1024 at steps 2-5 (to 16384), an inf gradient
at step 6 halves it to 8192 and makes 16384 the ceiling, which the policy never grows back into. The reference
is the same run uninterrupted; the resumed one swaps its scaler for a loaded, unpickled or deep-copied one.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from typing import Any

import pytest
import torch
from scaler_support import DeviceSkipSGD, one_thread, same_parameters, stock  # noqa: F401
from torch import nn
from underflow_support import Run, train, transfers_known_after

import ampguard
import ampguard.scaler.listeners as listeners
from ampguard.scaler.checkpoint import LISTENER_ENTRIES
from ampguard.stats.counters import stats_line
from ampguard.underflow.listener import UnderflowListener

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 20
FAULT = 5  # 0-based: the 6th step
UNDERFLOW_KEYS = {
    "underflow_ceiling",
    "underflow_samples",
    "underflow_growths",
    "underflow_next_sample_in",
    "underflow_last",
}


@pytest.fixture(autouse=True)
def _adapt(reinstall):
    """The policy's default, which the rest of the suite turns to report (tests/conftest.py)."""
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="5")


def weights_only_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resumed(scaler: Any, how: str) -> Any:
    if how == "state_dict":
        fresh = ampguard.SafeGradScaler("cpu")
        fresh.load_state_dict(weights_only_round_trip(scaler.state_dict()))
        return fresh
    if how == "pickle":
        return pickle.loads(pickle.dumps(scaler))
    return copy.deepcopy(scaler)


def run(resume_at: int | None = None, how: str = "state_dict", steps: int = STEPS, **kwargs: Any) -> tuple[Run, list]:
    """The run, its scaler swapped for a resumed one before step ``resume_at`` (0-based); the scale of each step."""
    scales: list[float] = []

    def between(step: int, scaler: Any) -> Any:
        scales.append(scaler.get_scale())
        return resumed(scaler, how) if step == resume_at else scaler

    return train(
        ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=steps, faults=[FAULT], between=between, **kwargs
    ), scales


def underflow_state(scaler: Any) -> Any:
    [listener] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    return listener.states[scaler]


def hooks_of(sampler: Any) -> list[Any]:
    """The global module hooks the underflow sampler holds (functions, not its bound methods: ampguard.module_hooks)."""
    hooks = [*nn.modules.module._global_forward_pre_hooks.values(), *nn.modules.module._global_forward_hooks.values()]
    return [hook for hook in hooks if hook is sampler._hooks._before or hook is sampler._hooks._after]


@pytest.mark.parametrize("how", ["state_dict", "pickle", "deepcopy"])
@pytest.mark.parametrize("resume_at", [3, 8, 10])
def test_a_resumed_adapt_run_continues_exactly_as_the_uninterrupted_one(how, resume_at):
    """Resumed mid-growth (3: the next step sampled), after the overflow (8: the ceiling 16384, the next sample at 11)
    and with the sample armed (10): the same scales, parameters and stats, bit for bit. Before, the resumed scaler
    forgot the ceiling and grew from 8192 to 16384 at step 12 (the overflow again), and its counters restarted."""
    reference_run, reference_scales = run()
    assert reference_scales[FAULT] == 16384.0 and reference_scales[FAULT + 1 :] == [8192.0] * (STEPS - FAULT - 1)
    resumed_run, scales = run(resume_at, how)
    assert scales == reference_scales
    assert same_parameters(resumed_run.model, reference_run.model)
    stats = resumed_run.scaler.stats
    assert stats == reference_run.scaler.stats and stats.underflow_samples == 7 and stats.underflow_growths == 4
    assert stats_line(stats, 0) == stats_line(reference_run.scaler.stats, 0) and stats.underflow_share > 0.5
    assert LISTENER_ENTRIES not in vars(resumed_run.scaler)


@pytest.mark.parametrize("resume_at", [3, 10])
def test_a_resumed_device_mode_run_continues_exactly_as_the_uninterrupted_one(resume_at):
    """The same with a fused-style optimizer (the scaler's device mode: the sample's scale read from the ledger row)."""
    reference_run, reference_scales = run(optimizer_class=DeviceSkipSGD)
    resumed_run, scales = run(resume_at, "state_dict", optimizer_class=DeviceSkipSGD)
    assert scales == reference_scales and reference_scales[-1] == 8192.0
    assert same_parameters(resumed_run.model, reference_run.model)
    assert resumed_run.scaler.stats == reference_run.scaler.stats


def test_the_state_dict_holds_the_underflow_state_as_plain_data_a_weights_only_load_takes():
    """A finite ceiling (an overflow at 16384) and an infinite one (no overflow yet) both load with
    weights_only=True, into SafeGradScaler and into torch's GradScaler (which ignores ``ampguard``)."""
    overflowed = run(steps=8)[0].scaler
    growing = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=3).scaler
    for scaler, ceiling, next_sample_in in ((overflowed, 16384.0, 3), (growing, math.inf, 1)):
        state = scaler.state_dict()
        loaded = weights_only_round_trip(state)
        assert loaded == state and set(loaded["ampguard"]) >= UNDERFLOW_KEYS
        entries = loaded["ampguard"]
        assert entries["underflow_ceiling"] == ceiling and entries["underflow_next_sample_in"] == next_sample_in
        assert entries["underflow_last"]["step"] == scaler.stats.underflow_step
        fresh = ampguard.SafeGradScaler("cpu")
        fresh.load_state_dict(loaded)
        assert fresh.stats == scaler.stats
        torch_scaler = stock()
        torch_scaler.load_state_dict(loaded)
        assert torch_scaler.get_scale() == scaler.get_scale()


def test_only_the_underflow_entries_replace_the_state_a_torch_or_earlier_checkpoint_keeps_it():
    """A checkpoint without the underflow entries (torch's GradScaler's; an earlier ampguard's, the same without
    ``underflow_*``) loads as before: the scale and counters it has, the underflow state the scaler holds
    (not reset). One with them replaces that state."""
    holder = run(steps=8)[0].scaler  # its ceiling 16384, 5 samples, 4 growths
    held = underflow_state(holder)
    kept = (held.ceiling, held.samples, held.growths, held.next_sample, held.last)
    assert kept[:3] == (16384.0, 5, 4)

    torch_run = train(stock(init_scale=1024.0, growth_interval=100), steps=3)
    holder.load_state_dict(torch_run.scaler.state_dict())
    assert holder.get_scale() == 1024.0 and holder.stats.underflow_samples == 5
    assert (held.ceiling, held.samples, held.growths, held.next_sample, held.last) == kept

    saved = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=3).scaler.state_dict()
    earlier = copy.deepcopy(saved)
    earlier["ampguard"] = {key: value for key, value in saved["ampguard"].items() if not key.startswith("underflow_")}
    assert set(saved["ampguard"]) - set(earlier["ampguard"]) == UNDERFLOW_KEYS
    holder.load_state_dict(earlier)
    assert holder.stats.steps == 3 and holder.get_scale() == 4096.0
    assert (held.ceiling, held.samples, held.growths, held.next_sample, held.last) == kept

    holder.load_state_dict(saved)
    assert (held.ceiling, held.samples, held.growths) == (math.inf, 2, 2)
    assert held.sampler.armed and held.next_sample == 4 + 5  # step 4's sample armed (its retry 5 steps on)


def test_loading_into_a_scaler_with_a_sample_armed_drops_it_and_its_hooks():
    """The scaler that loads has its next step's sample armed (growing); the checkpoint's next sample is due 3
    steps later: the sampler is disarmed, no global hook is left, and the stats are the checkpoint's."""
    checkpoint = run(steps=8)[0].scaler
    loading = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=3).scaler
    sampler = underflow_state(loading).sampler
    assert sampler.armed and len(hooks_of(sampler)) == 2
    loading.load_state_dict(checkpoint.state_dict())
    assert not sampler.armed and hooks_of(sampler) == []
    assert loading.stats == checkpoint.stats and underflow_state(loading).sampler is sampler


def test_a_pickle_carries_the_entries_and_unpickles_where_the_underflow_patch_is_off(reinstall):
    """The pickled dict holds the listeners' entries under one key; where the patch is off they are ignored,
    and the key is never left in the scaler's ``__dict__``."""
    scaler = run(steps=8)[0].scaler
    state = scaler.__getstate__()
    assert state[LISTENER_ENTRIES]["underflow_ceiling"] == 16384.0
    blob = pickle.dumps(scaler)
    reinstall(AMPGUARD_UNDERFLOW="off")
    restored = pickle.loads(blob)
    assert LISTENER_ENTRIES not in vars(restored) and not any(
        isinstance(known, UnderflowListener) for known in listeners.registered()
    )
    assert restored.get_scale() == scaler.get_scale() == 8192.0 and restored.stats.steps == 8
    assert restored.stats.underflow_samples == 0
    train(restored, loss_factor=1e-8, steps=2)
    assert restored.stats.steps == 10 and restored.get_scale() == 8192.0  # no growth: the patch is off


def test_a_sample_still_on_its_way_when_saved_is_taken_again_at_the_next_step_mocked_cuda_event(monkeypatch):
    """CUDA (mocked): a sample's counts reach the host an update later. Saved in between, the checkpoint is not
    made to wait for them: the loaded scaler samples its next step instead, and acts on that one."""
    import ampguard.underflow.listener as listener_module

    monkeypatch.setattr(listener_module, "Transfer", transfers_known_after(1))  # known an update late
    saved = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=2).scaler
    assert underflow_state(saved).pending is not None  # step 2's sample, on its way
    entries = saved.state_dict()["ampguard"]
    assert entries["underflow_next_sample_in"] == 1 and entries["underflow_samples"] == 0
    fresh = ampguard.SafeGradScaler("cpu")
    fresh.load_state_dict(saved.state_dict())
    assert underflow_state(fresh).sampler.armed and underflow_state(fresh).pending is None
    train(fresh, loss_factor=1e-8, steps=2)  # step 3 sampled, known and acted on at step 4's update
    assert fresh.stats.underflow_samples == 1 and fresh.stats.underflow_step == 3 and fresh.stats.underflow_growths == 1
