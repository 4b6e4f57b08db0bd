"""fp32 islands under DDP: 2 gloo ranks, only rank 1's batches overflow; both ranks heal alike.

Rank 1's every 10th batch overflows float16 inside ``blocks.1.attn``; rank 0's
batches never do. DDP all-reduces the gradients, so both ranks skip those
steps; ampguard all-reduces "was a loss non-finite" and the probe's verdict on
skipped steps only, so both keep the same scale and make the same island.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrun_support import environment_without_ampguard, run_ranks

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the helpers the workers import
STEPS = 30

WORKER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import ampguard
import torch
import torch.distributed as dist
from islands_support import batch, make_net

OUT, STEPS = sys.argv[1], int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(make_net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
scales, losses_finite = [], []
for step in range(STEPS):
    x, y = batch(step, healthy=rank == 0)  # only rank 1's batches overflow
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    losses_finite.append(bool(torch.isfinite(loss)))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scales.append(scaler.get_scale())
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(OUT, f"params{rank}.pt"))
record = {"scales": scales, "losses_finite": losses_finite, "stats": scaler.stats.as_dict()}
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as handle:
    json.dump(record, handle)
dist.barrier()
del model  # before the group: see examples/ddp_train.py (a rare gloo hang at exit on torch < 2.8)
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_overflow_on_one_rank_heals_both_ranks_alike(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    result = run_ranks(
        [str(worker), str(out), str(SUPPORT), str(STEPS)], cwd=tmp_path, env=environment_without_ampguard(), timeout=300
    )
    assert result.returncode == 0, result.output
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    params = [torch.load(out / f"params{rank}.pt") for rank in range(2)]

    first, second = records
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
