"""Buffers are put back: a skipped forward overflow does not leave inf/NaN in BatchNorm's running statistics.

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
alone so that a process that never trains pays nothing). The pre-hook copies
each module's buffers before its first forward pass of that round, so an
overflow in the discovery round itself is put back too; one in the first
iteration comes before any copy, and what it left NaN/inf is reported once
(:data:`UNRESTORED`, one host read after that failure only). The copy is refreshed
and put back at any scaler's update. Each buffer is persistent (in the state
dict: running statistics are; masks and rotary tables, which no forward pass
updates, are usually registered with ``persistent=False``) and of at most
``MAX_ELEMENTS`` elements (running statistics are a few numbers per channel;
position tables and masks are larger).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from ampguard.log import event_logger
from ampguard.module_hooks import eager_only
from ampguard.syncs import read_to_host

logger = event_logger("buffers")

MAX_ELEMENTS = 1 << 16
MAX_TOTAL = 1 << 24

RESTORED = (
    "step {step} overflowed in the forward pass, which had already updated buffers such as BatchNorm's running "
    "statistics: ampguard put the {count} small buffers it guards back to their values from before that forward "
    "pass (the overflowed batch is no longer in them). Counted in stats.buffers_restored; this message is shown once."
)

RESTORED_AT_READ = (
    "a forward overflow since step {snapshot_step} (a fused optimizer: ampguard learned of it at step {step}, "
    "without a sync) left inf/NaN in buffers such as BatchNorm's running statistics: ampguard put "
    "the {count} small buffers it guards back to their values at step {snapshot_step}. "
    "Counted in stats.buffers_restored; this message is shown once."
)

UNRESTORED = (
    "{when}, before ampguard had a finite copy of the buffers it guards (it learns which modules have buffers "
    "during the second iteration of training): {values} values in {count} buffers ({names}) hold NaN/inf and could "
    "not be put back. Evaluation through them gives NaN until they are reset (BatchNorm: reset_running_stats()) or "
    "loaded from a checkpoint; training goes on. This message is shown once."
)


class BufferGuard:
    """Snapshot at each healthy update, restore after a forward overflow."""

    def __init__(self) -> None:
        self.state = "new"  # new -> discovering -> guarding
        self._handle: Any = None
        self._modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        # While discovering: each buffer's value before the first forward pass that saw it (by id(buffer)).
        self._before: dict[int, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []
        self.labels: list[str] = []  # "BatchNorm2d.running_var", per buffer
        self.snapshot: list[torch.Tensor] | None = None
        self.snapshot_step = 0
        self.restores = 0
        self._reported = False
        self._unrestored_reported = False
        self.unguarded_overflow: int | None = None  # the step of a forward overflow before discovery began

    def restart(self) -> None:
        """Guard another model: discovery starts again (the count of restores and the messages shown are kept)."""
        self.close()
        self.state = "new"
        self._modules = {}
        self._before = {}
        self.buffers = []
        self.labels = []
        self.snapshot = None
        self.unguarded_overflow = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def idle(self) -> bool:
        """Nothing to do on a healthy update: discovery is over and there is nothing to guard."""
        return self.state == "guarding" and not self.buffers

    def _note(self, module: torch.nn.Module, args: Any) -> None:
        """Discovery's pre-hook: a module with buffers, and their values before this forward pass updates them.

        Registered through :func:`eager_only`: a module called inside compiled code is not seen (dynamo would trace
        this method: torch 2.3 cannot call it there, a graph break, with ``fullgraph=True`` an error).
        """
        if module._buffers and id(module) not in self._modules:
            self._modules[id(module)] = weakref.ref(module)
            with _ordinary_tensors():  # the copy is what an overflow in this very iteration is put back to
                for _, buffer in _guardable(module):
                    self._before.setdefault(id(buffer), buffer.detach().clone())

    @property
    def discovered(self) -> bool:
        return self.state == "guarding"

    def advance(self, step: int) -> bool:
        """Discovery: watch the next iteration's module calls, then collect their buffers. True once guarding.

        The first copy is the buffers' values before that iteration's forward
        passes (taken by the pre-hook), so an overflow in that very iteration is
        put back too.
        """
        if self.state == "new":
            self.state = "discovering"
            self._handle = nn_module.register_module_forward_pre_hook(eager_only(self._note))
            return False
        if self.state == "discovering":
            self.close()
            self.state = "guarding"
            self._collect()
            self.snapshot_step = step - 1
        return True

    def on_update(self, overflow: bool, step: int, discover: bool) -> None:
        """Called by every host-mode ``update()``: snapshot (healthy) or restore (forward overflow).

        ``discover``: this update delimits discovery (the owner scaler's); the others wait for it.
        """
        if not self.discovered:
            if not discover:
                return
            if overflow and self.state == "new":  # before any copy: said once discovery knows the buffers
                self.unguarded_overflow = step
            if not self.advance(step):
                return
        if not self.buffers:
            return
        if overflow:
            if self.snapshot is not None:
                self._restore(RESTORED.format(step=step, count=len(self.buffers)))
        else:
            self.take_snapshot(step)
        if self.unguarded_overflow is not None:
            self.report_unrestored(self.unguarded_overflow)
            self.unguarded_overflow = None

    def take_snapshot(self, step: int, finite_only: bool = False) -> None:
        """Copy the buffers (one ``_foreach_copy_``); ``finite_only``: keep the copy's values where they are inf/NaN.

        ``finite_only`` is for device mode's reads, where another scaler's overflow
        not found yet may have reached the buffers (a few ops per buffer, at reads only).
        """
        if not self.buffers:
            return
        with _ordinary_tensors():
            if self.snapshot is None:
                self.snapshot = [b.detach().clone() for b in self.buffers]
            elif finite_only:
                for kept, buffer in zip(self.snapshot, self.buffers):
                    kept.copy_(
                        torch.where(torch.isfinite(buffer), buffer, kept) if buffer.is_floating_point() else buffer
                    )
            else:
                torch._foreach_copy_(self.snapshot, self.buffers)
        self.snapshot_step = step

    def on_stats_read(self, overflowed: bool, step: int, finite_only: bool = True) -> None:
        """Device mode, at each read of the scaler's device-side counters (a failure found costs one read here).

        ``overflowed``: a forward overflow happened since the previous read. If a
        buffer that was finite in the copy from that read is no longer finite, all
        the buffers get the copy back (one read, after a failure only); then the
        copy is refreshed where the buffers are finite (another scaler's overflow,
        not found yet, may have reached them). Buffers inf/NaN by design
        (a ``-inf`` mask) are so in the copy too, and do not count. Buffers an
        overflow reached before the first copy was taken hold NaN/inf in the
        copy as well: they cannot be put back, and are reported once.
        """
        if not self.discovered or not self.buffers:
            return
        if overflowed and self.snapshot is not None:
            damage = _damage_each(self.buffers + self.snapshot)
            now, before = damage[: len(self.buffers)], damage[len(self.buffers) :]
            if any(was_finite and not is_finite for (is_finite, _), (was_finite, _) in zip(now, before)):
                message = RESTORED_AT_READ.format(snapshot_step=self.snapshot_step, step=step, count=len(self.buffers))
                self._restore(message)  # all of them: an overflowing batch leaves finite statistics skewed too
                now = before
            self._report_once_unrestored(
                f"a forward overflow since step {self.snapshot_step} (found at the read of step {step})",
                [values for _, values in now],
            )
        self.take_snapshot(step, finite_only=finite_only)

    def report_unrestored(self, step: int) -> None:
        """After a forward overflow no copy covered: which buffers hold NaN/inf now (one read, once)."""
        if self.buffers and not self._unrestored_reported:
            damage = _damage_each(self.buffers)
            self._report_once_unrestored(
                f"step {step} overflowed in the forward pass", [values for _, values in damage]
            )

    def _report_once_unrestored(self, when: str, values: list[int]) -> None:
        damaged = [label for label, count in zip(self.labels, values) if count]
        if not damaged or self._unrestored_reported:
            return
        self._unrestored_reported = True
        names = ", ".join(dict.fromkeys(damaged[:4])) + (", ..." if len(damaged) > 4 else "")
        logger.warning(UNRESTORED.format(when=when, values=f"{sum(values):,}", count=len(damaged), names=names))

    def _collect(self) -> None:
        """The buffers of the modules discovery saw, with their first copy (from before that iteration's forward)."""
        found: dict[int, tuple[torch.Tensor, str]] = {}
        total = 0
        for ref in self._modules.values():
            module = ref()
            if module is None:
                continue
            for name, buffer in _guardable(module):
                if id(buffer) in found:
                    continue
                if total + buffer.numel() > MAX_TOTAL:
                    break
                found[id(buffer)] = (buffer, f"{type(module).__name__}.{name}")
                total += buffer.numel()
        self.buffers = [buffer for buffer, _ in found.values()]
        self.labels = [label for _, label in found.values()]
        # A buffer without a copy from before (one the module was given after its first call) starts from its value now.
        with _ordinary_tensors():
            self.snapshot = [
                self._before[key] if key in self._before else buffer.detach().clone()
                for key, (buffer, _) in found.items()
            ]
        self._modules, self._before = {}, {}

    def _restore(self, message: str) -> None:
        assert self.snapshot is not None
        with _ordinary_tensors():
            torch._foreach_copy_(self.buffers, self.snapshot)
        self.restores += 1
        if not self._reported:
            self._reported = True
            logger.warning(message)


def _ordinary_tensors() -> contextlib.ExitStack:
    """No autograd, and not inference mode: copies taken inside ``torch.inference_mode()`` (a teacher, an
    evaluation) would be inference tensors, which a later in-place refresh outside it may not write."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _guardable(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers of ``module`` that are state a forward pass may update: persistent, dense, small."""
    derived = getattr(module, "_non_persistent_buffers_set", ())
    for name, buffer in module._buffers.items():
        # Not persistent: not state (masks, rotary tables), a forward pass does not update it.
        if buffer is not None and name not in derived and not buffer.is_sparse and buffer.numel() <= MAX_ELEMENTS:
            yield name, buffer


def _damage_each(tensors: list[torch.Tensor]) -> list[tuple[bool, int]]:
    """For each tensor, in one host read: whether it is all finite, and how many values are NaN or +inf.

    -inf is not counted as damage: a persistent mask holds it by design. Integer tensors: (True, 0).
    """
    checks = [
        torch.stack([torch.isfinite(t).all().float(), (torch.isnan(t) | (t == float("inf"))).sum().float()])
        for t in tensors
        if t.is_floating_point()
    ]
    values = iter(read_to_host(torch.stack(checks)) if checks else [])
    found: list[tuple[bool, int]] = []
    for t in tensors:
        finite, damaged = next(values) if t.is_floating_point() else (True, 0)
        found.append((bool(finite), int(damaged)))
    return found
