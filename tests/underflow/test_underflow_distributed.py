"""AMPGUARD_UNDERFLOW=adapt under DDP: 2 gloo ranks, each measuring its own batch, grow the scale as one.

The 2-block attention net of issue 24 (tests/support/underflow_support.py) with its loss multiplied by 1e-8, in
float16 autocast on the CPU, each rank on batches of its own. On a sampled step the ranks all-reduce the
measurement's totals (ampguard.distributed.agree_on_underflow) and take the same decision; on every other
step ampguard calls no collective, and a rank whose sampler disarmed itself (it evaluated alone) still joins
the exchange, so the ranks' collectives stay paired.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from scaler_support import one_thread, recipe_step  # noqa: F401  (fixture)
from torchrun_support import environment_without_ampguard, run_ranks
from underflow_support import AttentionNet, batches

import ampguard
from ampguard.underflow.measure import Sampler

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the helpers the workers import
STEPS = 80
TAIL = 20
FACTOR = 1e-8
TOLERANCE = 0.003  # the issue's: within 0.3% of float32's mean loss

# One 2-rank job (DDP, each rank on batches of its own) runs each scenario in turn, each with its own model, optimizer
# and scaler, ampguard installed again with the scenario's AMPGUARD_UNDERFLOW_EVERY, as a fresh job would: a job
# (two ranks importing torch) fewer per scenario. A scenario: "<name>:<AMPGUARD_UNDERFLOW_EVERY>:<steps>:<loss
# factor>:<the ranks that evaluate after the first update>".
WORKER = r"""
import datetime, gc, json, os, sys
sys.path.insert(0, sys.argv[2])
import ampguard
import torch
import torch.distributed as dist
from underflow_support import AttentionNet, batches
from ampguard.underflow.measure import Sampler

OUT = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))  # a mispaired collective fails, not hangs
rank = dist.get_rank()

# ampguard's collectives, per step (DDP's reducer calls the process group itself, not dist.all_reduce)
exchanges = []
real_all_reduce = dist.all_reduce


def counting_all_reduce(tensor, *args, **kwargs):
    local = tensor.tolist()
    work = real_all_reduce(tensor, *args, **kwargs)
    exchanges[-1].append([local, tensor.tolist()])
    return work


dist.all_reduce = counting_all_reduce
for scenario in sys.argv[3:]:
    name, every, steps, factor, evaluating = scenario.split(":")
    factor = float(factor)
    os.environ["AMPGUARD_UNDERFLOW_EVERY"] = every
    ampguard.uninstall()
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(AttentionNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / factor)
    scaler = torch.amp.GradScaler("cpu")
    exchanges.clear()
    scales, losses = [], []
    for step, (tokens, labels) in enumerate(batches(int(steps), seed=1 + rank)):  # each rank its own batches
        exchanges.append([])
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(tokens).float(), labels)
        losses.append(float(loss.detach()))
        scaler.scale(loss * factor).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if step == 0 and str(rank) in evaluating:  # an evaluation (rank 0's own, or every rank's)
            with torch.no_grad():
                for _ in range(Sampler.MAX_CALLS + 6):
                    model.module(tokens)
    record = {"scales": scales, "losses": losses, "exchanges": list(exchanges), "stats": scaler.stats.as_dict()}
    with open(os.path.join(OUT, f"{name}-rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    del model, optimizer, scaler  # before the group: see examples/ddp_train.py (a rare gloo hang at exit on torch < 2.8)
    gc.collect()
dist.destroy_process_group()
"""
# The ranks agree (every 20th step sampled, the loss multiplied by FACTOR); rank 0 evaluates alone; every rank does.
SCENARIOS = {"agree": f"20:{STEPS}:{FACTOR}:", "0": "1000:4:1:0", "01": "1000:4:1:01"}
Records = tuple[dict[str, Any], dict[str, Any]]  # rank 0's, rank 1's


@dataclass
class Job:
    """The job's exit status and output, and the records of each scenario both ranks finished."""

    returncode: int
    output: str
    records: dict[str, Records]

    def __getitem__(self, scenario: str) -> Records:
        """``scenario``'s records; the test fails when the job failed in it or after it, or never reached it (a
        failure in a later scenario is that scenario's tests' alone)."""
        names = list(SCENARIOS)
        following = names[names.index(scenario) + 1 :]
        failed_later = bool(following) and following[0] not in self.records
        if scenario not in self.records or (self.returncode != 0 and not failed_later):
            pytest.fail(f"the job exited {self.returncode} in or after scenario {scenario!r}\n{self.output}")
        return self.records[scenario]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The job that runs every scenario."""
    tmp_path = tmp_path_factory.mktemp("underflow-ddp")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    entry = [str(worker), str(out), str(SUPPORT), *(f"{name}:{rest}" for name, rest in SCENARIOS.items())]
    env = environment_without_ampguard(AMPGUARD_UNDERFLOW="adapt")
    result = run_ranks(entry, cwd=tmp_path, env=env, timeout=300)
    records = {}
    for name in SCENARIOS:
        files = [out / f"{name}-rank{rank}.json" for rank in (0, 1)]
        if all(file.exists() for file in files):
            first, second = (json.loads(file.read_text()) for file in files)
            records[name] = (first, second)
    return Job(result.returncode, result.output, records)


def _sizes(record: dict[str, Any]) -> list[list[int]]:
    """Each step's all-reduces, as the number of values each exchanged."""
    return [[len(local) for local, _ in step] for step in record["exchanges"]]


def float32_global_losses() -> list[float]:
    """One process in float32 on both ranks' batches together: what DDP's averaged gradients train."""
    torch.manual_seed(0)
    model = AttentionNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / FACTOR)
    losses = []
    for (tokens0, labels0), (tokens1, labels1) in zip(batches(STEPS, seed=1), batches(STEPS, seed=2)):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(torch.cat([tokens0, tokens1])), torch.cat([labels0, labels1]))
        losses.append(float(loss.detach()))
        (loss * FACTOR).backward()
        optimizer.step()
    return losses


