"""After a forward overflow: what SafeGradScaler hands over when a loss was itself inf/NaN.

A forward overflow (the loss passed to ``scale()`` was inf/NaN) is not the scale's doing: the scaler skips and
counts the step without backing off. A run without non-finite losses is untouched, bit-identical to torch's.

With the ``fp32_islands`` patch applied, its listener holds one :class:`Healing`, and a forward overflow also

* tells bad data from a module's overflow by the kept inputs (:mod:`~ampguard.fp32_islands.model_inputs`),
  and runs the forward again under the probe (:mod:`~ampguard.fp32_islands.rerun`);
* restores the small buffers the forward pass updated (:mod:`ampguard.fp32_islands.buffers`);
* else arms the probe (:mod:`ampguard.fp32_islands.probe`) for the following forward passes; its verdict rides
  on the scaler's one host read (:meth:`Healing.add_verdict`, :meth:`Healing.note_verdict`) and names the module
  at the next forward overflow; it disarms after ``AMPGUARD_PROBE_STEPS`` steps without one;
* makes that module an fp32 island, or reports why not (:mod:`ampguard.fp32_islands.islands`).

Every ``AMPGUARD_WATCH_EVERY`` steps the headroom watch (:mod:`ampguard.headroom_watch`) sees one iteration's
float16 peaks; its verdict rides on the same read (never while the probe is armed) and makes an island before an
overflow, or names the module at the first one (:mod:`ampguard.fp32_islands.watch_verdicts`). Device mode reads
nothing on a healthy step; ranks all-reduce their verdicts on skipped steps only (docs/islands.md). What happens
at the end of each update, host mode and device mode, is :mod:`ampguard.fp32_islands.iteration_ends`.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import ampguard.fp32_islands.model_inputs as model_inputs
import ampguard.fp32_islands.rerun as rerun
import ampguard.fp32_islands.watch_verdicts as watch_verdicts
import ampguard.messages as messages
from ampguard.fp32_islands.back_off import BackOff
from ampguard.fp32_islands.buffers import BufferGuard
from ampguard.fp32_islands.islands import Islands
from ampguard.fp32_islands.model_inputs import ModelInputs
from ampguard.fp32_islands.probe import Probe
from ampguard.headroom_watch.watch import HeadroomWatch
from ampguard.log import event_logger

logger = event_logger("island")

if TYPE_CHECKING:
    from ampguard.config import Config
    from ampguard.scaler.handle import ScalerHandle


@dataclass
class Healing:
    """The healing's state while the patch is applied (its probe, watch, buffers, inputs, mode), and its decisions."""

    mode: str
    max_islands: int
    probe_steps: int
    islands: Islands  # the islands made (and reported) while the patch is applied
    watch: HeadroomWatch  # it passes over those islands
    rerun: bool = True  # a forward overflow's forward passes run again under the probe (rerun.py)
    probe: Probe = field(default_factory=Probe)
    buffers: BufferGuard = field(default_factory=BufferGuard)
    inputs: ModelInputs = field(default_factory=ModelInputs)  # to tell a batch holding inf/NaN from a module
    verdict: int = 0  # the probe's verdict decoded from this iteration's read
    quiet_steps: int = 0
    exhausted: bool = False
    warned: set[str] = field(default_factory=set)
    # Per scaler, keyed by its handle: forward overflows device mode already saw at an update (the probe watching)
    # since its last read.
    seen_in_device_mode: weakref.WeakKeyDictionary[ScalerHandle, int] = field(default_factory=weakref.WeakKeyDictionary)
    # The scale whose updates delimit buffer discovery (a weak reference to a scaler's handle, or to DeepSpeed's
    # counts).
    buffers_owner: Any = None
    back_off: BackOff = field(default_factory=BackOff)  # while verdicts make no island
    # Armed since the last update: if the probe recorded no module call, it did not see that iteration's forward
    # pass (armed by a read after it, in device mode) and has nothing to judge.
    armed_since_update: bool = False
    stopped: bool = False  # after an error inside ampguard: the probe does not arm again
    on_engaged: Callable[[], None] | None = None  # told when the healing is engaged between updates

    @classmethod
    def from_config(cls, config: Config, on_engaged: Callable[[], None] | None = None) -> Healing:
        """Heal from now on; ``on_engaged()`` is told when it is engaged between updates (bench, a freed owner)."""
        islands = Islands()
        watch = HeadroomWatch(config.watch_every, config.headroom, islands)
        limits = (config.fp32_islands, config.max_islands, config.probe_steps)
        return cls(*limits, islands, watch, rerun=config.forward_rerun, on_engaged=on_engaged)

    def close(self) -> None:
        """The patch is reverted: every hook the probe, the watch, the buffers, the inputs and the islands hold."""
        self.probe.disarm()
        self.watch.stop()
        self.buffers.close()
        self.inputs.close()
        model_inputs.strip_everywhere()
        self.islands.clear()

    def watch_next_iteration(self) -> bool:
        """Have the headroom watch observe the next iteration, off its schedule (for ``ampguard bench``).

        False when there is nothing to do it with: the watch is switched off
        (``AMPGUARD_WATCH_EVERY=0``), stopped, or busy with a watch.
        """
        if not self.watch.every or not self.may_watch():
            return False
        watching = self.watch.watch_next(0)
        if watching and self.on_engaged is not None:
            self.on_engaged()
        return watching

    # -- the scaler's one read -------------------------------------------------------------

    def add_verdict(self, code: torch.Tensor, weight: float) -> torch.Tensor:
        """``code`` plus ``weight * verdict`` while the probe is armed or the watch watched; ``code`` itself
        otherwise."""
        if self.probe.armed:
            return self.probe.add_to(code, weight)
        return self.watch.add_to(code, weight) if self.watch.busy() else code

    def note_verdict(self, verdict: int) -> None:
        """The verdict as the host read it (the largest of the iteration's reads, on any rank): the probe's, or the
        headroom watch's."""
        if verdict:
            self.verdict = max(self.verdict, verdict)

    # -- the probe ---------------------------------------------------------------------------

    def found_again(self, step: int, collective: bool = False) -> bool | None:
        """At a forward overflow: its forward passes run again under the probe (rerun.py).

        True when a module was named (its island decided), False when they ran and no
        module turned finite inputs into inf/NaN (the loss, the data), None when they
        were not run. Not while the probe watches (its verdict is this iteration's) or may not arm.
        """
        if not self.rerun or self.probe.armed or self.exhausted or self.stopped or self.back_off.skip_arming:
            return None
        try:
            call, reason = rerun.find(self.inputs.last_passes(), self.probe, collective)
        except Exception as error:  # never the reason a run dies
            self.stop("rerun", error)
            return None
        if reason is not None:
            self._say_once(f"rerun {reason.split(':')[0]}", messages.NOT_RUN_AGAIN.format(step=step, reason=reason))
        if call is None:
            return None if reason is not None else False
        again = self.islands.holds(call[0])  # an island that overflows in float32 too
        self.islands.settle_blame(call[0], call[1], step)
        made = self.islands.decide(*call, step=step, mode=self.mode, max_islands=self.max_islands)
        self.after_verdict(made_island=made, conclusive=again)
        return True

    def may_arm(self) -> bool:
        """Whether the probe may arm at this forward overflow (no island limit reached or error, no back-off
        pending)."""
        return not (self.exhausted or self.stopped) and self.back_off.may_arm()

    def arm(self) -> None:
        self.probe.arm()
        self.quiet_steps = 0
        self.armed_since_update = True

    def after_verdict(self, made_island: bool, conclusive: bool = False) -> None:
        """After a verdict (a module named, or none): the probe backs off while verdicts keep making no island."""
        if self.back_off.after_verdict(made_island, conclusive):
            self.probe.disarm()
        self._note_limit()

    def _note_limit(self) -> None:
        self.exhausted = "(limit)" in self.islands.reported or len(self.islands.reported) >= self.max_islands

    # -- the headroom watch -----------------------------------------------------------------

    def may_watch(self) -> bool:
        return not (self.probe.armed or self.exhausted or self.stopped)

    def keep_inputs(self) -> None:
        if self.watch.last is not None:  # the models the watch saw keep their inputs
            self.inputs.follow_safely(self.watch.last.roots())

    def judge_watch(
        self, step: int, overflow: bool, verdict: int, may_blame: bool = True, watched: bool | None = None
    ) -> bool:
        """The watch's part of an update (:func:`ampguard.fp32_islands.watch_verdicts.judge`): True when it blamed.

        ``may_blame``: False when the overflow was a batch holding inf/NaN (no module is blamed for it).
        """
        if self.watch.pending is not None:
            self.verdict = 0  # the verdict read was the watch's
        try:
            may_blame = may_blame and self.may_watch()
            watch, mode, limit = self.watch, self.mode, self.max_islands
            return watch_verdicts.judge(self.islands, watch, step, overflow, verdict, mode, limit, may_blame, watched)
        except Exception as error:  # never the reason a run dies
            self.stop("watch", error)
            return False
        finally:
            self._note_limit()
            self.keep_inputs()

    # -- the scalers heard ---------------------------------------------------------------------

    def follow(self, heard: ScalerHandle | Any) -> bool:
        """Whether the scale ``heard`` delimits buffer discovery: the first heard, or a later one once the one
        before is freed. ``heard``: a SafeGradScaler's handle, or DeepSpeed's counts (a foreign step).

        Discovery watches the module calls between two of its updates (one round of
        the training loop, every model it trains); the buffers found are then put
        back after any scaler's forward overflow.
        """
        owner = self.buffers_owner() if self.buffers_owner is not None else None
        if owner is not None:
            return owner is heard
        if self.buffers_owner is not None:  # the scaler before was freed: another model trains now
            self.buffers.restart()
            self.probe.disarm()  # it watched for the model before
            self.back_off.reset()  # the probe backed off for the model before, not this one
            self.watch.restart()  # what the watch saw was the model before; this one is watched at its 2nd step
        # Freed, it hands discovery to the next scaler heard: which must then be heard at once, healthy or not.
        self.buffers_owner = weakref.ref(heard, self._owner_freed)
        return True

    def _owner_freed(self, _: weakref.ref[Any]) -> None:
        """The scaler buffer discovery followed was freed: the listener is engaged, the next scaler heard takes over.
        Not at interpreter exit, where the scaler goes with the modules that would hear it."""
        if self.on_engaged is not None and not sys.is_finalizing():
            self.on_engaged()

    # -- errors and reports ----------------------------------------------------------------------

    def stop(self, where: str, error: Exception) -> None:
        """After an error inside ampguard: the probe disarms for good (arming it again would fail again, unseen)."""
        self.probe.disarm()
        self.stopped = True
        self.warn_once(where, messages.PROBE_STOPPED, error)

    def warn_once(self, key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.log(level, message, *args)

    def _say_once(self, key: str, message: str) -> None:
        self.warn_once(key, "%s", message, level=logging.INFO)
