"""Device mode: the scaler's bookkeeping for iterations the host did not see.

Fused optimizers (``Adam(fused=True)`` ...) are stepped by torch without any
host read. For an iteration with such an optimizer (and for ``update(new_scale)``,
``unscale_()`` without ``step()``, and FSDP's ShardedGradScaler) ``update()``
writes one row per iteration into a ledger on the scale's device,
``[skipped, found, loss check, scale]``, with one ``stack(out=)``. The rows are
read (one sync) only when a stats line is due, ``scaler.stats`` is asked for,
a checkpoint is taken, or after :attr:`DeviceLedger.MAX_ROWS` iterations
(``DeviceBooks._fold_device_ledger``); each row is then a
:class:`~ampguard.scaler.verdict.StepVerdict`, counted by the one path host
mode counts by (``ScalePolicy._count``: skips, streaks, the scale's range),
the host refreshes its mirror of the scale and host mode resumes. Collapses
and stalls that happened in device mode are reported at that read (the lowest
collapse scale, the longest streak), even if they have ended since.

Per iteration that is 3 kernels: the row, the forward-overflow hold (a
``heaviside`` that zeroes the found_inf torch's ``update()`` reads where the
loss itself was non-finite: no back-off) and the floor/cap (``clamp_``). With
the hold, torch counts such an iteration toward the growth interval; where its
row is known at its own update (the CPU, :class:`RowCopies`) and
it was a forward overflow (:func:`ampguard.scaler.policy.forward_overflow`, the
rule host mode counts by: the gradients overflowed too; a non-finite loss with
finite gradients counts as in torch), the scale and tracker are put back as
host mode keeps them (``_keep_scale``, a few ops after a failure only); on
a GPU the row arrives later and the count stays.

**Row copies** (:class:`RowCopies`). A fused optimizer skips on the device;
each row is also copied into host memory as it is written
(:class:`~ampguard.syncs.HostCopy`: on CUDA a ``non_blocking`` copy into pinned
memory followed by an event, which :meth:`RowCopies.known` polls without a
synchronisation at each later ``update()``): a row is known one or two
iterations after it was written, when the GPU has got there; on the CPU it is
host memory already and known at once. What is learned early goes to the
listeners: forward overflows (the probe arms) and the optimizers whose steps
were skipped (their LR schedulers hold at their next step). The counters
themselves are still replayed from the ledger at its next read, the one source
of ``scaler.stats``. Cost on CUDA, per device-mode iteration: one 16-byte
device-to-host copy and one event record; no host read. On other accelerators
(no event to poll) rows are learned at the ledger's read.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

import ampguard.distributed as distributed
import ampguard.scaler.listeners as listeners
import ampguard.scaler.policy as policy
from ampguard.log import logger
from ampguard.scaler.policy import Alarms, ScalePolicy
from ampguard.scaler.verdict import StepVerdict
from ampguard.syncs import HostCopy, read_to_host

try:
    from torch.amp.grad_scaler import OptState
except ImportError:  # a torch that renamed it: the grad_scaler patch reports itself unavailable
    OptState = None  # type: ignore[assignment, misc]


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


class DeviceLedger:
    """One row per device-mode iteration, written on the device; replayed on the host at the next read.

    A row is ``[skipped, found, check, scale]``: how many stepped optimizers
    skipped, whether any optimizer found an overflow, ``loss - loss`` summed
    over the iteration's losses (0, or NaN when a loss was non-finite) and the
    scale the iteration ran at. Rows go into rings of ``RING_ROWS`` allocated
    as needed (their row views made once per ring).
    """

    RING_ROWS = 1024
    MAX_ROWS = 65536  # then a read: one sync in that many iterations, 1 MiB of rows at most

    def __init__(self, scale: torch.Tensor, consecutive: int) -> None:
        self.device = scale.device
        self.consecutive = consecutive  # the host's streak when device mode began
        self.zero = torch.zeros((), dtype=torch.float32, device=self.device)  # the check without a loss
        self._rings: list[torch.Tensor] = []
        self._free_rows: list[torch.Tensor] = []
        self._held: list[bool] = []  # per row: whether a non-finite loss was held (no back-off, no collapse)
        # Each row's copy on the host, learned without a sync; rows told to the listeners that way come first.
        self.copies = RowCopies(self.device) if RowCopies.supported(self.device) else None
        self.told = 0

    @property
    def rows_current(self) -> bool:
        """Every row written is known on the host (on the CPU, always after an update)."""
        return self.copies is not None and not self.copies.pending

    @property
    def full(self) -> bool:
        return len(self._held) >= self.MAX_ROWS

    def held_at(self, row: int) -> bool:
        """Whether row ``row``'s non-finite loss was held (a forward overflow: no back-off)."""
        return self._held[row]

    def record(
        self, skipped: torch.Tensor, found: torch.Tensor, check: torch.Tensor, scale: torch.Tensor, held: bool
    ) -> torch.Tensor:
        """Writes the row; returns it (a view, unchanged until the next read)."""
        if not self._free_rows:
            ring = torch.empty(self.RING_ROWS, 4, dtype=torch.float32, device=self.device)
            self._rings.append(ring)
            self._free_rows = list(reversed(ring.unbind(0)))
        row = self._free_rows.pop()
        torch.stack([skipped, found, check, scale], out=row)
        self._held.append(held)
        return row

    def read(self, scale: torch.Tensor, tracker: torch.Tensor) -> tuple[list[list[float]], float, int]:
        """The rows, the scale and the growth tracker now: one host read."""
        pieces = [ring.flatten() for ring in self._rings]
        pieces.append(torch.stack([scale.float(), tracker.float()]))
        values = read_to_host(torch.cat(pieces))
        rows = [values[4 * i : 4 * i + 4] for i in range(len(self._held))]
        return rows, values[-2], int(values[-1])

    def verdicts(self, rows: list[list[float]], scale: float) -> list[StepVerdict]:
        """Each row's verdict (``scale``: the scale now, after the last row's update)."""
        afters = [row[3] for row in rows[1:]] + [scale]
        verdicts = []
        for (skipped, found, check, before), held, after in zip(rows, self._held, afters):
            nonfinite = math.isnan(check)
            forward = held and policy.forward_overflow(found > 0, nonfinite)
            verdicts.append(StepVerdict(found > 0, int(skipped), nonfinite, forward, before, after))
        return verdicts


