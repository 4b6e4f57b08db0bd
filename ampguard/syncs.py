"""Counting host-device synchronisations, for tests and ``ampguard bench``.

torch's host reads of device values dispatch ``aten::_local_scalar_dense``
(``.item()``, ``float()``, ``bool()`` on a tensor): :class:`HostReadCounter`
counts them under a TorchDispatchMode, so a CPU run counts exactly what a CUDA
run would do. ampguard's own device reads (the packed stats read of device
mode) all go through :func:`read_to_host`, which counts itself, because on a
CPU run its copy is not a device read the dispatcher could recognise.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # a torch that moved it: only counting (tests, ampguard bench) needs it, not training
    TorchDispatchMode = object  # type: ignore[assignment, misc]

_reads_by_ampguard = 0


def read_to_host(tensor: torch.Tensor) -> list[Any]:
    """ampguard's only way to read device values: one synchronisation on a GPU, counted."""
    global _reads_by_ampguard
    _reads_by_ampguard += 1
    return tensor.detach().to("cpu").tolist()


class HostReadCounter(TorchDispatchMode):
    """``with HostReadCounter() as reads: ...`` then ``reads.total`` (``reads.by_source`` for the split)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.by_source: Counter[str] = Counter()
        self._ampguard_before = 0

    @property
    def total(self) -> int:
        return sum(self.by_source.values())

    def __enter__(self) -> HostReadCounter:
        self._ampguard_before = _reads_by_ampguard
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        self.by_source["ampguard.read_to_host"] += _reads_by_ampguard - self._ampguard_before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name == "aten::_local_scalar_dense":
            self.by_source["aten::_local_scalar_dense"] += 1
        return func(*args, **(kwargs or {}))
