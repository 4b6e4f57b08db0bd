"""Counting, not timing: host-device synchronisations and dispatched aten ops per step (deterministic).

A counting TorchDispatchMode slows every op down, so this pass is separate
from the timed ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampguard.commands.bench.runs import COUNTED_STEPS, Options, Run, make_runs, optimizer_name
from ampguard.syncs import HostReadCounter


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it (``ops.total``, ``ops.by_op``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.by_op[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class DeviceSyncCounter(HostReadCounter):
    """:class:`~ampguard.syncs.HostReadCounter`, less the reads of tensors that live on the host in any run.

    A non-fused, non-capturable torch optimizer keeps each parameter's step
    count in a CPU tensor and reads it (``.item()``) every step, on a GPU run
    too, where that is no synchronisation. Those reads are the same for both
    variants; they are tallied in ``host_resident_reads`` instead of ``total``
    so that the counts are the synchronisations a GPU run would make.
    """

    def __init__(self, host_resident: Callable[[], set[int]]) -> None:
        super().__init__()
        self._host_resident = host_resident
        self.host_resident_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name == "aten::_local_scalar_dense" and args and id(args[0]) in self._host_resident():
            self.host_resident_reads += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _optimizer_step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    return {
        id(state["step"])
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor)
        and state["step"].device.type == "cpu"
        and not getattr(optimizer, "_step_supports_amp_scaling", False)
    }


def count_steps(run: Run, steps: int) -> tuple[int, int, Counter[str]]:
    """(device synchronisations, host-resident reads, ops by name) of ``steps`` steps of ``run``."""
    counters = _optimizer_step_counters(run.optimizer)
    reads, ops = DeviceSyncCounter(lambda: counters), OpCounter()
    with reads, ops:
        run.steps(steps)
    return reads.total, reads.host_resident_reads, ops.by_op


def count_syncs(options: Options, fused: bool) -> dict[str, Any]:
    """Host-device synchronisations and dispatched ops per step of each variant (deterministic)."""
    torch_run, ampguard_run = make_runs(options, fused)
    torch_run.steps(2)  # lazy state (scale tensors, optimizer state) out of the way
    ampguard_run.steps(2)
    torch_reads, torch_host, torch_ops = count_steps(torch_run, COUNTED_STEPS)
    ampguard_reads, ampguard_host, ampguard_ops = count_steps(ampguard_run, COUNTED_STEPS)
    with HostReadCounter() as report_reads:
        _ = ampguard_run.scaler.stats  # what a stats line (every AMPGUARD_STATS_EVERY steps) reads
    extra_ops = ampguard_ops.copy()
    extra_ops.subtract(torch_ops)
    return {
        "optimizer": optimizer_name(fused),
        "torch_per_step": torch_reads / COUNTED_STEPS,
        "ampguard_per_step": ampguard_reads / COUNTED_STEPS,
        "extra_per_step": (ampguard_reads - torch_reads) / COUNTED_STEPS,
        "ampguard_per_stats_report": report_reads.total,
        "optimizer_host_reads_per_step": [torch_host / COUNTED_STEPS, ampguard_host / COUNTED_STEPS],
        "torch_ops_per_step": sum(torch_ops.values()) / COUNTED_STEPS,
        "ampguard_ops_per_step": sum(ampguard_ops.values()) / COUNTED_STEPS,
        "extra_ops_per_step": {name: n / COUNTED_STEPS for name, n in sorted(extra_ops.items()) if n},
    }
