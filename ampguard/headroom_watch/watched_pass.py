"""One watched iteration's module calls: the stack of calls, the dispatch mode entered with the model, the samples.

:class:`WatchedPass` holds the two global module hooks of a watched
iteration (:class:`~ampguard.module_hooks.GlobalModuleHooks`): the pre-hook
pushes the module called (its :class:`WatchedModule`) and enters the
:class:`~ampguard.headroom_watch.observer.Observer` with the model, the
post-hook pops it and leaves the mode with that module. Each float16 op
output the mode sees is sampled (one ``aminmax`` on the device) into the
innermost module running. Where it does not look (compiled code, threads other
than the one that trains, a 65th pass, a pass ended by ``KeyboardInterrupt``)
it says so once (INFO) and the code there runs as under torch.
:class:`~ampguard.headroom_watch.watch.HeadroomWatch` schedules the passes and
turns their samples into sightings.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

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
from ampguard.headroom_watch.sighting import FOLD, fold
from ampguard.log import event_logger
from ampguard.module_hooks import GlobalModuleHooks
from ampguard.torch_privates import is_compiling

logger = event_logger("island")

# Outermost module calls watched per iteration at most (micro-batches of gradient accumulation, a GAN's models): an
# evaluation loop run under autocast before the next step() is watched no further, in time or memory.
MAX_PASSES = 64


# Said once per model class at INFO when the model called is compiled as a whole.
COMPILED_MODEL = (
    "headroom watch: the model `%s` (torch.compile of %s) runs compiled and is not watched: no module of it is "
    'made an fp32 island ahead of an overflow (docs/islands.md, "Where it steps aside").'
)


def _dynamo_compiled() -> bool:
    """Whether torch.compile has compiled a graph in this process (never imports dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return bool(counters is not None and counters["stats"]["unique_graphs"])


def _alive(thread: int) -> bool:
    return any(running.ident == thread for running in threading.enumerate())


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (checkpointing recomputes there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


@dataclass
class WatchedModule:
    """A module called during a watched iteration: its samples, its outputs' kinds, the frame of its running call."""

    module: weakref.ref[torch.nn.Module]
    root: weakref.ref[torch.nn.Module]
    candidate: bool  # not a root, not an island
    named: bool = False  # named in report mode: measured, but no verdict names it again
    samples: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (min, max) per output
    outputs: tuple[str, ...] | None = None
    call: Any = None  # the frame running this module's current call, while it is on the stack


class IslandsSeen(Protocol):
    """What the watch asks of the islands (:class:`ampguard.fp32_islands.islands.Islands`): islands are not
    candidates, modules named in report mode are measured but passed over."""

    def holds(self, module: torch.nn.Module) -> bool: ...

    def was_named_in_report(self, module: torch.nn.Module) -> bool: ...


class WatchedPass:
    """The module hooks of a watched iteration and what they keep: the calls running, each module's samples.

    ``fail(error)`` is told of an error inside the hooks or the mode (the watch then stops for good); after
    :meth:`stop_measuring` the hooks keep the stack but sample nothing.
    """

    def __init__(self, fail: Callable[[Exception], None], islands: IslandsSeen) -> None:
        self._fail = fail
        self._islands = islands
        self._measuring = True
        self._thread = 0
        # The hooks run in the training thread; begin() and end() may come from any (another thread's scaler, an
        # uninstall): reentrant, since a hook can end the pass (an interrupted forward).
        self._lock = threading.RLock()
        self._leaving: WatchedModule | None = None  # ended elsewhere while this call held the mode: left with it
        self._stack: list[WatchedModule] = []
        self._modules: dict[int, WatchedModule] = {}
        self._mode: Any = None
        self._mode_depth = 0  # the stack's length when the mode was entered: it is left with that module
        self._opaque: torch.nn.Module | None = None  # compiled code being called: nothing inside is watched
        self._unwritten = UnwrittenMemory()
        self._stepped_aside: set[str] = set()  # what the watch said once it does not look inside
        self._passes = 0
        self._hooks = GlobalModuleHooks(self._before, self._after)

    @property
    def armed(self) -> bool:
        return self._hooks.armed

    def owned_here(self) -> bool:
        """Whether this thread is the one the pass watches (or that thread is gone): only it may end the pass."""
        return threading.get_ident() == self._thread or not _alive(self._thread)

    def begin(self) -> None:
        """Watch the module calls from now on, in this thread."""
        with self._lock:
            self._passes = 0
            self._modules = {}
            self._stack = []
            self._unwritten.clear()
            self._thread = threading.get_ident()
            self._hooks.arm()

    def end(self) -> list[WatchedModule]:
        """Stop watching and forget the pass; the candidate modules that were sampled.

        From another thread while the watched thread runs the model under the mode (an uninstall, an error):
        torch's mode stack is per thread, so the mode is left there, when the call that entered it returns.
        """
        with self._lock:
            sampled = [watched for watched in self._modules.values() if watched.candidate and watched.samples]
            elsewhere = self._mode is not None and threading.get_ident() != self._thread
            if elsewhere and _alive(self._thread):
                if self._leaving is None:
                    self._leaving = self._stack[self._mode_depth - 1]
            else:
                if elsewhere:
                    self._mode = None  # (its thread ended, and its mode stack with it)
                self._stop()
            self._stack = []  # (rebound, not cleared: a measure() running in the watched thread keeps its list)
            self._modules = {}
            self._opaque = None
            return sampled

    def _stop(self) -> None:
        self._hooks.disarm()
        self._leave_mode()
        self._leaving = None
        forget_higher_order_operators()
        self._unwritten.clear()

    def stop_measuring(self) -> None:
        """Sample nothing more (after an error inside the watch)."""
        self._measuring = False

    def step_aside(self, what: str, why: str = "a higher-order operator") -> None:
        """Say once that the watch does not look inside ``what``; training is as without it there."""
        if what not in self._stepped_aside:
            self._stepped_aside.add(what)
            logger.info(
                "headroom watch: %s is not watched inside (%s); its outputs are, by the module that uses them.",
                what,
                why,
            )

    def _say_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._stepped_aside:
            self._stepped_aside.add(key)
            logger.info(message, *args)

    def _leave_mode(self) -> None:
        if self._mode is not None:  # (also: a forward pass that never finished, an exception escaped the hooks)
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        # is_compiling() first: dynamo cannot trace threading.get_ident() (a graph break; with fullgraph=True an error)
        if is_compiling():
            return
        if threading.get_ident() != self._thread:
            # A coverage gap: the mode and the stack belong to the thread that trains.
            self._say_once("threads", OTHER_THREAD, type(module).__name__, threading.current_thread().name)
            return
        if _in_backward():  # activation checkpointing recomputing a forward: not a new pass
            return
        with self._lock:
            if not self._hooks.armed or threading.get_ident() != self._thread:
                return  # ended (or begun again) by another thread since this hook was called
            if self._leaving is not None:
                if not live_depth([self._leaving], sys._getframe(1)):
                    self._stop()  # the call holding the mode ended in an exception no hook saw
                return
            self._enter_call(module)

    def _enter_call(self, module: torch.nn.Module) -> None:
        try:
            if self._stack and not self._drop_ended_calls(sys._getframe(2)):
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
            self._push(module)
        except Exception as error:  # an observation must never break the forward pass
            self._fail(error)

    def _push(self, module: torch.nn.Module) -> None:
        """Put ``module``'s call on the stack (the mode is entered with the model or the first candidate)."""
        if not self._stack:
            self._passes += 1
        watched = self._modules.get(id(module))
        if watched is None or watched.module() is not module:
            root = self._stack[0].module() if self._stack else module
            candidate = bool(self._stack) and not self._islands.holds(module)
            root_ref = weakref.ref(root if root is not None else module)
            named = candidate and self._islands.was_named_in_report(module)
            watched = self._modules[id(module)] = WatchedModule(weakref.ref(module), root_ref, candidate, named)
        elif not self._stack:
            watched.candidate = False  # called as the root too: its own code is never islanded
        watched.call = sys._getframe(4)  # torch's frame calling the hooks: it runs until the module call ends
        self._stack.append(watched)
        if self._mode is None and (watched.candidate or module is unwrap(self._stack[0].module() or module)):
            self._enter_mode()

    def _drop_ended_calls(self, frame: Any) -> bool:
        """Drop the calls on the stack that no longer run below ``frame`` (:mod:`~ampguard.headroom_watch.calls`).

        False: the outermost had ended too; the watch ends for this iteration (said once), so that what runs
        next (an evaluation, a checkpoint) runs as under torch.
        """
        depth = live_depth(self._stack, frame)
        if depth == len(self._stack):
            return True
        self._opaque = None  # (called inside an ended call: ended too)
        for watched in self._stack[depth:]:
            watched.call = None
        del self._stack[depth:]
        if self._mode is not None and depth < self._mode_depth:
            self._leave_mode()
        if depth:
            return True
        self._say_once("interrupted", INTERRUPTED)
        self.end()
        return False

    def _enter_compiled(self, module: torch.nn.Module) -> None:
        if self._stack:
            name = qualified_name(module, self._stack[0].module() or module) or type(module).__name__
            self.step_aside(f"`{name}`", "it is compiled")
        else:  # the model itself: no module is left to watch
            inner = type(getattr(module, "_orig_mod", module)).__name__
            self._say_once(f"compiled model {inner}", COMPILED_MODEL, type(module).__name__, inner)

    def _enter_mode(self) -> None:
        mode = Observer(self.measure, self._fail, self.step_aside, self._unwritten)
        mode.__enter__()  # type: ignore[no-untyped-call]
        self._mode = mode
        self._mode_depth = len(self._stack)

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or threading.get_ident() != self._thread:  # (compiled: _before pushed nothing either)
            return
        with self._lock:
            if self._leaving is not None:
                if self._leaving.module() is module:
                    self._stop()
            elif self._hooks.armed and threading.get_ident() == self._thread:
                self._leave_call(module, output)

    def _leave_call(self, module: torch.nn.Module, output: Any) -> None:
        if self._opaque is not None:
            if self._opaque is module:
                self._opaque = None
            return
        if not self._stack or self._stack[-1].module() is not module:
            return
        watched = self._stack.pop()
        watched.call = None
        try:
            if watched.candidate and watched.outputs is None and output is not None:
                watched.outputs = output_kinds(tensors(output))
        except Exception:
            watched.outputs = None
        if self._mode is not None and len(self._stack) < self._mode_depth:
            self._leave_mode()

    def measure(self, output: Any) -> None:
        """One op's output, inside the innermost module running: its float16 extremes, on the device."""
        stack = self._stack  # (end() in another thread rebinds it)
        if not stack or not self._measuring or self._opaque is not None:
            return
        watched = stack[-1]
        if not watched.candidate:
            return
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if measurable(tensor):
                low, high = torch.aminmax(tensor)
                watched.samples.append((low, high))
                if len(watched.samples) >= FOLD:
                    watched.samples = fold(watched.samples)
