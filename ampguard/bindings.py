"""Changing torch's objects in a way that can be undone exactly.

Every change a patch makes goes through a :class:`Bindings` object, which
records what was there before, so that :meth:`Bindings.undo` puts back the
identical original objects.

It also serves names bound before ampguard was imported. A script (or a library
it imported first) may already hold an original under its own name::

    from torch.cuda.amp import GradScaler, autocast          # a module global
    from torch.nn.utils import clip_grad_norm_               # a module global
    GradScaler = functools.partial(torch.GradScaler, device="cuda")   # coqui trainer

:meth:`Bindings.rebind_names_of` and :func:`rebind_queued` rebind such
module globals to the replacement and re-target ``functools.partial`` objects
in place (so every holder of the partial sees the change), and record each so
that uninstall rebinds them to the originals.

Modules imported *while* ampguard is installed bind the replacements
themselves (``from torch.amp import GradScaler`` gives SafeGradScaler).
:func:`restore_imported_since` gives them the originals back at uninstall:
every module global that holds a replacement under a name the original had
(``GradScaler``, ``clip_grad_norm_``), and every partial built around one.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass
class _Undo:
    description: str
    action: Callable[[], None] = field(repr=False)


class Bindings:
    """The changes one patch made, in order, each with its undo."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._undo: list[_Undo] = []
        self._queued: dict[int, tuple[Any, Any]] = {}
        # replacement id -> (replacement, original, names the original was bound under)
        self._replacements: dict[int, tuple[Any, Any, set[str]]] = {}

    def __len__(self) -> int:
        return len(self._undo)

    def describe(self) -> list[str]:
        return [u.description for u in self._undo]

    def set_attribute(self, target: Any, name: str, value: Any) -> Any:
        """``setattr(target, name, value)``; undo restores the old value, or deletes it if it was inherited."""
        own = vars(target).get(name, _MISSING) if hasattr(target, "__dict__") else getattr(target, name, _MISSING)
        original = getattr(target, name, _MISSING) if own is _MISSING else own
        setattr(target, name, value)

        def undo() -> None:
            if own is _MISSING:
                try:
                    delattr(target, name)
                except AttributeError:
                    pass
            else:
                setattr(target, name, own)

        self._undo.append(_Undo(f"{getattr(target, '__name__', target)!s}.{name}", undo))
        return original

    def delete_attribute(self, target: Any, name: str) -> None:
        """``delattr(target, name)`` for an attribute in ``target``'s own namespace; undo puts it back."""
        own = vars(target)[name]
        delattr(target, name)
        self._undo.append(_Undo(f"{getattr(target, '__name__', target)!s}.{name}", lambda: setattr(target, name, own)))

    def rebind_names_of(self, original: Any, replacement: Any) -> None:
        """Queue: every module global (and ``functools.partial``) holding ``original`` gets ``replacement``.

        The queue is carried out by :func:`rebind_queued`, one scan of
        ``sys.modules`` for all patches together.
        """
        self._queued[id(original)] = (original, replacement)
        self._replacements.setdefault(id(replacement), (replacement, original, set()))

    def take_queued(self) -> dict[int, tuple[Any, Any]]:
        """The queued rebindings (original id -> (original, replacement)), the queue emptied: for
        :func:`rebind_queued`."""
        queued, self._queued = self._queued, {}
        return queued

    def replacements(self) -> dict[int, tuple[Any, Any, set[str]]]:
        """Replacement id -> (replacement, original, the names the original was bound under)."""
        return self._replacements

    def rebind(self, module: types.ModuleType, name: str, value: Any, original: Any, replacement: Any) -> None:
        """``module.name`` (``value``: ``original`` itself, or a ``functools.partial`` of it) gets ``replacement``;
        undo gives ``original`` back."""
        if value is original:
            self._rebind_global(module, name, original, replacement)
        else:
            self._retarget_partial(value, replacement, f"{module.__name__}.{name}")

    def _rebind_global(self, module: types.ModuleType, name: str, original: Any, replacement: Any) -> None:
        setattr(module, name, replacement)
        self._replacements[id(replacement)][2].add(name)

        def undo() -> None:
            if getattr(module, name, None) is replacement:
                setattr(module, name, original)

        self._undo.append(_Undo(f"{module.__name__}.{name}", undo))

    def _retarget_partial(self, partial: functools.partial[Any], replacement: Any, where: str) -> None:
        # functools.partial is immutable from Python except through __setstate__,
        # which CPython uses for unpickling; it lets every holder of this very
        # partial object see the replacement.
        func, args, keywords, namespace = partial.__reduce__()[2]  # type: ignore[str-unpack]  # partial's state tuple
        partial.__setstate__((replacement, args, keywords, namespace))  # type: ignore[attr-defined]

        def undo() -> None:
            if partial.func is replacement:
                partial.__setstate__((func, partial.args, partial.keywords, partial.__dict__ or None))  # type: ignore[attr-defined]

        self._undo.append(_Undo(f"partial {where}", undo))

    def undo(self) -> None:
        """Undo every recorded change, newest first."""
        self._queued.clear()
        while self._undo:
            self._undo.pop().action()
        self._replacements.clear()


