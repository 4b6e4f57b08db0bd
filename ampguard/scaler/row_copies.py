"""Device mode: each iteration's ledger row copied to the host as it is written, and known without a sync.

A fused optimizer skips on the device, and ampguard used to learn of a skip
only at the next read of the ledger (a stats line, ``scaler.stats``, a
checkpoint: every ``AMPGUARD_STATS_EVERY`` steps). Now each row
(``[skipped, found, check, scale]``, :mod:`ampguard.scaler.ledger`) is also
copied into host memory as it is written (:class:`~ampguard.syncs.HostCopy`: on
CUDA a ``non_blocking`` copy into pinned memory followed by an event, which
:meth:`RowCopies.known` polls without a synchronisation at each later
``update()``); a row is known one or two iterations after it was written, when the GPU has got there.
On the CPU the row is host memory already and is known at once.

What is learned early goes to the listeners (:mod:`ampguard.scaler.listeners`):
forward overflows (the probe arms) and the optimizers whose steps were skipped
(their LR schedulers hold at their next step). The counters themselves are
still replayed from the ledger at its next read, which stays the one source of
``scaler.stats``.

Cost on CUDA, per device-mode iteration: one 16-byte device-to-host copy and
one event record; no host read. On other accelerators (no event to poll) rows
are learned at the ledger's read, as before.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

import ampguard.scaler.policy as policy
from ampguard.syncs import HostCopy


@dataclass
class KnownRow:
    """A ledger row read from its host copy: the iteration's verdict."""

    skipped: int  # optimizer steps skipped
    found: bool  # an optimizer found inf/NaN gradients
    nonfinite_loss: bool
    forward_overflow: bool  # policy.forward_overflow: the gradients overflowed while a loss itself was inf/NaN
    held: bool  # that forward overflow kept the scale and the growth tracker (not under torch.distributed)
    scale: float  # the scale the iteration ran at
    unread: list[torch.optim.Optimizer]  # the optimizers stepped that no host read told of (fused; those alive)
    read_skips: int  # skips among the others, which the host read (so the rest of ``skipped`` is the unread ones')

    @property
    def unread_all_skipped(self) -> bool:
        """Every unread optimizer skipped (when only some did, the row does not say which: none is named)."""
        return bool(self.unread) and self.skipped - self.read_skips >= len(self.unread)


class RowCopies:
    """The host copies of one ledger's rows, oldest first, until each is known."""

    RING_ROWS = 256

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: deque[tuple[HostCopy, bool, list[weakref.ref[Any]], int]] = deque()
        self._free: list[torch.Tensor] = []

    @staticmethod
    def supported(device: torch.device) -> bool:
        return HostCopy.supported(device)

    def add(self, row: torch.Tensor, held: bool, unread: list[torch.optim.Optimizer], read_skips: int) -> None:
        """Start the copy of ``row`` (just written on the device) to the host."""
        refs = list(map(weakref.ref, unread))
        into = self._host_row() if self.device.type == "cuda" else None  # (a CPU row is host memory already)
        self.pending.append((HostCopy(row, into), held, refs, read_skips))

    def known(self) -> list[KnownRow]:
        """The rows whose copies are complete, oldest first (each returned once). No synchronisation."""
        rows: list[KnownRow] = []
        while self.pending and self.pending[0][0].ready:
            copy, held, refs, read_skips = self.pending.popleft()
            if copy.event is not None and copy.host is not None:
                self._free.append(copy.host)
            rows.append(_known_row(copy.values(), held, refs, read_skips))  # ready: host memory, no device read
        return rows

    def settle(self, values: list[list[float]]) -> list[KnownRow]:
        """The rows still pending, from ``values`` (the same rows as the ledger's read gave them), oldest first:
        each told once, as :meth:`known` would have told it once its copy landed. The copies are dropped."""
        rows = [
            _known_row(row, held, refs, read_skips) for (_, held, refs, read_skips), row in zip(self.pending, values)
        ]
        self.pending.clear()
        return rows

    def _host_row(self) -> torch.Tensor:
        if not self._free:
            ring = torch.empty(self.RING_ROWS, 4, dtype=torch.float32, pin_memory=True)
            self._free = list(reversed(ring.unbind(0)))
        return self._free.pop()


def _known_row(values: list[float], held: bool, refs: list[weakref.ref[Any]], read_skips: int) -> KnownRow:
    skipped, found, check, scale = values
    nonfinite = check != check
    unread = [optimizer for ref in refs if (optimizer := ref()) is not None]
    forward = policy.forward_overflow(bool(found), nonfinite)
    return KnownRow(int(skipped), bool(found), nonfinite, forward, held and forward, scale, unread, read_skips)
