"""Patch ``fp32_islands``: a module that overflows float16 in the forward pass is found and run in float32.

It changes nothing in torch until a loss is inf/NaN: applying it registers an
:class:`IslandsListener` holding the healing made from the configuration
(:class:`~ampguard.fp32_islands.healing.Healing`), through which every
SafeGradScaler calls it (:mod:`ampguard.scaler.listeners`); :func:`applied_healing`
finds it for others (``ampguard bench``). From the first forward overflow on, the probe
(:mod:`ampguard.fp32_islands.probe`) watches the following forward passes, the module it
names becomes an fp32 island (:mod:`ampguard.fp32_islands.islands`), and buffers the
overflowed forward pass updated are put back (:mod:`ampguard.fp32_islands.buffers`).
Reverting removes every hook the probe, the islands and the buffer guard hold.
docs/islands.md describes it.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

import ampguard.fp32_islands.compiled_islands as compiled_islands
import ampguard.fp32_islands.iteration_ends as iteration_ends
import ampguard.scaler.listeners as listeners
import ampguard.torch_privates as torch_privates
from ampguard.config import Config
from ampguard.fp32_islands.healing import Healing
from ampguard.fp32_islands.portable import without_our_hooks
from ampguard.fp32_islands.probe import VERDICT_BITS
from ampguard.patch import Patch

if TYPE_CHECKING:
    from ampguard.scaler.handle import ScalerHandle
    from ampguard.scaler.verdict import StepVerdict

# Island names qualified from the top-level module; a checkpoint without this entry has names relative to the
# outermost module called (ampguard.fp32_islands.checkpoint_islands finds those by the end of their full name).
ISLAND_NAMES_KEY = "fp32_islands_named_from"
ISLAND_NAMES_FULL = "top-level module"


def engaged(state: Healing) -> bool:
    """Whether every iteration concerns the healing ``state`` now: the probe watches, the headroom watch is busy or
    due, buffers are discovered or guarded, islands are being restored, or the scaler buffer discovery followed
    was freed (the next one heard takes over)."""
    owner = state.buffers_owner
    handover = owner is not None and owner() is None
    restoring = state.islands.checkpoint.restoring()
    return bool(state.probe.armed or state.watch.busy() or not state.buffers.idle() or restoring or handover)


class IslandsListener(listeners.StepListener):
    """The scaler's steps, as the healing hears them: the probe's verdict rides on the scaler's read."""

    name = "fp32 islands"
    read_bits = VERDICT_BITS

    def __init__(self, config: Config) -> None:
        super().__init__()
        # The healing while the patch is applied; None once reverted (a call still under way then does nothing).
        self.healing: Healing | None = Healing.from_config(config, on_engaged=self.engage)

    def close(self) -> None:
        """The patch is reverted: the healing removes every hook it holds."""
        healing, self.healing = self.healing, None
        if healing is not None:
            healing.close()

    def add_to_read(self, handle: ScalerHandle, code: torch.Tensor, shift: int) -> torch.Tensor:
        return self.healing.add_verdict(code, float(2**shift)) if self.healing is not None else code

    def on_update(self, handle: ScalerHandle, verdict: StepVerdict, field: int) -> None:
        healing = self.healing
        if healing is None:
            return self.rest(handle)
        healing.note_verdict(field)
        try:
            iteration_ends.end_iteration(healing, handle, verdict.forward_overflow)
        finally:
            self.rest(handle)

    def on_device_update(
        self, handle: ScalerHandle, check: torch.Tensor | None, held: bool, row: torch.Tensor | None
    ) -> bool | None:
        try:
            if self.healing is None:
                return None
            return iteration_ends.end_device_iteration(self.healing, handle, check, held=held, row=row)
        finally:
            self.rest(handle)

    def on_counters_read(
        self, handle: ScalerHandle, forward_overflows: int, iterations: int, at_read: bool, current: bool
    ) -> None:
        try:
            if self.healing is not None:
                iteration_ends.after_stats_read(self.healing, handle, forward_overflows, iterations, at_read, current)
        finally:
            self.rest(handle)

    def rest(self, handle: ScalerHandle) -> None:
        """Hear every read and update while the healing is engaged; else the healthy updates of ``handle``'s scaler from the
        step its next headroom watch is due, and no read."""
        key = id(handle)
        if key not in self.wake_at:
            weakref.finalize(handle, self.wake_at.pop, key, None)
        state = self.healing
        if state is not None and engaged(state):
            self.engage()
        else:
            self.wake_at[key] = state.watch.next_due(handle) if state is not None else sys.maxsize
            listeners.unsubscribe(self, "read")

    def engage(self) -> None:
        """The next read and update of every scaler concern the healing (told between updates)."""
        self.wake_at.clear()
        listeners.subscribe(self, "read")

    def on_foreign_step(self, owner: Any, forward_overflow: bool) -> None:
        if self.healing is not None:
            iteration_ends.end_foreign_step(self.healing, owner, forward_overflow)

    def stats_fields(self, handle: ScalerHandle) -> dict[str, Any]:
        state = self.healing
        last = state.watch.last if state is not None else None
        return {
            "fp32_islands": state.islands.names() if state is not None else (),
            "buffers_restored": state.buffers.restores if state is not None else 0,
            "headroom": last.tightest() if last is not None else (),
        }

    def save(self, handle: ScalerHandle | Any) -> dict[str, Any]:
        state = self.healing
        names = list(state.islands.names()) if state is not None else []  # plain strings
        entries: dict[str, Any] = {"fp32_islands": names}
        # each island's output dtypes under autocast, given again after a resume
        outputs = state.islands.recorded_outputs() if state is not None else {}
        if outputs:
            entries["fp32_island_outputs"] = outputs
        if names:  # qualified from the top-level module (earlier: from the one called)
            entries[ISLAND_NAMES_KEY] = ISLAND_NAMES_FULL
        return entries

    def load(self, handle: ScalerHandle | Any, entries: dict[str, Any]) -> None:
        """A checkpoint's islands (and output dtypes): re-applied at the next forward, in auto mode.

        Their names are qualified from the top-level module (checkpoints since that
        naming), or else relative to the outermost module called then.
        """
        self.wake_at.pop(id(handle), None)  # its steps may go back (a rollback): the schedule is found again
        state, names = self.healing, entries.get("fp32_islands")
        if state is not None and state.mode == "auto" and names:
            full_names = entries.get(ISLAND_NAMES_KEY) == ISLAND_NAMES_FULL
            state.islands.checkpoint.restore(names, entries.get("fp32_island_outputs"), full_names=full_names)