@pytest.mark.distributed
def test_ranks_agree_on_the_underflow_and_grow_the_scale_at_the_same_steps(jobs: Job) -> None:
    first, second = jobs["agree"]

    # One scale on both ranks at every step, grown for underflow (before: never grown under torch.distributed).
    assert first["scales"] == second["scales"]
    assert first["stats"]["underflow_growths"] == second["stats"]["underflow_growths"] > 0
    assert first["stats"]["skipped"] == second["stats"]["skipped"] == 0
    assert max(first["scales"]) >= 2.0**17  # (while more than 1% of the norm was lost; acting on the values: 2**20)

    # Collectives on sampled steps only, at the same steps on both ranks: SUM of the counts, MAX of the peak.
    sampled = [step for step, exchanged in enumerate(first["exchanges"]) if exchanged]
    assert sampled == [step for step, exchanged in enumerate(second["exchanges"]) if exchanged]
    assert len(sampled) == first["stats"]["underflow_samples"] == second["stats"]["underflow_samples"]
    assert len(sampled) < STEPS / 2  # growing: every step for a while; then every 20th
    differed = False
    for step in sampled:
        (counts0, peak0), (counts1, peak1) = first["exchanges"][step], second["exchanges"][step]
        assert len(counts0[0]) == 6 and len(peak0[0]) == 1  # the five counts and the energy; the peak
        assert counts0[1] == counts1[1] == [a + b for a, b in zip(counts0[0], counts1[0])]
        assert peak0[1] == peak1[1] == [max(peak0[0][0], peak1[0][0])]
        differed |= counts0[0] != counts1[0]
    assert differed  # each rank measured its own batch
    assert first["stats"]["underflow_share"] == second["stats"]["underflow_share"]

    # Trained as float32 does on the same global batches.
    reference = float32_global_losses()
    run = [(a + b) / 2 for a, b in zip(first["losses"], second["losses"])]  # each rank's mean over its half
    tail, reference_tail = sum(run[-TAIL:]) / TAIL, sum(reference[-TAIL:]) / TAIL
    assert abs(tail / reference_tail - 1) <= TOLERANCE, (tail, reference_tail)


# -- a rank whose sampler disarmed itself (it evaluated alone) --------------------------------


@pytest.fixture
def _adapt(reinstall):
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="5")


# 2 gloo ranks under DDP; after the first update (which arms the sampler for the next step on both ranks) rank 0
# alone evaluates (scenario "0"), or both do ("01"), forward passes without grad: more than the sampler's call limit,
# which disarms it there.


@pytest.mark.distributed
def test_a_rank_whose_sampler_disarmed_itself_still_joins_the_underflow_exchange(jobs: Job) -> None:
    """Rank 0 evaluates alone while the sample is armed and its sampler disarms itself (more than Sampler.MAX_CALLS calls): both ranks still
    call agree_on_underflow at the same update (rank 0 with nothing counted), so the collectives stay paired.
    Before, rank 1 all-reduced the sample at step 1 and rank 0 (re-armed) at step 2: gloo paired rank 1's
    underflow all-reduce with DDP's gradient bucket of rank 0 and aborted the job ("Received data size doesn't
    match expected size. Is there a distributed collective mismatch")."""
    first, second = jobs["0"]
    assert _sizes(first) == _sizes(second) == [[], [6, 1], [], []]
    assert first["scales"] == second["scales"]
    assert first["stats"]["underflow_samples"] == second["stats"]["underflow_samples"] == 1
    assert first["stats"]["underflow_values"] == second["stats"]["underflow_values"] > 0  # rank 1's counts


@pytest.mark.distributed
def test_when_every_rank_disarmed_itself_the_next_step_is_sampled_instead(jobs: Job) -> None:
    """Every rank evaluates (more than Sampler.MAX_CALLS batches) while the sample is armed: the exchange finds nothing counted on any
    rank, which is not a sample: the next step is sampled instead, on both ranks. Before (with the exchange
    kept paired), an empty measurement replaced the last one in scaler.stats and the next sample waited a
    whole AMPGUARD_UNDERFLOW_EVERY."""
    first, second = jobs["01"]
    assert _sizes(first) == _sizes(second) == [[], [6, 1], [6, 1], []]
    assert first["stats"]["underflow_samples"] == second["stats"]["underflow_samples"] == 1
    assert first["stats"]["underflow_values"] == second["stats"]["underflow_values"] > 0


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
            recipe_step(optimizer, scaler, lambda: torch.nn.functional.cross_entropy(model(tokens).float(), labels))  # noqa: B023
            scales[rank].append(scaler.get_scale())
            if step == 0 and rank == 1:  # rank 1 evaluates alone: its sampler disarms itself
                with torch.no_grad():
                    for _ in range(Sampler.MAX_CALLS + 6):
                        model(tokens)
    assert scales[0] == scales[1] == [1024.0, 1024.0, 2048.0, 2048.0]
