"""fp32 islands under DDP: 2 gloo ranks agree on the island; one job runs every scenario below in turn.

Overflow on one rank: rank 1's every 10th batch overflows float16 inside ``blocks.1.attn``; rank 0's
batches never do. DDP all-reduces the gradients, so both ranks skip those
steps; ampguard all-reduces "was a loss non-finite" and the probe's verdict on
skipped steps only, so both keep the same scale and make the same island.

A sudden forward overflow costs one batch (issue 35). The 3-block net of tests/support/islands_support.py,
wrapped in DDP; ``blocks.2.attn`` (a block whose logits are small) gets an input 1000x larger on every 7th batch, on rank 1 only or on both ranks. Nothing warns before:
the headroom watch of step 2 saw ``blocks.1.attn`` closest to float16's limit (its logits at ~8,000), and
blaming it, as the probe alone does (``AMPGUARD_FORWARD_RERUN=off``: a needless island, then the probe, three
loud batches lost), would be wrong. At the first loud batch each rank runs its forward again under the probe
(the model inside DDP, not the wrapper), the ranks agree on the verdict, and both make ``blocks.2.attn`` an
island before the next batch.

The 1000x input also makes the island's input gradient overflow float16 at ampguard's scale of 1024 on the
later loud batches (a backward overflow: the scale halves, as torch's would); those are not lost to the
forward overflow and are counted apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrun_support import environment_without_ampguard, run_ranks

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the helpers the workers import
STEPS = 21
LOUD = [6, 13, 20]  # the 0-based steps of every 7th batch

WORKER = r"""
import gc, json, os, sys
sys.path.insert(0, sys.argv[2])
import ampguard
import torch
import torch.distributed as dist
from islands_support import make_net, train

OUT, STEPS, HEALING_STEPS = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
# "<loud ranks>:<AMPGUARD_FORWARD_RERUN>", e.g. "0,1:on"; "<ranks>:plain": torch's; "1:batches": rank 1's batches
for scenario in sys.argv[5:]:
    loud_ranks, rerun = scenario.split(":")
    if rerun == "batches":
        os.environ.pop("AMPGUARD_FORWARD_RERUN", None)  # ampguard's defaults, as a fresh job's
    else:
        os.environ["AMPGUARD_FORWARD_RERUN"] = rerun
    ampguard.uninstall()
    if rerun != "plain":
        ampguard.install()
    net = make_net()
    batches, losses_finite = [0], []
    loud = str(rank) in loud_ranks.split(",")

    def louder_now_and_then(module, args):
        if torch.is_grad_enabled():  # the forward run again (no autograd) sees the batch as it was
            batches[0] += 1
        return (args[0] * 1000.0,) if loud and batches[0] % 7 == 0 else None

    def note_logits(module, args, logits):  # the loss is finite where the logits are (cross-entropy)
        if torch.is_grad_enabled():
            losses_finite.append(bool(torch.isfinite(logits).all()))

    net.register_forward_hook(note_logits)
    if rerun == "batches":  # the loud ranks' every 10th batch overflows inside blocks.1.attn (islands_support.batch)
        steps, healthy = HEALING_STEPS, not loud
    else:
        net.blocks[2].attn.register_forward_pre_hook(louder_now_and_then)
        steps, healthy = STEPS, True
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = train(steps, model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"), healthy=healthy)
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(OUT, f"params{rank}-{scenario}.pt"))
    stats = run.scaler.stats.as_dict() if rerun != "plain" else {}
    record = {"scales": run.scales, "losses_finite": losses_finite, "stats": stats}
    with open(os.path.join(OUT, f"rank{rank}-{scenario}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    del model, run, optimizer, net
    gc.collect()  # islands are named among the live models: the next scenario's are its own
dist.destroy_process_group()  # (the models went first: see examples/ddp_train.py, a rare gloo hang at exit)
"""
HEALING_STEPS = 30
SCENARIOS = ("1:batches", "1:on", "0,1:on", "0,1:off", "0,1:plain")  # the first as a fresh job's first


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], list[list[torch.Tensor]]]]:
    """One 2-rank job running the scenarios one after the other: scenario -> (each rank's record, its weights)."""
    tmp_path = tmp_path_factory.mktemp("islands-ddp")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    entry = [str(worker), str(out), str(SUPPORT), str(STEPS), str(HEALING_STEPS), *SCENARIOS]
    result = run_ranks(entry, cwd=tmp_path, env=environment_without_ampguard(), timeout=300)
    assert result.returncode == 0, result.output
    return {
        scenario: (
            [json.loads((out / f"rank{rank}-{scenario}.json").read_text()) for rank in range(2)],
            [torch.load(out / f"params{rank}-{scenario}.pt") for rank in range(2)],
        )
        for scenario in SCENARIOS
    }


@pytest.mark.distributed
def test_overflow_on_one_rank_heals_both_ranks_alike(runs) -> None:
    records, params = runs["1:batches"]
    first, second = records
    assert len(first["losses_finite"]) == len(second["losses_finite"]) == HEALING_STEPS
    assert all(first["losses_finite"])  # rank 0 never overflowed itself
    # rank 1: one overflow, at which each rank's headroom watch (of step 2: the same batches but the loud ones)
    # names the block it saw closest to float16's limit; then healed
    assert second["losses_finite"].count(False) == 1
    for record in records:
        assert record["stats"]["fp32_islands"] == ["blocks.1.attn"]
        assert record["stats"]["skipped"] == 1
        assert min(record["scales"]) == 1024.0
    assert first["scales"] == second["scales"]
    for mine, theirs in zip(*params):
        assert torch.equal(mine, theirs)


def _lost(record: dict) -> list[int]:
    return [step for step, finite in enumerate(record["losses_finite"]) if not finite]


@pytest.mark.distributed
@pytest.mark.parametrize("loud_ranks", ["1", "0,1"], ids=["rank-1-only", "both-ranks"])
def test_a_sudden_overflow_under_ddp_costs_one_batch_and_the_ranks_agree(runs, loud_ranks: str) -> None:
    records, params = runs[f"{loud_ranks}:on"]
    loud = [int(r) for r in loud_ranks.split(",")]
    for rank, record in enumerate(records):
        assert _lost(record) == ([LOUD[0]] if rank in loud else []), rank  # the first loud batch only
        stats = record["stats"]
        assert stats["fp32_islands"] == ["blocks.2.attn"], rank
        assert stats["nonfinite_loss"] == (rank in loud), rank  # each rank counts its own loss
        # Skipped on both: the forward overflow, then the later loud batches' backward overflows (the island's
        # input gradient): the scale kept at the first, halved at each of the others, as torch's would be.
        assert stats["skipped"] == 3, rank
        assert record["scales"] == [1024.0] * LOUD[1] + [512.0] * (LOUD[2] - LOUD[1]) + [256.0] * (STEPS - LOUD[2])
    for mine, theirs in zip(*params):
        assert torch.equal(mine, theirs)


@pytest.mark.distributed
def test_under_ddp_the_probe_alone_and_torch_lose_more(runs) -> None:
    """The references: ``AMPGUARD_FORWARD_RERUN=off`` blames the watch's module, then the probe names the right
    one, and the blamed island is taken back on both ranks (before: a permanent needless island); torch's own scaler
    loses every loud batch and halves its scale for each."""
    for record in runs["0,1:off"][0]:
        assert _lost(record) == LOUD
        assert record["stats"]["fp32_islands"] == ["blocks.2.attn"]
    for record in runs["0,1:plain"][0]:
        assert _lost(record) == LOUD and record["scales"][-1] == 2.0**16 / 2 ** len(LOUD)