def _check_on(loss_check: torch.Tensor | None, ledger: DeviceLedger) -> torch.Tensor:
    """The iteration's loss check as a float32 scalar on the ledger's device (the ledger's zero when none)."""
    if loss_check is None:
        return ledger.zero
    return loss_check.to(ledger.device, torch.float32, non_blocking=True)  # itself when it is already that


class DeviceBooks(ScalePolicy):
    """Device mode: ``update()`` writes the iteration's row; the rows are replayed on the host at a read."""

    def _update_in_device_mode(self, states: dict[int, dict[str, Any]], new_scale: float | torch.Tensor | None) -> None:
        """``update()`` with the bookkeeping on the device: no host read, 3 kernels."""
        assert self._scale is not None and self._growth_tracker is not None
        if self._counters.ledger is None:
            self._counters.ledger = DeviceLedger(self._scale, self._counters.consecutive)
        ledger = self._counters.ledger
        scale = self._scale
        check: torch.Tensor | None = None
        row: torch.Tensor | None = None
        hold = False
        self._counters.last_stepped, self._counters.last_skipped = frozenset(), False
        # (loops, not comprehensions: every update of a fused optimizer's iteration)
        recorded, flags, stepped_keys, stepped = [], [], [], []
        for key, state in states.items():
            if state["found_inf_per_device"]:
                flag = self._found_flag(list(state["found_inf_per_device"].values()), scale.device)
                recorded.append(state)
                flags.append(flag)
                if state["stage"] is OptState.STEPPED:
                    stepped_keys.append(key)
                    stepped.append(flag)
        if recorded:
            found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
            skipped = ledger.zero if not stepped else stepped[0] if len(stepped) == 1 else torch.stack(stepped).sum()
            # The stepped optimizers torch's step() read (non-fused ones, with update(new_scale)) and the others.
            host_found = self._iteration.host_found
            unread, read_skips, all_read = [], 0, True
            for key in stepped_keys:
                if key in host_found:
                    read_skips += host_found[key]
                else:
                    all_read = False
                    unread.append(self._iteration.optimizers[key])
            if stepped:  # the verdict stays on the device until a read (the probe's, or fold_device_ledger),
                # unless torch's step() already read it for every optimizer stepped
                known = read_skips > 0 if all_read else None
                self._counters.last_stepped, self._counters.last_skipped = frozenset(stepped_keys), known
            check = _check_on(self._iteration.loss_check, ledger)
            # Not under torch.distributed: each rank's loss differs, and torch's back-off keeps the ranks' scales equal.
            hold = new_scale is None and self._iteration.loss_check is not None and distributed.distributed() is None
            row = ledger.record(skipped, found, check, scale, hold)
            if ledger.copies is not None:  # the optimizers host_found does not cover learn of their skips from it
                ledger.copies.add(row, hold, unread, read_skips)
                for optimizer in unread:
                    self._tell("on_step_pending", "step pending", optimizer)
            if hold:  # a non-finite loss: torch's update() sees no overflow, so the scale does not back off
                for state in recorded:
                    for found_inf in state["found_inf_per_device"].values():
                        torch.heaviside(check.to(found_inf.device, found_inf.dtype), found_inf, out=found_inf)
        self._torch_update(new_scale)
        if self._min_scale > 0 or math.isfinite(self._max_scale):
            scale.clamp_(min=self._min_scale or None, max=self._max_scale)
        self._counters.mirror_scale = None
        for listener in listeners.overriding["on_device_update"]:  # the awake ones: the host knows nothing new
            if self._counters.steps >= listener.wake_at.get(id(self._handle), 0):
                try:
                    known = listener.on_device_update(self._handle, check, hold, row)  # whether it read a skip
                except Exception as error:
                    listeners.failed(listener, "update()", error)
                    known = None
                if known is not None and self._counters.last_skipped is None:
                    self._counters.last_skipped = known
        rows = self._tell_known_rows(ledger)
        if hold and rows and rows[-1].held and ledger.rows_current:
            self._keep_scale(rows[-1].scale)  # this iteration's forward overflow, known at its own update (CPU)
        if ledger.full:
            self._fold_device_ledger()

    def _keep_scale(self, scale: float) -> None:
        """After a forward overflow's update: the scale and growth tracker as before it, as host mode keeps them.

        The hold made torch's ``update()`` count the iteration as one without
        overflow: the tracker went up by one, or wrapped to 0 and the scale grew.
        A few ops, after a failure only.
        """
        assert self._scale is not None and self._growth_tracker is not None
        tracker = self._growth_tracker
        tracker.copy_(torch.where(tracker == 0, self._growth_interval - 1, tracker - 1))
        self._scale.fill_(scale)

    def _tell_known_rows(self, ledger: DeviceLedger) -> list[KnownRow]:
        """The listeners learn the rows whose host copies are complete (no sync): forward overflows, skipped steps."""
        rows = ledger.copies.known() if ledger.copies is not None else []
        if not rows:
            return rows
        ledger.told += len(rows)
        if self._counters.last_skipped is None and ledger.rows_current:
            self._counters.last_skipped = rows[-1].skipped > 0  # the last iteration's row is known
        forward_overflows = 0
        for row in rows:  # (a loop: no generator frame)
            forward_overflows += row.forward_overflow
        self._tell_counters_read(forward_overflows, len(rows), at_read=False, current=ledger.rows_current)
        for row in rows:
            if row.found and not row.held:  # the gradients overflowed (a held row was a forward overflow)
                self._tell("on_overflow_known", "overflow known", row.scale)
            self._tell_steps(row)
        return rows

    def _tell_steps(self, row: KnownRow) -> None:
        skipped = row.unread_all_skipped  # (when only some of several fused optimizers skipped: none, said in docs)
        for optimizer in row.unread:
            self._tell("on_step_known", "step known", optimizer, skipped)

    def _tell(self, event: str, where: str, *data: Any) -> None:
        """The listeners that override ``event`` hear it, with the handle and ``data``."""
        for listener in listeners.overriding[event]:
            try:
                getattr(listener, event)(self._handle, *data)
            except Exception as error:
                listeners.failed(listener, where, error)

    def _tell_counters_read(self, forward_overflows: int, iterations: int, at_read: bool, current: bool) -> None:
        """The listeners the rows concern: all at a read of the ledger or when a forward overflow is among them,
        else the awake ones."""
        for listener in listeners.overriding["on_counters_read"]:
            if at_read or forward_overflows or self._counters.steps >= listener.wake_at.get(id(self._handle), 0):
                try:
                    listener.on_counters_read(self._handle, forward_overflows, iterations, at_read, current)
                except Exception as error:
                    listeners.failed(listener, "counters read", error)

    def _found_flag(self, found_infs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """One optimizer's found_inf flag (0 or 1) on ``device``: found_inf itself when there is one, already 0/1."""
        if len(found_infs) == 1 and self._host_mirror_exact and found_infs[0].device == device:
            return found_infs[0]  # (ShardedGradScaler all-reduces a sum over ranks: that one needs the clamp)
        return torch.stack([t.to(device, non_blocking=True) for t in found_infs]).amax().clamp(max=1.0)

    def _fold_device_ledger(self) -> None:
        """Bring the device-mode rows back to the host (one host read) and replay them."""
        ledger = self._counters.ledger
        if ledger is None or self._scale is None or self._growth_tracker is None:
            return
        rows, scale, tracker = ledger.read(self._scale, self._growth_tracker)
        self._counters.ledger = None
        if self._counters.last_skipped is None and rows:  # the last row is the last iteration's
            self._counters.last_skipped = rows[-1][0] > 0
        verdicts, alarms = ledger.verdicts(rows, scale), Alarms()
        for verdict in verdicts:  # counted as host mode counts them
            self._count(verdict, alarms)
        self._counters.mirror_scale, self._counters.mirror_tracker = scale, tracker
        self._raise_alarms(alarms)  # the collapses and stalls since the last read, even those that ended since
        if logger.isEnabledFor(logging.DEBUG):
            seen = [row[3] for row in rows] + [scale]
            logger.debug(
                "loss scale %g at step %d (range %g..%g since the last read)",
                scale,
                self._counters.steps,
                min(seen),
                max(seen),
            )
        untold = verdicts[ledger.told :]  # the rows no host copy told yet
        forward_overflows = sum(
            policy.forward_overflow(verdict.found_inf, verdict.loss_nonfinite) for verdict in untold
        )
        self._tell_counters_read(forward_overflows, len(untold), at_read=True, current=True)
        for verdict in untold:  # gradients that overflowed, not a held forward overflow
            if verdict.found_inf and not verdict.forward_overflow:
                self._tell("on_overflow_known", "overflow known", verdict.scale_before)
        if (
            ledger.copies is not None
        ):  # the steps whose copies had not landed (a GPU): told now, as they would have been
            for row in ledger.copies.settle(rows[ledger.told :]):
                self._tell_steps(row)
