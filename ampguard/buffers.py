"""Buffers stay finite: a skipped forward overflow does not leave inf/NaN in BatchNorm's running statistics.

A forward pass updates some buffers in place (BatchNorm's ``running_mean``,
``running_var``, ``num_batches_tracked``). When the loss of that forward pass
was inf/NaN the optimizer step is skipped, but the buffers already took the
overflowed batch in, for good: evaluation then produces NaN whatever happens
to the weights. :class:`BufferGuard` keeps a copy of the model's small
buffers, refreshed at each healthy ``update()`` with one ``torch._foreach_copy_``
(no host read), and copies it back after an update whose loss was non-finite.

With a fused optimizer (the scaler's device mode) the host does not learn at
``update()`` whether the loss was finite: the copy is refreshed at each read of
the device-side counters (a stats line, ``scaler.stats``, a checkpoint) instead,
and a read that finds a forward overflow since the previous one, and a buffer
that was finite in the earlier copy no longer finite, puts back that copy
(:meth:`BufferGuard.on_stats_read`).

Which buffers: those of the modules called between the first and second
updates of the first scaler (one round of the training loop, every model it
trains; a later scaler takes over once the one before it was freed, as in a
process that trains one model after another), found by a global forward
pre-hook that removes itself after that round (the first iteration is left
alone so that a process that never trains pays nothing). The copy is refreshed
and put back at any scaler's update. Each buffer is persistent (in the state
dict: running statistics are; masks and rotary tables, which no forward pass
updates, are usually registered with ``persistent=False``) and of at most
``MAX_ELEMENTS`` elements (running statistics are a few numbers per channel;
position tables and masks are larger).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from ampguard.log import event_logger
from ampguard.syncs import read_to_host

logger = event_logger("buffers")

MAX_ELEMENTS = 1 << 16
MAX_TOTAL = 1 << 24

RESTORED = (
    "step {step} overflowed in the forward pass, which had already updated buffers such as BatchNorm's running "
    "statistics: ampguard put the {count} small buffers it guards back to their values from before that forward "
    "pass, so evaluation stays finite. Counted in stats.buffers_restored; this message is shown once."
)

RESTORED_AT_READ = (
    "a forward overflow since step {snapshot_step} (a fused optimizer: ampguard learns of it when it reads its "
    "counters, here at step {step}) left inf/NaN in buffers such as BatchNorm's running statistics: ampguard put "
    "the {count} small buffers it guards back to their values at step {snapshot_step}, so evaluation stays finite. "
    "Counted in stats.buffers_restored; this message is shown once."
)


class BufferGuard:
    """Snapshot at each healthy update, restore after a forward overflow."""

    def __init__(self) -> None:
        self.state = "new"  # new -> discovering -> guarding
        self._handle: Any = None
        self._modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        self.buffers: list[torch.Tensor] = []
        self.snapshot: list[torch.Tensor] | None = None
        self.snapshot_step = 0
        self.restores = 0
        self._reported = False

    def restart(self) -> None:
        """Guard another model: discovery starts again (the count of restores and the messages shown are kept)."""
        self.close()
        self.state = "new"
        self._modules = {}
        self.buffers = []
        self.snapshot = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def idle(self) -> bool:
        """Nothing to do on a healthy update: discovery is over and there is nothing to guard."""
        return self.state == "guarding" and not self.buffers

    def _note(self, module: torch.nn.Module, args: Any) -> None:
        if module._buffers and id(module) not in self._modules:
            self._modules[id(module)] = weakref.ref(module)

    @property
    def discovered(self) -> bool:
        return self.state == "guarding"

    def advance(self) -> bool:
        """Discovery: watch the next iteration's module calls, then collect their buffers. True once guarding."""
        if self.state == "new":
            self.state = "discovering"
            self._handle = nn_module.register_module_forward_pre_hook(self._note)
            return False
        if self.state == "discovering":
            self.close()
            self.state = "guarding"
            self.buffers = self._collect()
        return True

    def on_update(self, overflow: bool, step: int, discover: bool) -> None:
        """Called by every host-mode ``update()``: snapshot (healthy) or restore (forward overflow).

        ``discover``: this update delimits discovery (the owner scaler's); the others wait for it.
        """
        if not (self.discovered or (discover and self.advance())) or not self.buffers:
            return
        if overflow:
            if self.snapshot is not None:
                self._restore(RESTORED.format(step=step, count=len(self.buffers)))
            return
        self.take_snapshot(step)

    def take_snapshot(self, step: int, finite_only: bool = False) -> None:
        """Copy the buffers (one ``_foreach_copy_``); ``finite_only``: keep the copy's values where they are inf/NaN.

        ``finite_only`` is for device mode's reads, where another scaler's overflow
        not found yet may have reached the buffers (a few ops per buffer, at reads only).
        """
        if not self.buffers:
            return
        if self.snapshot is None:
            self.snapshot = [b.detach().clone() for b in self.buffers]
        elif finite_only:
            with torch.no_grad():
                for kept, buffer in zip(self.snapshot, self.buffers):
                    kept.copy_(
                        torch.where(torch.isfinite(buffer), buffer, kept) if buffer.is_floating_point() else buffer
                    )
        else:
            torch._foreach_copy_(self.snapshot, self.buffers)
        self.snapshot_step = step

    def on_stats_read(self, overflowed: bool, step: int) -> None:
        """Device mode, at each read of the scaler's device-side counters (a failure found costs one read here).

        ``overflowed``: a forward overflow happened since the previous read. If a
        buffer that was finite in the copy from that read is no longer finite, all
        the buffers get the copy back (one read, after a failure only); then the
        copy is refreshed where the buffers are finite (another scaler's overflow,
        not found yet, may have reached them). Buffers inf/NaN by design
        (a ``-inf`` mask) are so in the copy too, and do not count; nor, alike,
        buffers an overflow reached before the first copy was taken.
        """
        if not self.discovered or not self.buffers:
            return
        if overflowed and self.snapshot is not None:
            finite = _finite_each(self.buffers + self.snapshot)
            now, before = finite[: len(self.buffers)], finite[len(self.buffers) :]
            if any(was and not is_ for is_, was in zip(now, before)):
                message = RESTORED_AT_READ.format(snapshot_step=self.snapshot_step, step=step, count=len(self.buffers))
                self._restore(message)  # all of them: an overflowing batch leaves finite statistics skewed too
        self.take_snapshot(step, finite_only=True)

    def _collect(self) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        total = 0
        for ref in self._modules.values():
            module = ref()
            if module is None:
                continue
            derived = getattr(module, "_non_persistent_buffers_set", ())
            for name, buffer in module._buffers.items():
                if buffer is None or id(buffer) in found or buffer.numel() > MAX_ELEMENTS or buffer.is_sparse:
                    continue
                if name in derived:  # not state (masks, rotary tables): a forward pass does not update it
                    continue
                if total + buffer.numel() > MAX_TOTAL:
                    break
                found[id(buffer)] = buffer
                total += buffer.numel()
        self._modules = {}
        return list(found.values())

    def _restore(self, message: str) -> None:
        assert self.snapshot is not None
        with torch.no_grad():
            torch._foreach_copy_(self.buffers, self.snapshot)
        self.restores += 1
        if not self._reported:
            self._reported = True
            logger.warning(message)


def _finite_each(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor, whether it holds finite values only (integer tensors: True), in one host read."""
    checks = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    values = iter(read_to_host(torch.stack(checks)) if checks else [])
    return [bool(next(values)) if t.is_floating_point() else True for t in tensors]
