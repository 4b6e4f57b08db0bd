"""Review of the underflow state in checkpoints and under torch.distributed (issue 24), against plain torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_support import environment_without_ampguard, run_torchrun, torchrun_command

TESTS = Path(__file__).resolve().parent

# 2 gloo ranks under DDP; after the first update (which arms the sampler for the next step on both ranks) rank 0
# alone evaluates, 70 forward passes without grad: more than the sampler's 64-call limit, which disarms it there.
ONE_RANK_EVALUATES = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import ampguard
import torch
import torch.distributed as dist
from underflow_support import AttentionNet, batches

OUT, STEPS = sys.argv[1], int(sys.argv[3])
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
    if step == 0 and rank == 0:  # rank 0's own evaluation
        with torch.no_grad():
            for _ in range(70):
                model.module(tokens)
record = {"scales": scales, "exchanges": exchanges, "stats": scaler.stats.as_dict()}
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as handle:
    json.dump(record, handle)
dist.barrier()
del model
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_a_rank_whose_sampler_disarmed_itself_still_joins_the_underflow_exchange(tmp_path: Path) -> None:
    """Rank 0 evaluates alone while the sample is armed and its sampler disarms itself (64 calls): both ranks still
    call agree_on_underflow at the same update (rank 0 with nothing counted), so the collectives stay paired.
    Before, rank 1 all-reduced the sample at step 1 and rank 0 (re-armed) at step 2: gloo paired rank 1's
    underflow all-reduce with DDP's gradient bucket of rank 0 (the job failed, or mixed the two)."""
    worker = tmp_path / "worker.py"
    worker.write_text(ONE_RANK_EVALUATES)
    out = tmp_path / "out"
    out.mkdir()
    steps = 4
    command = ["timeout", "120", *torchrun_command(str(worker), str(out), str(TESTS), str(steps))]
    env = environment_without_ampguard(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="1000")
    result = run_torchrun(command, cwd=tmp_path, env=env, timeout=150)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    first, second = (json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2))
    assert first["exchanges"] == second["exchanges"] == [[], [5, 1], [], []]
    assert first["scales"] == second["scales"]
    assert first["stats"]["underflow_samples"] == second["stats"]["underflow_samples"] == 1
