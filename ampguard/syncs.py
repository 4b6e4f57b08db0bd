"""Host-device synchronisations: counted (for tests and ``ampguard bench``), and avoided (:class:`HostCopy`).

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


class HostCopy:
    """A small device tensor's values on their way to the host, known without a synchronisation.

    On CUDA a ``non_blocking`` copy into pinned memory (``into``, or a new
    buffer) followed by an event: :attr:`ready` polls the event
    (``Event.query()``, no synchronisation). On the CPU the tensor is host memory
    already and ready at once. On other accelerators (no event to poll) it is
    never ready. :meth:`values` returns the host copy once ready; before that it
    reads the device tensor as ampguard reads anything (:func:`read_to_host`:
    one counted synchronisation).

    Example::

        copy = HostCopy(verdict)  # at the end of a step: queued behind the step's kernels
        ...
        if copy.ready:  # at a later step: the device has got there, reading costs nothing
            values = copy.values()
    """

    def __init__(self, tensor: torch.Tensor, into: torch.Tensor | None = None) -> None:
        self.device_tensor = tensor
        self.event: Any = None
        self.host: torch.Tensor | None = None
        if tensor.device.type == "cpu":
            self.host = tensor
        elif tensor.device.type == "cuda":
            self.host = into if into is not None else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    @staticmethod
    def supported(device: torch.device) -> bool:
        """Whether a copy from ``device`` can become :attr:`ready` without a synchronisation."""
        return device.type in ("cpu", "cuda")

    @property
    def ready(self) -> bool:
        """Whether the values are on the host: reading them costs no synchronisation."""
        return self.host is not None and (self.event is None or bool(self.event.query()))

    def values(self) -> list[Any]:
        """The values: the host copy when :attr:`ready`, else one counted read of the device tensor."""
        if self.ready and self.host is not None:
            return list(self.host.tolist())
        return read_to_host(self.device_tensor)
