"""The underflow policy's state across checkpoints, pickles and deep copies: a resumed run goes on as the run would.

The 2-block attention net of issue 24 (tests/support/underflow_support.py) with its loss multiplied by 1e-8, in adapt
mode, sampled every 5 steps: the scale grows for underflow from 1024 at steps 2-5 (to 16384), an inf gradient
at step 6 halves it to 8192 and makes 16384 the ceiling, which the policy never grows back into. The reference
is the same run uninterrupted; the resumed one swaps its scaler for a loaded, unpickled or deep-copied one.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import pickle
from typing import Any

import pytest
import torch
from scaler_support import DeviceSkipSGD, one_thread, recipe_step, same_parameters, stock  # noqa: F401  # noqa: F401
from torch import nn
from underflow_support import Run, train, transfers_known_after

import ampguard
import ampguard.scaler.listeners as listeners
from ampguard.scaler.checkpoint import LISTENER_ENTRIES
from ampguard.stats.counters import stats_line
from ampguard.underflow.counts import OVERFLOWED
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
    return listener.states[scaler._handle]  # (keyed by the handle the scaler gives its listeners)


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


# -- Issue 32: a checkpoint taken after a sampled step whose float16 gradients overflowed loads back as it was saved ---
# docs/underflow.md says ampguard never writes a non-finite measurement, and ``load_state_dict()`` refuses one (one
# WARNING, the scaler's own underflow state kept). Before this, a sampled step whose backward overflowed recorded its
# peak as inf, so ``scaler.load_state_dict(scaler.state_dict())`` refused ampguard's own entries. Now a skipped sampled
# step is no measurement (``scaler.stats`` goes on showing the last one), and a peak of inf or NaN on a step that was
# not skipped (a ReLU masked the overflowed values further down) is kept as 65536, finite and above every float16
# value. The reference: the scaler that saved (its entries, its stats) and torch's GradScaler (the same scales).


class Masked(nn.Module):
    """A linear layer, a ReLU and a float16 weighting whose gradient overflows (``loud``) where the ReLU is off:
    the ReLU's backward zeroes those values, so the parameters' gradients stay finite and no step is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.act = nn.ReLU()  # (a module: the sample counts its output's gradient, inf where it is off)
        self.loud = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        weights = torch.where(h.detach() < 0, self.loud, 1.0).to(h.dtype)
        return self.act(h) * weights


def train_masked(scaler: Any, steps: int, *, overflow_at: int | None = None, loud: float = 1.0) -> nn.Module:
    """SGD on :class:`Masked` (a linear loss: every output has a gradient); at ``overflow_at`` (0-based) the loss is multiplied by 1e6 (the float16 gradients
    overflow at any scale ampguard runs at: the step is skipped)."""
    torch.manual_seed(0)
    model = Masked()
    model.loud = loud
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    coefficients = torch.randn(16, 16, generator=generator) / 256
    for step in range(steps):
        x = torch.randn(16, 8, generator=generator)
        loud = 1e6 if step == overflow_at else 1.0
        recipe_step(optimizer, scaler, lambda: (model(x).float() * coefficients).sum() * loud)  # noqa: B023  (called at once)
    return model


