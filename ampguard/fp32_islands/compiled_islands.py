"""fp32 islands inside torch.compile'd code: they do not apply there, and ampguard says so once per island.

The island's hooks return at once while dynamo traces them (their first
line, ``is_compiling()``, is constant there), so nothing of them goes into
compiled code, ``fullgraph=True`` included: a compiled model, or a compiled
module holding an island, computes the island's module under autocast, in
float16, as plain torch does (``model.compile()`` after the island alike).

Each such island is named once (INFO):

* when its module is compiled (``torch.compile(model)``, or ``model.compile()``,
  which compiles the model's bound ``_call_impl``: the patch wraps
  ``torch.compile``, :func:`naming_islands`). Dynamo may reuse the code it
  compiled for another instance of the same model (no compilation starts then);
* at each compilation (a start callback of dynamo's, rare and already slow)
  while an island not yet named lives, and when an island is made once dynamo
  has compiled something: one pass over the live modules finds the compiled
  ones (``torch.compile(module)``, ``module.compile()``) that hold an island.

Not seen: a compiled function that calls the model, and a ``torch.compile``
bound to a name before ``import ampguard`` (``from torch import compile``) whose
compiled code is reused from another instance (named at the next compilation).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ampguard.fp32_islands.island_hooks import Island, IslandTable
from ampguard.fp32_islands.probe import is_compiled
from ampguard.live_objects import instances
from ampguard.log import event_logger

logger = event_logger("island")

SKIPPED_BY_COMPILE = (
    "fp32 island %s (%s) does not apply inside torch.compile'd code (%s): torch.compile leaves the island's "
    "hooks out of the compiled graph, so there the module runs under autocast (float16), as under plain torch, "
    "also when the model is compiled after the island exists. To keep it in float32 there, put the line ampguard "
    "printed when it made the island into the module's forward before compiling."
)


class CompiledIslands:
    """Names once each island of ``table`` that compiled code leaves out (one per application of the patch)."""

    def __init__(self, table: IslandTable) -> None:
        self.table = table
        self._said: set[int] = set()  # id() of the islands named

    def on_compile_start(self, *_: Any) -> None:
        """Name once each live island inside a compiled module (a dynamo start callback: never raises)."""
        try:
            waiting = self._waiting()
            if not waiting:
                return
            for compiled in _compiled_modules():
                self._name_in(compiled, waiting)
        except Exception:  # a message must never be the reason a compilation fails
            return

    def compiled(self, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``torch.compile(*args, **kwargs)`` returned ``compiled``: name the islands inside the module it compiled
        (``torch.compile(model)``, or ``model.compile()``, which compiles ``model._call_impl``). Never raises."""
        if not self.table.by_module:  # (no island: nothing to say, nothing looked at)
            return
        try:
            target = args[0] if args else kwargs.get("model")
            owner = target if isinstance(target, torch.nn.Module) else getattr(target, "__self__", None)
            if isinstance(compiled, torch.nn.Module):  # an OptimizedModule around ``target``
                self._name_in(compiled, self._waiting())
            elif isinstance(owner, torch.nn.Module):  # its bound _call_impl: compiled in place
                self._name_in(owner, self._waiting())
        except Exception:  # a message must never be the reason a compilation fails
            pass

    def _waiting(self) -> dict[int, Island]:
        """The live islands not named yet, by id() of their module."""
        return {
            key: island
            for key, island in self.table.by_module.items()
            if key not in self._said and island.module() is not None
        }

    def _name_in(self, compiled: torch.nn.Module, waiting: dict[int, Island]) -> None:
        """Name the islands of ``waiting`` inside ``compiled`` (each taken out of ``waiting``)."""
        for module in compiled.modules():
            island = waiting.pop(id(module), None)
            if island is not None and island.module() is module:
                self._said.add(id(module))
                logger.info(SKIPPED_BY_COMPILE, island.name, type(module).__name__, type(compiled).__name__)

    def listen(self) -> None:
        """From the first island on: name the islands that compiled code leaves out.

        Imports torch._dynamo (over a second) at the first island, not at ``import ampguard``.
        """
        import torch._dynamo.callback

        handler = torch._dynamo.callback.callback_handler
        if self.on_compile_start not in handler.start_callbacks:  # (torch._dynamo.reset() may clear them)
            handler.register_start_callback(self.on_compile_start)
        if _something_compiled():  # an island made in a model compiled already (re-applied from a checkpoint)
            self.on_compile_start()

    def stop(self) -> None:
        """At uninstall: no more listening."""
        handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
        if handler is not None and self.on_compile_start in handler.start_callbacks:
            handler.remove_start_callback(self.on_compile_start)


class IslandsOwner(Protocol):
    """What the ``torch.compile`` wrapper is built with: the fp32_islands patch, whose ``healing`` holds the
    islands while it is applied."""

    @property
    def healing(self) -> Any: ...


def _compiled_modules() -> list[torch.nn.Module]:
    """The live modules that run compiled (one pass over gc's objects)."""
    return [module for module in instances(torch.nn.Module) if is_compiled(module)]


def naming_islands(compile_function: Callable[..., Any], owner: IslandsOwner) -> Callable[..., Any]:
    """``torch.compile``, then the islands inside the module it compiled named (torch >= 2.4, where they are left
    out): ``torch.compile(model)``, or ``model.compile()`` (which compiles ``model._call_impl``)."""

    @functools.wraps(compile_function)
    def compile(*args: Any, **kwargs: Any) -> Any:
        compiled = compile_function(*args, **kwargs)
        healing = owner.healing
        if healing is not None:
            healing.islands.compiled.compiled(compiled, args, kwargs)
        return compiled

    return compile


def _something_compiled() -> bool:
    """Whether dynamo has compiled a graph in this process (no scan of live objects before that)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return bool(counters is not None and counters["stats"]["unique_graphs"])
