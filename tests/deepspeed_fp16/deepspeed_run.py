"""One process, the real DeepSpeed engine on the CPU (gloo, one rank): runs the trainings it is given, prints JSON.

``python deepspeed_run.py '<json>'`` where the JSON is a list of runs, each
``{"stage": 0..3, "overflow": "never"|"always"|"every5"|"inside"|"backward"|"backward5", "steps": N, "ampguard": bool,
"initial_scale_power": P (optional), "env": {AMPGUARD_*: value} (optional), "config": {more DeepSpeed config}
(optional), "count_reads": bool (optional), "save": {"at": K, "name": N} (optional: ``engine.save_checkpoint``
after step K into $DEEPSPEED_CHECKPOINTS/N), "load": {"at": K, "name": N} (optional: ``engine.load_checkpoint``
of that checkpoint before training, which then goes on from step K + 1 with the data and overflows of an
uninterrupted run), "backward": "engine" (default: ``engine.backward(loss)``) | "scale"
(``engine.scale(loss).backward()``) | "tensor" (``loss.backward()``)}``. Each run trains a fresh engine (same
seed, same data) and prints one JSON line: ``died`` (the exception that ended it, or null), the skipped steps as the
engine counts them and ampguard's counts, the final loss scale, whether every parameter is finite, the parameters,
ampguard's log records and the stats-file records written during the run, the fp32 islands, the initial parameters.
Before the runs, one line ``import order: <json>``: what importing deepspeed after ampguard made of it
(:func:`import_order`).

ampguard is installed again before each run with the run's environment, or uninstalled for a plain run: one process
trains both, so both see the same DeepSpeed, and uninstall is exercised each time. DeepSpeed's CPU accelerator
refuses float16; this script, and only it, tells it otherwise so that the GPU code paths run on CPU tensors
(docs/deepspeed.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
os.environ.setdefault("RANK", "0")  # one rank unless the caller starts several
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")

import torch

import ampguard
import ampguard.deepspeed_fp16.tracking as tracking
from ampguard.deepspeed_fp16 import hooks
from ampguard.fp32_islands.patch import applied_healing
from ampguard.syncs import HostReadCounter

# isort: split
# deepspeed is imported after ampguard: the patch reaches it through the post-import hook
# (tests/deepspeed_fp16/test_deepspeed_fp16_patch.py imports it before).
IMPORTED_BEFORE_AMPGUARD = "deepspeed" in sys.modules  # (import_order: the imports below come after it)
import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402

get_accelerator().is_fp16_supported = lambda: True  # the CPU runs DeepSpeed's float16 paths (this test's only)
for _name in ("DeepSpeed", "deepspeed"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class LoudGradient(torch.autograd.Function):
    """The identity, whose gradient is multiplied by 1e6: float16 gradients overflow, the loss stays finite."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e6


class Loud(torch.nn.Module):
    """Multiplies by 1e5 on the calls ``overflow`` names: its float16 activations (about 1) become inf (a forward
    overflow); or (``backward``, ``backward5``) its gradient, on every call or every 5th (a gradient overflow)."""

    def __init__(self, overflow: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.overflow = overflow
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.linear(x)
        if self.overflow == "always" or (self.overflow == "every5" and self.calls % 5 == 0):
            y = y * 1e5
        elif self.overflow == "inside":  # past 65504 inside the block only: its output is finite in float32
            y = (y * 1e5) / 1e5
        elif self.overflow == "backward" or (self.overflow == "backward5" and self.calls % 5 == 0):
            y = LoudGradient.apply(y)
        return y


def model(overflow: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), Loud(overflow), torch.nn.Linear(16, 1))