def held(scaler: Any) -> tuple[Any, ...]:
    state = underflow_state(scaler)
    return (state.ceiling, state.samples, state.growths, state.next_sample, state.last)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_sampled_step_whose_backward_overflowed_is_no_measurement_and_loads_back(caplog):
    """Step 2 (the first sample) overflows: skipped, the scale halved as torch halves it. Step 7 (the next sample,
    every 5) is measured. Saved right after step 2 and after step 7, the state loads back into the same scaler and
    into a fresh one with no WARNING and nothing refused."""
    scaler = ampguard.SafeGradScaler("cpu")
    train_masked(scaler, 2, overflow_at=1)
    torch_scaler = stock(init_scale=1024.0, growth_interval=100)
    train_masked(torch_scaler, 2, overflow_at=1)
    stats = scaler.stats
    assert stats.skipped == 1 and scaler.get_scale() == torch_scaler.get_scale() == 512.0
    assert underflow_state(scaler).samples == 1 and underflow_state(scaler).last is None  # sampled, not measured
    assert stats.underflow_samples == 0 and stats.underflow_step == 0  # (nothing to show yet)
    entries = scaler.state_dict()["ampguard"]
    assert entries["underflow_samples"] == 1 and "underflow_last" not in entries  # before: a peak of inf
    assert entries["underflow_ceiling"] == 1024.0  # the overflow's ceiling, as any overflow sets it
    before = held(scaler)
    caplog.clear()  # (torch's scaler, the reference, was warned about)
    with caplog.at_level(logging.INFO, logger="ampguard"):
        scaler.load_state_dict(scaler.state_dict())
        fresh = ampguard.SafeGradScaler("cpu")
        fresh.load_state_dict(weights_only_round_trip(scaler.state_dict()))
    assert warnings_of(caplog) == []
    assert held(scaler)[:3] == before[:3] and held(fresh)[:3] == before[:3]
    assert fresh.stats == scaler.stats

    later = ampguard.SafeGradScaler("cpu")
    train_masked(later, 8, overflow_at=1)
    assert later.stats.underflow_samples == 2 and later.stats.underflow_step == 7
    assert math.isfinite(later.stats.underflow_grad_peak) and later.stats.underflow_grad_peak < 65504
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ampguard"):
        later.load_state_dict(later.state_dict())
    assert warnings_of(caplog) == [] and later.stats.underflow_step == 7


def test_an_overflow_masked_further_down_is_kept_finite_and_loads_back(caplog):
    """The float16 gradient into the ReLU holds inf where the ReLU is off; the parameters' gradients are finite and
    the step is not skipped, so the sample is a measurement: its peak is kept as 65536 (no growth: no headroom),
    and the checkpoint loads back with no WARNING. The run is torch's, bit for bit (nothing grew)."""
    scaler = ampguard.SafeGradScaler("cpu")
    model = train_masked(scaler, 3, loud=1e4)
    reference = train_masked(stock(init_scale=1024.0, growth_interval=100), 3, loud=1e4)
    stats = scaler.stats
    assert stats.skipped == 0 and stats.underflow_samples == 1 and stats.underflow_step == 2
    assert stats.underflow_grad_peak == OVERFLOWED and stats.underflow_growths == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    saved = scaler.state_dict()
    assert saved["ampguard"]["underflow_last"]["total"][-1] == OVERFLOWED
    caplog.clear()  # (torch's scaler, the reference, was warned about)
    with caplog.at_level(logging.INFO, logger="ampguard"):
        scaler.load_state_dict(saved)
        fresh = ampguard.SafeGradScaler("cpu")
        fresh.load_state_dict(weights_only_round_trip(saved))
    assert warnings_of(caplog) == []
    assert fresh.stats == scaler.stats and held(fresh)[4] == held(scaler)[4]


# -- entries ampguard never writes: the scaler keeps its own state ----------------------------


def _underflow_state(scaler: Any) -> Any:
    [listener] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    return listener.states.get(scaler._handle)


def _held(state: Any) -> tuple[Any, ...]:
    return (state.ceiling, state.samples, state.growths, state.next_sample, state.last)


@pytest.fixture
def checkpoint_and_holder(_adapt, one_thread) -> tuple[dict[str, Any], Any]:
    """A state saved while growing (ceiling inf, 2 samples, the next step sampled), and a scaler that holds
    another underflow state (an overflow at 16384 made that its ceiling)."""
    saved = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=3).scaler.state_dict()
    holder = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=8, faults=[5]).scaler
    assert _underflow_state(holder).ceiling == 16384.0
    return saved, holder


HOSTILE = {
    "NaN ceiling": {"underflow_ceiling": math.nan},
    "negative ceiling": {"underflow_ceiling": -4.0},
    "negative samples": {"underflow_samples": -3},
    "fractional growths": {"underflow_growths": 2.5},
    "NaN next sample": {"underflow_next_sample_in": math.nan},
    "NaN measurement": {"underflow_last": {"step": 1, "scale": math.nan, "total": [10, 1, 1, 1, 0, math.nan]}},
    "measurement a list": {"underflow_last": [1, 2]},
    "samples None": {"underflow_samples": None},
}


