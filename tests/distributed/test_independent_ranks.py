"""Ranks that train models of their own (no DDP/FSDP) skip different steps: ampguard must not wait for the others.

On a skipped step ampguard exchanges "was a loss inf/NaN" between ranks only
when they share gradients (a DDP, FSDP or FSDP2 module exists); otherwise a
collective called by the skipping rank alone would hang the job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_support import environment_without_ampguard, run_ranks

pytestmark = pytest.mark.distributed

WORKER = r"""
import json
import torch, torch.distributed as dist
import ampguard

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    if rank == 1 and step in (2, 4):
        loss = loss * float("inf")  # a forward overflow on rank 1 only
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
dist.barrier()
print("RESULT " + json.dumps({"rank": rank, "skipped": scaler.stats.skipped, "scale": scaler.get_scale()}), flush=True)
dist.destroy_process_group()
"""


def test_independent_ranks_skipping_different_steps_do_not_hang(tmp_path: Path) -> None:
    worker = tmp_path / "independent.py"
    worker.write_text(WORKER)
    env = environment_without_ampguard(AMPGUARD_QUIET="1")
    done = run_ranks([str(worker)], cwd=tmp_path, env=env, timeout=240)
    assert done.returncode == 0, done.output
    results = [json.loads(stdout.split("RESULT ", 1)[1]) for stdout in done.stdout]
    assert [(r["rank"], r["skipped"]) for r in results] == [(0, 0), (1, 2)]
    assert results[1]["scale"] == 1024.0  # a forward overflow does not lower the scale, on its own rank