class Records(logging.Handler):
    """ampguard's log records of one run, as ``LEVEL: message``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def _stats_lines() -> int:
    path = os.environ.get("AMPGUARD_STATS_FILE")
    if not path or not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as file:
        return len(file.readlines())


def _stats_since(count: int) -> list[dict[str, Any]]:
    path = os.environ.get("AMPGUARD_STATS_FILE")
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file.readlines()[count:]]


def train(run: dict[str, Any]) -> dict[str, Any]:
    saved = {name: os.environ.get(name) for name in run.get("env", {})}
    os.environ.update(run.get("env", {}))
    ampguard.uninstall()
    if run["ampguard"]:
        ampguard.install()
    records = Records()
    logging.getLogger("ampguard").addHandler(records)
    stats_before = _stats_lines()
    fp16: dict[str, Any] = {"enabled": True}
    if run.get("initial_scale_power") is not None:
        fp16["initial_scale_power"] = run["initial_scale_power"]
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "fp16": fp16,
        "zero_optimization": {"stage": run["stage"]},
        "steps_per_print": 10**9,
        **run.get("config", {}),
    }
    net = model(run["overflow"])
    initial = [p.detach().float().flatten().tolist() for p in net.parameters()]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    generator = torch.Generator().manual_seed(1)
    died, died_at = None, None
    reads = HostReadCounter()  # the host reads of the steps after the first two (when "count_reads")
    checkpoints = os.environ.get("DEEPSPEED_CHECKPOINTS", ".")
    dtype = next(engine.module.parameters()).dtype  # float16, or bfloat16 where the config says so
    first = 1
    if run.get("load"):
        engine.load_checkpoint(os.path.join(checkpoints, run["load"]["name"]), tag="t")
        first = run["load"]["at"] + 1
        net[2].calls = run["load"]["at"] * engine.gradient_accumulation_steps()
    for step in range(1, run["steps"] + 1):
        x = torch.randn(8, 8, generator=generator).to(dtype)
        target = torch.randn(8, 1, generator=generator)
        if step < first:  # the data of the steps the loaded checkpoint took
            continue
        counting = run.get("count_reads", False) and step > 2
        try:
            with reads if counting else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(engine(x).float(), target)
                backward = run.get("backward", "engine")
                if backward == "engine":
                    engine.backward(loss)
                else:
                    (engine.scale(loss) if backward == "scale" else loss).backward()
                engine.step()
        except Exception as error:
            died, died_at = f"{type(error).__name__}: {error}", step
            break
        if run.get("save") and step == run["save"]["at"]:
            engine.save_checkpoint(os.path.join(checkpoints, run["save"]["name"]), tag="t")
    parameters = list(engine.module.parameters())
    if run["stage"] == 3:
        with deepspeed.zero.GatheredParameters(parameters):
            values = [p.detach().float().clone() for p in parameters]
    else:
        values = [p.detach().float().clone() for p in parameters]
    counts = tracking.of(engine.optimizer)
    island_names = list(healing.islands.names()) if (healing := applied_healing()) is not None else []
    result = {
        "died": died,
        "died_at": died_at,
        "engine_skipped": engine.skipped_steps,
        "ampguard": counts.stats.as_dict() if counts is not None else None,
        "scale": float(engine.optimizer.loss_scale),
        "finite": all(bool(torch.isfinite(v).all()) for v in values),
        "parameters": [v.flatten().tolist() for v in values],
        "log": records.lines,
        "host_reads": dict(reads.by_source),
        "stats_file": _stats_since(stats_before),
        "islands": island_names,
        "initial": initial,
    }
    logging.getLogger("ampguard").removeHandler(records)
    engine.destroy()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return result


def import_order() -> dict[str, Any]:
    """Whether deepspeed was imported before ampguard here, and what ampguard's post-import hook made of it: the
    module of ``DynamicLossScaler.update_scale`` (ampguard's hooks' where patched) and the default config's
    initial loss scale (ampguard's 1024 where patched, DeepSpeed's 65536 where not). Read before any run (each
    uninstalls and installs ampguard again)."""
    return {
        "imported_before_ampguard": IMPORTED_BEFORE_AMPGUARD,
        "update_scale": DynamicLossScaler.update_scale.__module__,
        "hooks": hooks.__name__,
        "init_scale": DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args()["init_scale"],
    }


def main() -> None:
    print(f"import order: {json.dumps(import_order())}", flush=True)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(sys.argv[1]):
        print(json.dumps(train(run)), flush=True)


if __name__ == "__main__":
    main()
