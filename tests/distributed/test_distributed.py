"""ampguard across ranks: DDP and FSDP on CPU with gloo, 2 processes.

The DDP tests launch the real thing, ``python -m torch.distributed.run
--standalone --nproc-per-node 2`` (a free port is picked by torchrun), with each
rank's stdout/stderr redirected to its own file: their claim is the README's
torchrun commands. The FSDP tests start the 2 ranks directly (torchrun_support.run_ranks,
torchrun's environment without its agent). Each runs :data:`WORKER`: a
small fp16-autocast training loop with an overflow injected on one rank only.
The workers write what they saw to JSON (and their final parameters); the test
compares the ranks.

Injected overflows (0-based steps):

* step 2, *backward* overflow on one rank. DDP: rank 1's loss is multiplied by
  1e8, so its fp16 backward overflows while the loss stays finite. FSDP: rank 0
  puts inf into the gradient of a parameter that lives in rank 1's shard, so
  after the reduce-scatter rank 0's own shard is finite and only the
  ShardedGradScaler's all-reduce of found_inf can make rank 0 skip.
* step 5, *forward* overflow on rank 1: its input is multiplied by 1e6, its fp16
  activations and its loss become inf.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrun_support import environment_without_ampguard, run_ranks, run_torchrun, torchrun_command

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

STEPS = 8
SKIPPED_STEPS = (2, 5)
STATS_EVERY = 4

WORKER = r'''
"""One rank of tests/distributed/test_distributed.py (argv: mode imports out_dir)."""
import json
import os
import sys

MODE, IMPORTS, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
if IMPORTS == "sharded-first":
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    import ampguard
elif IMPORTS == "ampguard-first":
    import ampguard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
else:
    assert IMPORTS == "none"  # run under `ampguard run`: this script does not import ampguard

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS, BACKWARD_STEP, FORWARD_STEP = int(os.environ["T_STEPS"]), 2, 5


class GradInjector(torch.autograd.Function):
    """Adds 0 to the output; in backward gives ``probe`` an inf gradient when asked to."""

    @staticmethod
    def forward(ctx, probe, inject):
        ctx.inject, ctx.shape, ctx.dtype = inject, probe.shape, probe.dtype
        return probe.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        value = float("inf") if ctx.inject else 0.0
        return torch.full(ctx.shape, value, dtype=ctx.dtype), None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        # Registered last, so its 4 elements are the last of FSDP's flat
        # parameter: they live in rank 1's shard.
        self.tail = torch.nn.Module()
        self.tail.probe = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, inject=False):
        return self.body(x) + GradInjector.apply(self.tail.probe, inject)


def full_params(model):
    if MODE == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    if MODE == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        scaler = torch.amp.GradScaler("cpu")
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"))
        scaler = ShardedGradScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stepped = []
    real_step = optimizer.step

    def counting_step(*args, **kwargs):
        stepped[-1] = True
        return real_step(*args, **kwargs)

    optimizer.step = counting_step
    data = torch.Generator().manual_seed(100 + rank)  # every rank sees its own batches
    record = {"stepped": stepped, "scale": [], "checksum": [], "local_grads_finite": [], "loss_finite": []}
    record["checksum"].append(sum(float(p.double().sum()) for p in full_params(model)))
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=data)
        y = torch.randn(16, 4, generator=data)
        if rank == 1 and step == FORWARD_STEP:
            x = x * 1e6
        inject = MODE == "fsdp" and rank == 0 and step == BACKWARD_STEP
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x, inject).float(), y)
        if MODE == "ddp" and rank == 1 and step == BACKWARD_STEP:
            loss = loss * 1e8
        record["loss_finite"].append(bool(torch.isfinite(loss)))
        scaler.scale(loss).backward()
        record["local_grads_finite"].append(
            all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        )
        stepped.append(False)
        scaler.step(optimizer)
        scaler.update()
        record["scale"].append(scaler.get_scale())
        record["checksum"].append(sum(float(p.double().sum()) for p in full_params(model)))
    import ampguard as loaded  # already imported by now in every mode

    record["scaler_is_safe"] = isinstance(scaler, loaded.SafeGradScaler)
    record["scaler_mro"] = [f"{c.__module__}.{c.__name__}" for c in type(scaler).__mro__]
    record["stats"] = scaler.stats.as_dict()
    torch.save(full_params(model), os.path.join(OUT, f"params{rank}.pt"))
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    dist.destroy_process_group()


def sharded_class_check():
    """FSDP's ShardedGradScaler class as this import order left it; after an uninstall; after installing again."""
    import torch.distributed.fsdp.sharded_grad_scaler as sharded_module
    from ampguard.scaler import SafeGradScaler, TorchGradScaler

    def describe():
        cls = sharded_module.ShardedGradScaler
        stock = [c for c in cls.__mro__ if c.__module__ == sharded_module.__name__ and c.__qualname__ == "ShardedGradScaler"]
        scaler = cls("cpu", init_scale=4096.0, backoff_factor=0.25, growth_interval=7)
        return {
            "is_safe": issubclass(cls, SafeGradScaler),
            "name": cls.__name__,
            "class_id": id(cls),
            "stock_id": id(stock[0]) if stock else None,
            "stock_bases_are_torch": bool(stock) and stock[0].__bases__ == (TorchGradScaler,),
            "module_gradscaler_is_torch": sharded_module.GradScaler is TorchGradScaler,
            "module_gradscaler_is_safe": sharded_module.GradScaler is torch.amp.GradScaler,
            # the name this script bound before importing ampguard (sharded-first only)
            "bound_early_is_current": IMPORTS != "sharded-first" or globals()["ShardedGradScaler"] is cls,
            "instance_is_safe": isinstance(scaler, SafeGradScaler),
            "instance_is_sharded": isinstance(scaler, stock[0]) if stock else False,
            # the sharded constructor order (backoff before growth) reaches torch's fields
            "settings": [scaler.get_scale(), scaler.get_backoff_factor(), scaler.get_growth_factor(), scaler.get_growth_interval()],
            "process_group_attr": hasattr(scaler, "process_group"),
            "defaults": [cls("cpu").get_scale(), cls("cpu").get_growth_interval()],
        }

    report = {"installed": describe()}
    ampguard.uninstall()
    report["uninstalled"] = describe()
    ampguard.install()
    report["reinstalled"] = describe()
    with open(os.path.join(OUT, "sharded_class_check.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
    if MODE == "fsdp" and int(os.environ["RANK"]) == 0:  # once the job is done, in the process its imports made
        sharded_class_check()
'''


def _job(tmp_path: Path, *worker_args: str, under_ampguard_run: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Run WORKER on 2 ranks (under ``torchrun -m ampguard run`` or, without it, started directly); return each
    rank's record and its stderr."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = environment_without_ampguard(AMPGUARD_STATS_EVERY=str(STATS_EVERY), T_STEPS=str(STEPS))
    if under_ampguard_run:
        logs = tmp_path / "logs"
        command = torchrun_command("-m", "ampguard", "run", str(worker), *worker_args, str(out), log_dir=logs)
        result = run_torchrun(command, cwd=tmp_path, env=env, timeout=180, log_dir=logs)
        stderr = [_rank_log(logs, rank, "stderr") for rank in range(2)]
        returncode, heading = result.returncode, f"torchrun exited {result.returncode}\n{result.stderr[-4000:]}\n"
    else:
        ranks = run_ranks([str(worker), *worker_args, str(out)], cwd=tmp_path, env=env, timeout=180)
        stderr, returncode, heading = ranks.stderr, ranks.returncode, f"the ranks exited {ranks.returncode}\n"
    if returncode != 0:
        pytest.fail(heading + "".join(f"--- rank {r} stderr\n{text[-4000:]}\n" for r, text in enumerate(stderr)))
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        record["params"] = torch.load(out / f"params{rank}.pt")
    return records, stderr


def _ci_line(request: pytest.FixtureRequest, client: str, skipped: int, steps: int) -> None:
    """``ampguard-integration <client>: skipped=<n> steps=<m>`` on the real stderr, so CI logs show it without ``-s``."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    suspended = capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
    with suspended:
        stream = sys.__stderr__ or sys.stderr
        stream.write(f"\nampguard-integration {client}: skipped={skipped} steps={steps}\n")
        stream.flush()


def _rank_log(logs: Path, rank: int, stream: str) -> str:
    found = sorted(logs.glob(f"**/attempt_*/{rank}/{stream}.log"))
    return found[-1].read_text() if found else ""


def _ampguard_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ampguard")]


def _check_ranks_agree(records: list[dict[str, Any]], forward_backoff: bool = False) -> None:
    """The guarantees across ranks: the same steps skipped, identical parameters, the same scaler state."""
    expected_stepped = [step not in SKIPPED_STEPS for step in range(STEPS)]
    for rank, record in enumerate(records):
        assert record["scaler_is_safe"], (rank, record["scaler_mro"])
        assert record["stepped"] == expected_stepped, f"rank {rank} stepped {record['stepped']}"
        checksums = record["checksum"]
        for step in range(STEPS):
            changed = checksums[step + 1] != checksums[step]
            assert changed == expected_stepped[step], f"rank {rank} step {step}: parameters changed={changed}"
    first, second = records
    assert first["checksum"] == second["checksum"]
    assert len(first["params"]) == len(second["params"])
    for mine, theirs in zip(first["params"], second["params"]):
        assert torch.equal(mine, theirs)
    # The backward overflow halves the scale, on every rank. The forward overflow (rank 1's loss inf) keeps
    # it (docs/islands.md); FSDP's ShardedGradScaler keeps its bookkeeping on the device, where the ranks
    # cannot agree on "was a loss inf" without a collective, so it backs off as torch's does.
    assert first["scale"] == second["scale"]
    assert first["scale"][SKIPPED_STEPS[0]] == first["scale"][0] / 2
    assert first["scale"][SKIPPED_STEPS[1]] == first["scale"][0] / (4 if forward_backoff else 2)
    # The loss was inf only on rank 1 at the forward-overflow step; never at the backward one.
    assert first["loss_finite"] == [True] * STEPS
    assert second["loss_finite"] == [step != SKIPPED_STEPS[1] for step in range(STEPS)]
    # Every counter agrees, except nonfinite_loss: it describes this rank's own loss; and what the headroom watch
    # and the underflow sample measured, each rank's own batches' (before the gradients are all-reduced).
    ours, theirs = _shared(first["stats"]), _shared(second["stats"])
    assert (ours.pop("nonfinite_loss"), theirs.pop("nonfinite_loss")) == (0, 1)
    assert ours == theirs
    assert ours["steps"] == STEPS and ours["skipped"] == len(SKIPPED_STEPS)
    assert ours["consecutive_skipped"] == 0 and ours["scale"] == first["scale"][-1]


def _check_logs_from_rank_zero_only(stderr: list[str]) -> None:
    rank0, rank1 = (_ampguard_lines(text) for text in stderr)
    assert any(line.startswith("ampguard: ") and " on torch " in line for line in rank0), rank0  # the banner
    stats = [line for line in rank0 if line.startswith("ampguard: stats ")]
    assert [line.split()[2] for line in stats] == [f"step={n}" for n in range(STATS_EVERY, STEPS + 1, STATS_EVERY)], (
        stats
    )
    assert f"skipped_total={len(SKIPPED_STEPS)} " in stats[-1]
    # Rank 1 says one thing: that its own loss was inf/NaN (rank 0 saw only inf/NaN gradients).
    assert len(rank1) == 1 and rank1[0].startswith(f"ampguard WARNING: [rank 1] step {SKIPPED_STEPS[1] + 1} skipped"), (
        rank1
    )
    assert "forward overflow" in rank1[0]


@pytest.mark.distributed
def test_ddp_overflow_on_one_rank_under_ampguard_run(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``torchrun -m ampguard run``, a DDP script that never imports ampguard."""
    records, stderr = _job(tmp_path, "ddp", "none", under_ampguard_run=True)
    _ci_line(request, "torchrun-ddp", records[0]["stats"]["skipped"], records[0]["stats"]["steps"])

    _check_ranks_agree(records)
    _check_logs_from_rank_zero_only(stderr)
    assert records[0]["scaler_mro"][:2] == [
        "ampguard.patches.grad_scaler.SafeGradScaler",
        "ampguard.scaler.SafeGradScaler",
    ]


@dataclass
class FsdpJob:
    """What one FSDP job left: each rank's record and stderr, and rank 0's check of the ShardedGradScaler class."""

    imports: str
    records: list[dict[str, Any]]
    stderr: list[str]
    sharded_class_check: dict[str, dict[str, Any]]


@pytest.fixture(scope="module", params=["ampguard-first", "sharded-first"])
def fsdp_job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FsdpJob:
    """The FSDP job, its script importing FSDP's sharded_grad_scaler module and ampguard in the order of the id."""
    tmp_path = tmp_path_factory.mktemp(f"fsdp-{request.param}")
    records, stderr = _job(tmp_path, "fsdp", request.param)
    check = json.loads((tmp_path / "out" / "sharded_class_check.json").read_text())
    return FsdpJob(request.param, records, stderr, check)


@pytest.mark.distributed
def test_fsdp_sharded_scaler_overflow_on_one_rank(fsdp_job: FsdpJob, request: pytest.FixtureRequest) -> None:
    records, stderr = fsdp_job.records, fsdp_job.stderr
    skipped, steps = records[0]["stats"]["skipped"], records[0]["stats"]["steps"]
    _ci_line(request, f"torchrun-fsdp/{fsdp_job.imports}", skipped, steps)

    # The backward overflow landed in rank 1's shard only: rank 0 skipped because
    # the ShardedGradScaler all-reduced found_inf, not because it saw an inf.
    assert [r["local_grads_finite"][SKIPPED_STEPS[0]] for r in records] == [True, False]
    _check_ranks_agree(records, forward_backoff=True)
    _check_logs_from_rank_zero_only(stderr)
    mro = records[0]["scaler_mro"]
    assert "ampguard.scaler.SafeGradScaler" in mro
    assert "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler" in mro


@pytest.mark.distributed
def test_sharded_scaler_import_orders_and_uninstall(fsdp_job: FsdpJob) -> None:
    """FSDP's ShardedGradScaler is ampguard's while installed, whichever was imported first, and stock after uninstall.

    Checked by rank 0 of the FSDP job once it is done: its imports, in the order of the test's id, are the
    process's first."""
    report = fsdp_job.sharded_class_check
    installed, uninstalled, reinstalled = report["installed"], report["uninstalled"], report["reinstalled"]

    for state in (installed, reinstalled):
        assert state["is_safe"] and state["instance_is_safe"] and state["instance_is_sharded"]
        assert state["name"] == "ShardedGradScaler"
        assert state["class_id"] != state["stock_id"]
        assert state["bound_early_is_current"]  # a name bound before ampguard was imported is rebound too
        assert state["module_gradscaler_is_safe"]
        assert state["process_group_attr"]
    assert reinstalled["class_id"] == installed["class_id"]
    assert installed["defaults"] == reinstalled["defaults"] == [1024.0, 100]
    assert uninstalled["defaults"] == [65536.0, 2000]

    # Uninstalled: the very class torch defined, on torch's own base class.
    assert not uninstalled["is_safe"] and not uninstalled["instance_is_safe"]
    assert uninstalled["class_id"] == uninstalled["stock_id"] == installed["stock_id"]
    assert uninstalled["stock_bases_are_torch"] and installed["stock_bases_are_torch"]
    assert uninstalled["module_gradscaler_is_torch"]
    assert uninstalled["bound_early_is_current"]
    # Explicit arguments in the sharded order (backoff before growth) are honoured in every state.
    for state in (installed, uninstalled, reinstalled):
        assert state["settings"] == [4096.0, 0.25, 2.0, 7]


@pytest.mark.distributed
def test_ddp_example_under_torchrun(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The README command: ``torchrun --nproc-per-node 2 -m ampguard run examples/ddp_train.py``."""
    env = environment_without_ampguard()
    steps = 30
    command = torchrun_command(
        "-m", "ampguard", "run", str(EXAMPLES / "ddp_train.py"), "--steps", str(steps), "--overflow-step", "10"
    )
    result = run_torchrun(command, cwd=tmp_path, env=env, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]

    summaries = re.findall(
        r"^ddp_train: world=(\d+) steps=(\d+) skipped=(\d+) ampguard_skipped=(\d+) .*params_identical=(\w+)",
        output,
        re.M,
    )
    assert summaries == [("2", str(steps), "1", "1", "True")], output[-6000:]  # rank 0 only, one skip seen both ways
    banners = [line for line in output.splitlines() if line.startswith("ampguard: ") and " on torch " in line]
    assert len(banners) == 1, banners  # one banner for two ranks
    _ci_line(request, "ddp-example", int(summaries[0][2]), steps)


def _shared(stats: dict[str, Any]) -> dict[str, Any]:
    """A rank's stats without its own measurements (headroom, underflow_*)."""
    return {key: value for key, value in stats.items() if key != "headroom" and not key.startswith("underflow_")}