@pytest.mark.parametrize("change", list(HOSTILE.values()), ids=list(HOSTILE))
def test_malformed_underflow_entries_keep_the_scalers_own_state_with_one_warning(checkpoint_and_holder, change, caplog):
    """Entries ampguard never writes load nothing into the policy: the scaler keeps its ceiling, counters and
    schedule, torch's keys load as torch's GradScaler loads them, and one WARNING says so. Before, a NaN
    ceiling, a negative count or a NaN measurement was taken silently (a NaN ceiling forbids every growth
    for the rest of the run), and a missing or mistyped entry was reported as a bug in ampguard."""
    saved, holder = checkpoint_and_holder
    hostile = copy.deepcopy(saved)
    hostile["ampguard"].update(change)
    kept = _held(_underflow_state(holder))
    with caplog.at_level(logging.INFO, logger="ampguard"):
        holder.load_state_dict(hostile)
    assert _held(_underflow_state(holder)) == kept
    reference = stock()
    reference.load_state_dict(hostile)
    assert holder.get_scale() == reference.get_scale() == 4096.0 and holder.stats.steps == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "underflow entries are not ampguard's" in warnings[0], warnings


def test_a_missing_underflow_entry_keeps_the_scalers_own_state_with_one_warning(checkpoint_and_holder, caplog):
    saved, holder = checkpoint_and_holder
    del saved["ampguard"]["underflow_next_sample_in"]
    kept = _held(_underflow_state(holder))
    with caplog.at_level(logging.INFO, logger="ampguard"):
        holder.load_state_dict(saved)
    assert _held(_underflow_state(holder)) == kept
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "underflow entries are not ampguard's" in warnings[0], warnings


def test_a_next_sample_further_than_this_runs_interval_is_brought_within_it(_adapt, one_thread):
    """A checkpoint whose next sample is 10**30 steps away (or saved with a larger AMPGUARD_UNDERFLOW_EVERY)
    samples within this run's interval (5). Before, the loaded scaler never sampled again."""
    saved = train(ampguard.SafeGradScaler("cpu"), loss_factor=1e-8, steps=3).scaler.state_dict()
    saved["ampguard"]["underflow_next_sample_in"] = 10**30
    loaded = ampguard.SafeGradScaler("cpu")
    loaded.load_state_dict(saved)
    assert _underflow_state(loaded).next_sample == 3 + 5


def test_integral_numbers_of_any_type_still_load(checkpoint_and_holder):
    """The checks refuse what ampguard never writes, not what a converted checkpoint may hold (numpy integers,
    integral floats)."""
    import numpy

    saved, holder = checkpoint_and_holder
    saved["ampguard"].update(underflow_samples=numpy.int64(2), underflow_growths=2.0)
    holder.load_state_dict(saved)
    state = _underflow_state(holder)
    assert (state.ceiling, state.samples, state.growths) == (math.inf, 2, 2)
    assert state.sampler.armed and state.next_sample == 4 + 5  # step 4's sample armed (its retry 5 steps on)


@pytest.mark.parametrize("entry", [[1, 2], "counters", {"steps": "many"}, {"skipped": None}])
def test_a_malformed_ampguard_entry_loads_torchs_keys_and_keeps_the_counters(checkpoint_and_holder, entry, caplog):
    """An ``ampguard`` entry that is not ampguard's does not fail ``load_state_dict``: torch's keys load as
    torch's GradScaler loads them, the counters and the underflow state stay the scaler's, one WARNING.
    Before: AttributeError or ValueError out of load_state_dict."""
    saved, holder = checkpoint_and_holder
    saved["ampguard"] = entry
    kept, steps = _held(_underflow_state(holder)), holder.stats.steps
    with caplog.at_level(logging.INFO, logger="ampguard"):
        holder.load_state_dict(saved)
    reference = stock()
    reference.load_state_dict(saved)
    assert holder.get_scale() == reference.get_scale() == 4096.0
    assert holder.stats.steps == steps == 8 and _held(_underflow_state(holder)) == kept
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ampguard")]
    assert len(messages) == 1 and "is not ampguard's" in messages[0], messages
