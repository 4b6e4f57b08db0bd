"""The headroom watch: how close each module's float16 tensors come to 65,504, seen before they overflow.

Every ``AMPGUARD_WATCH_EVERY`` optimizer steps, one iteration's forward passes
are observed (:class:`HeadroomWatch`): two global module hooks keep the stack
of module calls, and while the model runs a ``TorchDispatchMode``
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
(the outermost module called) and islands are not candidates.

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
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

import ampguard.fp32_islands.islands as islands
from ampguard.fp32_islands.island_io import output_kinds
from ampguard.fp32_islands.probe import is_compiled, qualified_name, unwrap
from ampguard.fp32_islands.tensor_tree import tensors
from ampguard.headroom_watch.calls import INTERRUPTED, OTHER_THREAD, live_depth
from ampguard.headroom_watch.observer import (
    COMPILE_AWARE,
    Observer,
    UnwrittenMemory,
    forget_higher_order_operators,
    measurable,
)
from ampguard.headroom_watch.sighting import FLOAT16_MAX, FOLD, Candidate, Sighting, fold, summarise
from ampguard.log import event_logger
from ampguard.module_hooks import GlobalModuleHooks
from ampguard.torch_privates import is_compiling

logger = event_logger("island")

# At a forward overflow with no warning, the module the last watch saw closest is blamed at once when its peak was
# within this factor of float16's limit (6 bits: 1,024 and up). An input 8x louder than usual multiplies attention
# logits (a product of two projections of it) by 64: a module that far from the limit can overflow on one batch;
# healthy activations (normalised, a few units to a few hundred) stay below it.
BLAME_BOUND = 64.0
# Outermost module calls watched per iteration at most (micro-batches of gradient accumulation, a GAN's models): an
# evaluation loop run under autocast before the next step() is watched no further, in time or memory.
MAX_PASSES = 64


def _dynamo_compiled() -> bool:
    """Whether torch.compile has compiled a graph in this process (never imports dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return bool(counters is not None and counters["stats"]["unique_graphs"])


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (checkpointing recomputes there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


@dataclass
class _Slot:
    module: weakref.ref[torch.nn.Module]
    root: weakref.ref[torch.nn.Module]
    candidate: bool  # not a root, not an island
    samples: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (min, max) per output
    outputs: tuple[str, ...] | None = None
    call: Any = None  # the frame running this module's current call, while it is on the stack


class HeadroomWatch:
    """Every ``every`` optimizer steps, the largest float16 magnitude inside each module, on the device.

    ``headroom``: a module whose peak reaches ``65504 / headroom`` gets the verdict.
    """

    def __init__(self, every: int, headroom: float) -> None:
        self.every = every if Observer is not None else 0
        self.limit = FLOAT16_MAX / headroom
        self.headroom = headroom
        self._thread = 0
        self._stack: list[_Slot] = []
        self._slots: dict[int, _Slot] = {}
        self._mode: Any = None
        self._mode_depth = 0  # the stack's length when the mode was entered: it is left with that module
        self._opaque: torch.nn.Module | None = None  # compiled code being called: nothing inside is watched
        self._unwritten = UnwrittenMemory()
        self._stepped_aside: set[str] = set()  # what the watch said once it does not look inside
        self._watched_step = 0
        self._passes = 0
        self.broken = False  # after an error: no more watching
        self._due = False  # the second iteration is watched, then one every ``every`` optimizer steps
        # Per scaler: the last ``(step - 1) // every`` seen at its update (each model is watched at its 2nd step).
        self._periods: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.pending: Sighting | None = None  # finished, its verdict not decoded yet
        self.in_read = False  # the pending verdict rode on this iteration's read
        self.last: Sighting | None = None  # the last sighting whose iteration did not overflow
        self._hooks = GlobalModuleHooks(self._before, self._after)

    @property
    def watching(self) -> bool:
        return self._hooks.armed

    def busy(self) -> bool:
        """Whether the update must look at the watch (it watches, or a verdict waits, or a watch is due)."""
        return self._due or self._hooks.armed or self.pending is not None

    # -- the schedule ------------------------------------------------------------------------------

    def after_update(self, step: int, may_watch: bool, scaler: Any = None) -> None:
        """At the end of an update: arm for the next iteration when due (``may_watch``: the probe is not armed)."""
        # Due at the first update of each period of ``every`` optimizer steps: with several optimizers per
        # iteration the step count moves by more than one per update, so "step % every == 1" could never hold.
        if self.every and scaler is not None and (step - 1) // self.every != self._periods.get(scaler, -1):
            self._periods[scaler] = (step - 1) // self.every
            self._due = True
        if self._due and may_watch and not self._hooks.armed and self.pending is None:
            self._due = False
            self._watched_step = step + 1
            self._arm()

    def restart(self) -> None:
        """Another model trains now (the scaler before was freed): forget the last sighting, watch its 2nd step."""
        self.last = None

    def watch_next(self, step: int) -> bool:
        """Watch the next iteration now, off the schedule (``ampguard bench`` times a watched step this way)."""
        if self._hooks.armed or self.pending is not None:
            return False
        self._watched_step = step + 1
        self._arm()
        return True

    def _arm(self) -> None:
        self._passes = 0
        self._slots = {}
        self._stack = []
        self._thread = threading.get_ident()
        self._hooks.arm()

    def stop(self) -> None:
        """Remove the hooks and forget the pass (uninstall, an error, the probe arming)."""
        self._remove()
        self._slots = {}
        self.pending = None
        self.in_read = False

    def _remove(self) -> None:
        self._hooks.disarm()
        self._leave_mode()
        forget_higher_order_operators()
        self._stack = []
        self._opaque = None
        self._unwritten.clear()

    def _leave_mode(self) -> None:
        if self._mode is not None:  # (also: a forward pass that never finished, an exception escaped the hooks)
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def step_aside(self, what: str, why: str = "a higher-order operator") -> None:
        """Say once that the watch does not look inside ``what``; training is as without it there."""
        if what not in self._stepped_aside:
            self._stepped_aside.add(what)
            logger.info(
                "headroom watch: %s is not watched inside (%s); its outputs are, by the module that uses them.",
                what,
                why,
            )

    # -- the pass ----------------------------------------------------------------------------------

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        # is_compiling() first: dynamo cannot trace threading.get_ident() (a graph break; with fullgraph=True an error)
        if is_compiling():
            return
        if threading.get_ident() != self._thread:
            self._other_thread(module)
            return
        if _in_backward():  # activation checkpointing recomputing a forward: not a new pass
            return
        try:
            if self._stack and not self._drop_ended_calls(sys._getframe(1)):
                return  # the watched pass ended in an exception its hooks never saw: this call runs as under torch
            if self._opaque is not None:
                return
            if is_compiled(module):  # compiled code is not watched inside (nor changed: see islands)
                self._opaque = module
                self._enter_compiled(module)
                return
            if not self._stack and self._passes >= MAX_PASSES:
                self._opaque = module  # nor a 65th pass
                return
            if not self._stack and not COMPILE_AWARE and _dynamo_compiled():
                # This torch checks a compiled function's guards under the mode, fails them, and compiles it again
                # at every watched step, until its recompile limit raises (a helper compiled inside a module).
                self._opaque = module
                self.step_aside("this process's models", f"torch {torch.__version__} compiled code here")
                return
            if not self._stack and not COMPILE_AWARE and any(is_compiled(inner) for inner in module.modules()):
                self._opaque = module  # this torch would trace the mode into the compiled submodule's graph
                self.step_aside(
                    f"`{type(module).__name__}`", f"it holds compiled submodules (torch {torch.__version__})"
                )
                return
            if not self._stack:
                self._passes += 1
            slot = self._slots.get(id(module))
            if slot is None or slot.module() is not module:
                root = self._stack[0].module() if self._stack else module
                candidate = bool(self._stack) and not islands.holds(module)
                root_ref = weakref.ref(root if root is not None else module)
                slot = self._slots[id(module)] = _Slot(weakref.ref(module), root_ref, candidate)
            elif not self._stack:
                slot.candidate = False  # called as the root too: its own code is never islanded
            slot.call = sys._getframe(2)  # torch's frame calling the hooks: it runs until the module call ends
            self._stack.append(slot)
            if self._mode is None and (slot.candidate or module is unwrap(self._stack[0].module() or module)):
                self._enter_mode()
        except Exception as error:  # an observation must never break the forward pass
            self.fail(error)

    def _drop_ended_calls(self, frame: Any) -> bool:
        """Drop the calls on the stack that no longer run below ``frame`` (:mod:`~ampguard.headroom_watch.calls`).

        False: the outermost had ended too; the watch ends for this iteration (said once), so that what runs
        next (an evaluation, a checkpoint) runs as under torch.
        """
        depth = live_depth(self._stack, frame)
        if depth == len(self._stack):
            return True
        self._opaque = None  # (called inside an ended call: ended too)
        for slot in self._stack[depth:]:
            slot.call = None
        del self._stack[depth:]
        if self._mode is not None and depth < self._mode_depth:
            self._leave_mode()
        if depth:
            return True
        if "interrupted" not in self._stepped_aside:
            self._stepped_aside.add("interrupted")
            logger.info(INTERRUPTED)
        self._remove()
        self._slots = {}
        return False

    def _other_thread(self, module: torch.nn.Module) -> None:
        """A module called in another thread while the watch is armed: not watched, said once (a coverage gap)."""
        if "threads" not in self._stepped_aside:
            self._stepped_aside.add("threads")
            logger.info(OTHER_THREAD, type(module).__name__, threading.current_thread().name)

    def _enter_compiled(self, module: torch.nn.Module) -> None:
        if self._stack:
            name = qualified_name(module, self._stack[0].module() or module) or type(module).__name__
            self.step_aside(f"`{name}`", "it is compiled")

    def _enter_mode(self) -> None:
        mode = Observer(self.measure, self.fail, self.step_aside, self._unwritten)
        mode.__enter__()  # type: ignore[no-untyped-call]
        self._mode = mode
        self._mode_depth = len(self._stack)

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or threading.get_ident() != self._thread:  # (compiled: _before pushed nothing either)
            return
        if self._opaque is not None:
            if self._opaque is module:
                self._opaque = None
            return
        if not self._stack or self._stack[-1].module() is not module:
            return
        slot = self._stack.pop()
        slot.call = None
        try:
            if slot.candidate and slot.outputs is None and output is not None:
                slot.outputs = output_kinds(tensors(output))
        except Exception:
            slot.outputs = None
        if self._mode is not None and len(self._stack) < self._mode_depth:
            self._leave_mode()

    def measure(self, output: Any) -> None:
        """One op's output, inside the innermost module running: its float16 extremes, on the device."""
        if not self._stack or self.broken or self._opaque is not None:
            return
        slot = self._stack[-1]
        if not slot.candidate:
            return
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if measurable(tensor):
                low, high = torch.aminmax(tensor)
                slot.samples.append((low, high))
                if len(slot.samples) >= FOLD:
                    slot.samples = fold(slot.samples)

    # -- the end of the watched iteration ---------------------------------------------------------

    def finish(self) -> Sighting | None:
        """Stop watching; the pass's peaks and verdict, on the device (no read). None: nothing was seen."""
        slots = [slot for slot in self._slots.values() if slot.candidate and slot.samples]
        self._remove()
        self._slots = {}
        if not slots or self.broken:
            return None
        try:
            self.pending = summarise(
                [slot.samples for slot in slots],
                [(slot.module, slot.root) for slot in slots],
                [slot.outputs for slot in slots],
                self.limit,
                self._watched_step,
            )
        except Exception as error:  # never the reason a run dies
            self.fail(error)
        return self.pending

    def fail(self, error: Exception) -> None:
        """After an error inside the watch: it stops for good, with one WARNING; training goes on without it."""
        if not self.broken:
            self.broken = True
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
        if self._hooks.armed:
            self.finish()
        if self.pending is None:
            return code
        self.in_read = True
        return code + weight * self.pending.verdict.to(code.device, non_blocking=True)

    def settle(self, overflow: bool) -> Sighting | None:
        """At the update after a watched iteration: the sighting whose verdict was read (None: none this time).

        A sighting of an iteration without forward overflow becomes :attr:`last`, which a later overflow blames.
        """
        if self._hooks.armed:  # watched, but no step() read its verdict (no optimizer stepped): seen all the same
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
            if found is not None and not islands.holds(found[0]):
                return found, float(peak), sighting.step
        return None