class Fp32IslandsPatch(Patch):
    name = "fp32_islands"
    summary = (
        "a forward overflow keeps the loss scale, restores BatchNorm statistics, and the module that "
        "overflowed is found and run in fp32"
    )
    requires_torch = ">=2.3"
    requires_privates = torch_privates.FP32_ISLANDS

    def __init__(self) -> None:
        super().__init__()
        self.listener: IslandsListener | None = None  # while applied: it holds the healing

    @property
    def healing(self) -> Healing | None:
        """The healing while the patch is applied (its probe, watch, buffers, inputs, mode)."""
        return self.listener.healing if self.listener is not None else None

    def apply(self, config: Config) -> None:
        self.listener = IslandsListener(config)
        listeners.add(self.listener)
        # A model saved, scripted or exported comes out without ampguard's hooks (portable.py).
        self.bindings.set_attribute(torch, "save", without_our_hooks(torch.save))
        self.bindings.set_attribute(torch.jit, "script", without_our_hooks(torch.jit.script))
        # islands are left out of compiled code: say so when it is compiled
        self.bindings.set_attribute(torch, "compile", compiled_islands.naming_islands(torch.compile, self))
        export = getattr(torch, "export", None)  # (torch.export.export: torch >= 2.1)
        if export is not None and hasattr(export, "export"):
            self.bindings.set_attribute(export, "export", without_our_hooks(export.export))

    def revert(self) -> None:
        if self.listener is not None:
            listeners.remove(self.listener)
            self.listener.close()
            self.listener = None
        super().revert()


def applied_healing() -> Healing | None:
    """The healing of the applied fp32_islands patch (found through the registry); None when it is not applied."""
    from ampguard.registry import applied_patch  # (the registry imports the patches)

    patch = applied_patch(Fp32IslandsPatch.name)
    return patch.healing if isinstance(patch, Fp32IslandsPatch) else None
