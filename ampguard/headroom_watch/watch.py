"""The headroom watch: how close each module's float16 tensors come to 65,504, seen before they overflow.

Every ``AMPGUARD_WATCH_EVERY`` optimizer steps, one iteration's forward passes
are observed (:class:`HeadroomWatch` schedules them): two global module hooks
(:class:`~ampguard.headroom_watch.watched_pass.WatchedPass`) keep the stack of
module calls, and while the model runs a ``TorchDispatchMode``
(:mod:`ampguard.headroom_watch.observer`) sees every aten op's output, so the
intermediates no module returns are seen too (the attention logits
``q @ k.T`` inside an attention's ``forward``). Each float16 output's minimum
and maximum (one ``aminmax`` on the device) is attributed to the innermost
module running. Nothing is read on the host during the pass.

At the end of the iteration (the scaler's ``step()``) the samples become a
:class:`~ampguard.headroom_watch.sighting.Sighting`: one float32 peak per
module on the device, and the verdict, which rides on the scaler's one host
read, as the probe's does (the two never run in the same iteration);
:mod:`ampguard.fp32_islands.watch_verdicts` makes the island. The root module
(the outermost module called) and islands are not candidates; a module named in report mode is measured but
not named again (the verdict goes to the next one auto mode would make an island).

Where it cannot look, the watch steps aside and says so once (INFO): compiled
code (a compiled model is not watched; a compiled submodule is not watched
inside), higher-order operators, memory no op wrote (the observer's docstring),
module calls in other threads than the one that trains. A watched forward
that a ``KeyboardInterrupt`` ends (no hook of torch's runs then) is found at
the next module call (:mod:`ampguard.headroom_watch.calls`): the watch ends
there, and what runs next runs as under torch.

The mode is entered with the model (the root, or the module inside a DDP /
FSDP / ... wrapper: :func:`~ampguard.fp32_islands.probe.unwrap`) and left with
it, so a wrapper's own code runs outside it: every tensor an op makes under a
Python dispatch mode gets a Python object, and a DDP wrapper's forward
rebuilds its gradient buckets at the second iteration (the one watched); a
gloo worker thread freeing such a bucket at exit hung the job on torch < 2.8
(docs/distributed.md).
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING

import torch

from ampguard.headroom_watch.observer import Observer
from ampguard.headroom_watch.sighting import FLOAT16_MAX, Candidate, Sighting, summarise
from ampguard.headroom_watch.watched_pass import IslandsSeen, WatchedPass
from ampguard.log import event_logger

if TYPE_CHECKING:
    from ampguard.scaler.handle import ScalerHandle

logger = event_logger("island")

# At a forward overflow with no warning, the module the last watch saw closest is blamed at once when its peak was
# within this factor of float16's limit (6 bits: 1,024 and up). An input 8x louder than usual multiplies attention
# logits (a product of two projections of it) by 64: a module that far from the limit can overflow on one batch;
# healthy activations (normalised, a few units to a few hundred) stay below it.
BLAME_BOUND = 64.0


class HeadroomWatch:
    """Every ``every`` optimizer steps, the largest float16 magnitude inside each module, on the device.

    ``headroom``: a module whose peak reaches ``65504 / headroom`` gets the verdict. The schedule, the sightings
    and the blame are here; the module calls of a watched iteration are :class:`WatchedPass`'s.
    """

    def __init__(self, every: int, headroom: float, islands: IslandsSeen) -> None:
        self.every = every if Observer is not None else 0
        self.limit = FLOAT16_MAX / headroom
        self.headroom = headroom
        self.islands = islands
        self._pass = WatchedPass(self.fail, islands)
        self._watched_step = 0
        self.broken = False  # after an error: no more watching
        self._due = False  # the second iteration is watched, then one every ``every`` optimizer steps
        # Per scaler, keyed by its handle: the last ``(step - 1) // every`` seen at its update (each model is
        # watched at its 2nd step).
        self._periods: weakref.WeakKeyDictionary[ScalerHandle, int] = weakref.WeakKeyDictionary()
        self.pending: Sighting | None = None  # finished, its verdict not decoded yet
        self.in_read = False  # the pending verdict rode on this iteration's read
        self.last: Sighting | None = None  # the last sighting whose iteration did not overflow

    @property
    def watching(self) -> bool:
        return self._pass.armed

    def busy(self) -> bool:
        """Whether the update must look at the watch (it watches, or a verdict waits, or a watch is due)."""
        return self._due or self._pass.armed or self.pending is not None

    # -- the schedule ------------------------------------------------------------------------------

    def after_update(self, step: int, may_watch: bool, handle: ScalerHandle | None = None) -> None:
        """At the end of an update of ``handle``'s scaler: arm for the next iteration when due (``may_watch``: the
        probe is not armed)."""
        # Due at the first update of each period of ``every`` optimizer steps: with several optimizers per
        # iteration the step count moves by more than one per update, so "step % every == 1" could never hold.
        if self.every and handle is not None and (step - 1) // self.every != self._periods.get(handle, -1):
            self._periods[handle] = (step - 1) // self.every
            self._due = True
        if self._due and may_watch and not self._pass.armed and self.pending is None:
            self._due = False
            self._watched_step = step + 1
            self._pass.begin()

    def next_due(self, handle: ScalerHandle) -> int:
        """The optimizer steps of ``handle``'s scaler at whose update a watch is next due (0: its next update; a very
        large number: never, the watch off)."""
        if not self.every:
            return sys.maxsize
        period = self._periods.get(handle)
        return 0 if period is None else (period + 1) * self.every + 1

    def restart(self) -> None:
        """Another model trains now (the scaler before was freed): forget the last sighting, watch its 2nd step."""
        self.last = None

    def watch_next(self, step: int) -> bool:
        """Watch the next iteration now, off the schedule (``ampguard bench`` times a watched step this way)."""
        if self._pass.armed or self.pending is not None:
            return False
        self._watched_step = step + 1
        self._pass.begin()
        return True

    def stop(self) -> None:
        """Remove the hooks and forget the pass (uninstall, an error, the probe arming)."""
        self._pass.end()
        self.pending = None
        self.in_read = False

    # -- the end of the watched iteration ---------------------------------------------------------

    def finish(self) -> Sighting | None:
        """Stop watching; the pass's peaks and verdict, on the device (no read). None: nothing was seen, or this
        thread is not the one watched (threads training at once: the watch and its verdict are its thread's)."""
        if not self._pass.owned_here():
            return None
        sampled = self._pass.end()
        if not sampled or self.broken:
            return None
        try:
            self.pending = summarise(
                [watched.samples for watched in sampled],
                [(watched.module, watched.root) for watched in sampled],
                [watched.outputs for watched in sampled],
                self.limit,
                self._watched_step,
                [not watched.named for watched in sampled],
            )
        except Exception as error:  # never the reason a run dies
            self.fail(error)
        return self.pending

    def fail(self, error: Exception) -> None:
        """After an error inside the watch: it stops for good, with one WARNING; training goes on without it."""
        if not self.broken:
            self.broken = True
            self._pass.stop_measuring()
            self.every = 0
            self._due = False
            logger.warning(
                "ampguard's headroom watch stopped after an error (%s: %s) and does not watch again; training goes "
                "on without it (forward overflows are still found by the probe).",
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
            )

    def add_to(self, code: torch.Tensor, weight: float) -> torch.Tensor:
        """``code + weight * verdict`` when this iteration was watched (the scaler's one read carries it)."""
        if not self._pass.owned_here():
            return code
        if self._pass.armed:
            self.finish()
        if self.pending is None:
            return code
        self.in_read = True
        return code + weight * self.pending.verdict.to(code.device, non_blocking=True)

    def settle(self, overflow: bool) -> Sighting | None:
        """At the update after a watched iteration: the sighting whose verdict was read (None: none this time).

        A sighting of an iteration without forward overflow becomes :attr:`last`, which a later overflow blames.
        """
        if not self._pass.owned_here():
            return None
        if self._pass.armed:  # watched, but no step() read its verdict (no optimizer stepped): seen all the same
            self.finish()
        sighting, self.pending, self.in_read = self.pending, None, False
        if sighting is not None and not overflow:
            sighting.clean = True
            self.last = sighting
        return sighting

    def suspect(self) -> tuple[Candidate, float, int] | None:
        """The module the last clean sighting saw closest to the limit, its peak and step, when within BLAME_BOUND.

        Modules that became islands since are passed over (their float32 output, given back as float16, is the
        overflow of their caller). Once per sighting; no read (:class:`~ampguard.syncs.HostCopy`).
        """
        sighting = self.last
        if sighting is None or sighting.blamed:
            return None
        sighting.blamed = True  # if the overflows go on, the probe looks
        if sighting.shown is None:
            sighting.read_verdict()
        for index, peak in sighting.top:
            if peak < FLOAT16_MAX / BLAME_BOUND:
                return None
            found = sighting.candidate(index)
            if found is not None and not self.islands.holds(found[0]):
                return found, float(peak), sighting.step
        return None