def rebind_queued(all_bindings: list[Bindings]) -> int:
    """Carry out every queued :meth:`Bindings.rebind_names_of` in one pass over ``sys.modules``.

    ampguard's own modules are left alone. Each change is recorded in the
    Bindings that queued it. Returns the number of bindings changed.
    """
    wanted: dict[int, tuple[Any, Any, Bindings]] = {}
    for bindings in all_bindings:
        for key, (original, replacement) in bindings.take_queued().items():
            wanted[key] = (original, replacement, bindings)
    changed = 0
    for module, name, value, holds in _module_globals(wanted):
        original, replacement, bindings = wanted[id(holds)]
        bindings.rebind(module, name, value, original, replacement)
        changed += 1
    return changed


def restore_imported_since(all_bindings: list[Bindings]) -> int:
    """Give modules imported while installed the originals back (see the module docstring).

    Call it before undoing the Bindings: it reads the replacements they know.
    Returns the number of bindings changed.
    """
    known: dict[int, tuple[Any, Any, set[str]]] = {}
    for bindings in all_bindings:
        known.update(bindings.replacements())
    changed = 0
    for module, name, value, holds in _module_globals(known):
        _replacement, original, names = known[id(holds)]
        if value is holds and name in names:
            setattr(module, name, original)
        elif value is not holds:
            value.__setstate__((original, value.args, value.keywords, value.__dict__ or None))
        else:
            continue
        changed += 1
    return changed


_STDLIB = os.path.dirname(os.__file__) + os.sep


def _is_stdlib(module_name: str, module: types.ModuleType) -> bool:
    """A module of Python's standard library (built in, or a file in its directory): it holds no torch object."""
    if module_name.partition(".")[0] not in sys.stdlib_module_names:
        return False
    file = getattr(module, "__file__", None)
    return file is None or file.startswith(_STDLIB)


def _module_globals(wanted: dict[int, Any]) -> Iterator[tuple[types.ModuleType, str, Any, Any]]:
    """``(module, name, value, matched)`` for every module global that is, or is a partial around, a wanted object."""
    if not wanted:
        return
    wanted_ids = wanted.keys()
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or module_name.partition(".")[0] == "ampguard":
            continue
        namespace = getattr(module, "__dict__", None)
        if not namespace or _is_stdlib(module_name, module):
            continue
        try:
            # Most modules hold neither a wanted object nor a partial: two passes in C rule them out faster
            # than the loop below would (the scan of a torch process's ~50,000 globals is most of install()).
            if wanted_ids.isdisjoint(map(id, namespace.values())) and functools.partial not in map(
                type, namespace.values()
            ):
                continue
            items = list(namespace.items())
        except RuntimeError:  # another thread is importing into this module
            continue
        for name, value in items:
            if id(value) in wanted:
                yield module, name, value, value
            elif type(value) is functools.partial and id(value.func) in wanted:
                yield module, name, value, value.func
