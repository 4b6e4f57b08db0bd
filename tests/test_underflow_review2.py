"""Review of the underflow state in checkpoints and under torch.distributed (issue 24), against plain torch."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from scaler_support import one_thread, stock  # noqa: F401
from torchrun_support import environment_without_ampguard, run_torchrun, torchrun_command
from underflow_support import AttentionNet, batches, train

import ampguard
import ampguard.scaler.listeners as listeners
from ampguard.underflow.listener import UnderflowListener
from ampguard.underflow.measure import Sampler

TESTS = Path(__file__).resolve().parent

# 2 gloo ranks under DDP; after the first update (which arms the sampler for the next step on both ranks) rank 0
# alone evaluates, forward passes without grad: more than the sampler's call limit, which disarms it there.
ONE_RANK_EVALUATES = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import ampguard
import torch
import torch.distributed as dist
from underflow_support import AttentionNet, batches
from ampguard.underflow.measure import Sampler

OUT, STEPS, EVALUATING = sys.argv[1], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=40))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(AttentionNet())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
exchanges = []
real_all_reduce = dist.all_reduce


def counting_all_reduce(tensor, *args, **kwargs):
    exchanges[-1].append(tensor.numel())
    return real_all_reduce(tensor, *args, **kwargs)


dist.all_reduce = counting_all_reduce
scales = []
data = batches(STEPS, seed=1 + rank)
for step, (tokens, labels) in enumerate(data):
    exchanges.append([])
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(tokens).float(), labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scales.append(scaler.get_scale())
    if step == 0 and str(rank) in EVALUATING:  # an evaluation (rank 0's own, or every rank's)
        with torch.no_grad():
            for _ in range(Sampler.MAX_CALLS + 6):
                model.module(tokens)
record = {"scales": scales, "exchanges": exchanges, "stats": scaler.stats.as_dict()}
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as handle:
    json.dump(record, handle)
dist.barrier()
del model
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, evaluating: str, steps: int = 4) -> tuple[dict[str, Any], dict[str, Any]]:
    worker = tmp_path / "worker.py"
    worker.write_text(ONE_RANK_EVALUATES)
    out = tmp_path / "out"
    out.mkdir()
    command = ["timeout", "120", *torchrun_command(str(worker), str(out), str(TESTS), str(steps), evaluating)]
    env = environment_without_ampguard(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="1000")
    result = run_torchrun(command, cwd=tmp_path, env=env, timeout=150)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    first, second = (json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2))
    return first, second


@pytest.mark.distributed
def test_a_rank_whose_sampler_disarmed_itself_still_joins_the_underflow_exchange(tmp_path: Path) -> None:
    """Rank 0 evaluates alone while the sample is armed and its sampler disarms itself (more than Sampler.MAX_CALLS calls): both ranks still
    call agree_on_underflow at the same update (rank 0 with nothing counted), so the collectives stay paired.
    Before, rank 1 all-reduced the sample at step 1 and rank 0 (re-armed) at step 2: gloo paired rank 1's
    underflow all-reduce with DDP's gradient bucket of rank 0 and aborted the job ("Received data size doesn't
    match expected size. Is there a distributed collective mismatch")."""
    first, second = run_ranks(tmp_path, "0")
    assert first["exchanges"] == second["exchanges"] == [[], [6, 1], [], []]
    assert first["scales"] == second["scales"]
    assert first["stats"]["underflow_samples"] == second["stats"]["underflow_samples"] == 1
    assert first["stats"]["underflow_values"] == second["stats"]["underflow_values"] > 0  # rank 1's counts


@pytest.mark.distributed
def test_when_every_rank_disarmed_itself_the_next_step_is_sampled_instead(tmp_path: Path) -> None:
    """Every rank evaluates (more than Sampler.MAX_CALLS batches) while the sample is armed: the exchange finds nothing counted on any
    rank, which is not a sample: the next step is sampled instead, on both ranks. Before (with the exchange
    kept paired), an empty measurement replaced the last one in scaler.stats and the next sample waited a
    whole AMPGUARD_UNDERFLOW_EVERY."""
    first, second = run_ranks(tmp_path, "01")
    assert first["exchanges"] == second["exchanges"] == [[], [6, 1], [6, 1], []]
    assert first["stats"]["underflow_samples"] == second["stats"]["underflow_samples"] == 1
    assert first["stats"]["underflow_values"] == second["stats"]["underflow_values"] > 0


# -- checkpoints ----------------------------------------------------------------------------------------------


@pytest.fixture
def _adapt(reinstall):
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="5")


def _underflow_state(scaler: Any) -> Any:
    [listener] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    return listener.states.get(scaler)


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


def test_under_torch_distributed_a_rank_that_counted_nothing_decides_with_the_others_mocked_cuda(
    monkeypatch, _adapt, one_thread
):
    """gloo with CUDA tensors (mocked): a rank that counted gets its counts through a copy and an event and acts
    at the update after the sample's; a rank whose sampler disarmed itself (it evaluated alone) holds only the
    exchanged totals, on gloo's CPU. Both must grow at the same update. Before, the second acted at the
    sample's own update: the ranks' scales differed for a step, and its next sample (armed a step earlier)
    paired its all-reduce with another collective on the other rank."""
    import ampguard.underflow.listener as listener_module
    from ampguard.underflow.counts import Transfer

    agreed = torch.tensor([1000.0, 0, 0, 0, 1000, 0.0, 1.0], dtype=torch.float64)  # every value lost: grow

    class CopiedFromCuda(Transfer):
        @property
        def copying(self) -> bool:  # the counts of a rank that counted are on CUDA; the exchanged totals on the CPU
            return bool(self.tallies)

    monkeypatch.setattr(listener_module, "distributed", lambda: object())
    monkeypatch.setattr(listener_module, "agree_on_underflow", lambda totals: agreed.clone(), raising=False)
    monkeypatch.setattr(listener_module, "Transfer", CopiedFromCuda)
    # the scaler's on CUDA (raising=False: before, no such function)
    monkeypatch.setattr(listener_module, "counts_come_through_a_copy", lambda scaler: True, raising=False)
    scales = {}
    for rank in (0, 1):
        torch.manual_seed(0)
        model = AttentionNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampguard.SafeGradScaler("cpu")
        scales[rank] = []
        for step, (tokens, labels) in enumerate(batches(4)):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(tokens).float(), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales[rank].append(scaler.get_scale())
            if step == 0 and rank == 1:  # rank 1 evaluates alone: its sampler disarms itself
                with torch.no_grad():
                    for _ in range(Sampler.MAX_CALLS + 6):
                        model(tokens)
    assert scales[0] == scales[1] == [1024.0, 1024.0, 2048.0, 2048.0]
