"""DeepSpeed's fp16 loss scaling under ampguard at 2 ranks (gloo, the real engine on the CPU), ZeRO 0-3.

One process group for every case: two processes of tests/deepspeed_fp16/deepspeed_run.py (``RANK`` 0 and 1) train
the same list of runs, each a fresh engine, plain DeepSpeed and under ampguard in turn, 12 steps of a tiny model
(a healthy run 6, a run with the overflowing block 8; the whole file takes about 15-30 s on 2 shared cores). Each
rank sees the same batches; DeepSpeed averages the gradients between the ranks, and agrees on overflow. Checked,
each against plain DeepSpeed in the same processes:

- the block overflowing float16 inside it: plain DeepSpeed skips nearly every step; under ampguard both ranks agree
  that the loss was inf/NaN (one all-reduce, on skipped steps only), make the block an island at step 2, keep the
  scale and end with the same finite weights;
- a healthy run from the same scale: plain DeepSpeed's weights bit for bit on both ranks, with as many host reads;
- ZeRO 2 and 3 saved after step 6 and resumed (each rank loads its own optimizer partition): the counts and the
  weights of the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deepspeed_environment import environment

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (DS_BUILD_OPS=0 pip install deepspeed)"
    ),
]

STEPS = 12
HEALTHY_STEPS = 6  # a healthy run is compared with plain DeepSpeed step for step: 6 show it
INSIDE_STEPS = 8  # the island is made at step 2: 6 steps train through it
SAVED_AT = 6
STAGES = (0, 1, 2, 3)
SCRIPT = Path(__file__).with_name("deepspeed_run.py")
NO_DECAY = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.0}}}


def _runs() -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for stage in STAGES:
        for amp in (False, True):
            who = "ampguard" if amp else "plain"
            common = {"stage": stage, "steps": STEPS, "ampguard": amp}
            inside = {"overflow": "inside", "config": NO_DECAY, "steps": INSIDE_STEPS}
            runs.append({**common, **inside, "name": f"inside {stage} {who}"})
            healthy = {"overflow": "never", "initial_scale_power": 12, "count_reads": True, "steps": HEALTHY_STEPS}
            runs.append({**common, **healthy, "name": f"healthy {stage} {who}"})
    for stage in (2, 3):
        common = {"stage": stage, "steps": STEPS, "ampguard": True, "overflow": "every5"}
        save = {"at": SAVED_AT, "name": f"two-ranks-{stage}"}
        runs.append({**common, "name": f"saves {stage}", "save": save})
        runs.append({**common, "name": f"loads {stage}", "load": save})
    return runs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """Each rank's results by run name."""
    runs = _runs()
    base = environment(
        MASTER_ADDR="127.0.0.1",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        DEEPSPEED_CHECKPOINTS=str(tmp_path_factory.mktemp("checkpoints")),
    )
    # Each rank writes to files: a pipe read after the other rank's could fill and stall both in a collective.
    out = tmp_path_factory.mktemp("ranks")
    processes = []
    for rank in (0, 1):
        with open(out / f"{rank}.out", "w") as stdout, open(out / f"{rank}.err", "w") as stderr:
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            command = [sys.executable, str(SCRIPT), json.dumps(runs)]
            processes.append(subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True))
    try:
        for process in processes:
            process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2 ranks did not end within 300 s: {(out / '0.err').read_text()[-3000:]}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    results = []
    for rank, process in enumerate(processes):
        stderr = (out / f"{rank}.err").read_text()
        assert process.returncode == 0, stderr[-4000:]
        lines = [json.loads(line) for line in (out / f"{rank}.out").read_text().splitlines() if line.startswith("{")]
        assert len(lines) == len(runs), stderr[-4000:]
        results.append({run["name"]: line for run, line in zip(runs, lines)})
    return results


@pytest.mark.parametrize("stage", STAGES)
def test_an_overflow_inside_a_block_becomes_an_island_on_both_ranks_with_the_scale_kept(ranks, stage):
    for rank in ranks:
        plain, guarded = rank[f"inside {stage} plain"], rank[f"inside {stage} ampguard"]
        assert plain["engine_skipped"] >= INSIDE_STEPS - 2  # (no scale helps: it falls at each)
        counts = guarded["ampguard"]
        assert guarded["died"] is None and guarded["finite"]
        assert counts["skipped"] == counts["nonfinite_loss"] == guarded["engine_skipped"] == 2
        assert guarded["islands"] == ["2"]
        assert guarded["scale"] == counts["min_scale_seen"] == 1024
    assert ranks[0][f"inside {stage} ampguard"]["parameters"] == ranks[1][f"inside {stage} ampguard"]["parameters"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_healthy_run_gives_plain_deepspeeds_weights_and_host_reads_on_both_ranks(ranks, stage):
    for rank in ranks:
        plain, guarded = rank[f"healthy {stage} plain"], rank[f"healthy {stage} ampguard"]
        assert plain["died"] is None and guarded["died"] is None
        assert plain["engine_skipped"] == guarded["engine_skipped"] == guarded["ampguard"]["skipped"] == 0
        assert plain["parameters"] == guarded["parameters"]
        assert plain["host_reads"]["aten::_local_scalar_dense"] >= HEALTHY_STEPS - 2
        assert guarded["host_reads"] == plain["host_reads"]
    assert ranks[0][f"healthy {stage} ampguard"]["parameters"] == ranks[1][f"healthy {stage} ampguard"]["parameters"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_resumes_the_counts_on_both_ranks(ranks, stage):
    for rank in ranks:
        whole, resumed = rank[f"saves {stage}"], rank[f"loads {stage}"]
        assert whole["died"] is None and resumed["died"] is None
        assert resumed["ampguard"] == whole["ampguard"]
        assert (whole["ampguard"]["steps"], whole["ampguard"]["skipped"]) == (STEPS, 2)  # steps 5 and 10
        assert resumed["parameters"] == whole["parameters"]
