"""Master weights under DDP: 2 ranks (gloo, CPU), float16 parameters, a GradScaler, an overflow on one rank.

:data:`WORKER` runs on 2 ranks (started as torchrun would: torchrun_support.run_ranks)
and trains the same student twice on the same batches: once loaded in float32,
once in float16 (``.half()``), each wrapped in DistributedDataParallel, with
AdamW, clipping after ``unscale_`` and a backward overflow on rank 1 only at
step 3. The float16 run must skip that step on both ranks, end with identical
float16 parameters on both, and reach at least 90% of the float32 run's loss
reduction.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchrun_support import environment_without_ampguard, run_ranks

WORKER = r"""
import json
import sys

import ampguard  # noqa: F401
import torch
import torch.distributed as dist
import torch.nn.functional as F

OUT = sys.argv[1]
STEPS, OVERFLOW = 40, 3
torch.set_num_threads(1)


def run(dtype):
    rank = dist.get_rank()
    torch.manual_seed(0)
    teacher = torch.nn.Linear(16, 16)
    student = torch.nn.Linear(16, 16)
    with torch.no_grad():
        student.weight.copy_(teacher.weight + 3e-3 * torch.randn_like(teacher.weight))
        student.bias.copy_(teacher.bias + 3e-3 * torch.randn_like(teacher.bias))
    student = student.to(torch.float16).to(dtype)  # the same start for both runs
    model = torch.nn.parallel.DistributedDataParallel(student)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    held_out = torch.randn(128, 16, generator=torch.Generator().manual_seed(7))

    def loss_now():
        with torch.no_grad():
            return F.mse_loss(F.linear(held_out, student.weight.float(), student.bias.float()), teacher(held_out)).item()

    start = loss_now()
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=data)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), teacher(x).detach())
        if rank == 1 and step == OVERFLOW:
            loss = loss * 1e8  # rank 1's float16 backward overflows; DDP's all-reduce spreads it
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    from ampguard import master_weights
    return {
        "start": start, "end": loss_now(), "skipped": scaler.stats.skipped,
        "dtypes": sorted({str(p.dtype) for p in student.parameters()}),
        "masters": len(master_weights.masters_of(optimizer)),
        "finite": all(bool(torch.isfinite(p).all()) for p in student.parameters()),
        "params": [p.detach().double().flatten().tolist() for p in student.parameters()],
    }


dist.init_process_group("gloo")
record = {"float32": run(torch.float32), "float16": run(torch.float16)}
with open(f"{OUT}/rank{dist.get_rank()}.json", "w") as handle:
    json.dump(record, handle)
dist.destroy_process_group()
"""


def test_float16_ddp_trains_like_float32_and_ranks_agree(tmp_path: Path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = environment_without_ampguard(AMPGUARD_QUIET="1")
    result = run_ranks([str(worker), str(tmp_path)], cwd=tmp_path, env=env, timeout=240)
    assert result.returncode == 0, result.output
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for record in ranks:
        half, full = record["float16"], record["float32"]
        assert half["dtypes"] == ["torch.float16"] and half["finite"] and half["masters"] == 2
        assert full["masters"] == 0
        assert half["skipped"] == full["skipped"] == 1
        assert half["start"] - half["end"] >= 0.9 * (full["start"] - full["end"]) > 0
    assert ranks[0]["float16"]["params"] == ranks[1]["float16"]["params"]
