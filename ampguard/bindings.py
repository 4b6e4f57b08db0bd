"""Changing torch's objects in a way that can be undone exactly.

Every change a patch makes goes through a :class:`Bindings` object, which
records what was there before, so that :meth:`Bindings.undo` puts back the
identical original objects.

It also serves names bound before ampguard was imported. A script (or a library
it imported first) may already hold an original under its own name::

    from torch.cuda.amp import GradScaler, autocast          # a module global
    from torch.nn.utils import clip_grad_norm_               # a module global
    GradScaler = functools.partial(torch.GradScaler, device="cuda")   # coqui trainer

:meth:`Bindings.replace_everywhere` rebinds such module globals to the
replacement and re-targets ``functools.partial`` objects in place (so every
holder of the partial sees the change), and records each so that uninstall
rebinds them to the originals.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

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

    def _rebind_global(self, module: types.ModuleType, name: str, original: Any, replacement: Any) -> None:
        setattr(module, name, replacement)

        def undo() -> None:
            if getattr(module, name, None) is replacement:
                setattr(module, name, original)

        self._undo.append(_Undo(f"{module.__name__}.{name}", undo))

    def _retarget_partial(self, partial: functools.partial, replacement: Any, where: str) -> None:
        # functools.partial is immutable from Python except through __setstate__,
        # which CPython uses for unpickling; it lets every holder of this very
        # partial object see the replacement.
        original_state = partial.__reduce__()[2]
        func, args, keywords, namespace = original_state
        partial.__setstate__((replacement, args, keywords, namespace))

        def undo() -> None:
            if partial.func is replacement:
                partial.__setstate__((func, partial.args, partial.keywords, partial.__dict__ or None))

        self._undo.append(_Undo(f"partial {where}", undo))

    def undo(self) -> None:
        """Undo every recorded change, newest first."""
        self._queued.clear()
        while self._undo:
            self._undo.pop().action()


def rebind_queued(all_bindings: list[Bindings]) -> int:
    """Carry out every queued :meth:`Bindings.rebind_names_of` in one pass over ``sys.modules``.

    ampguard's own modules are left alone. Each change is recorded in the
    Bindings that queued it. Returns the number of bindings changed.
    """
    wanted: dict[int, tuple[Any, Any, Bindings]] = {}
    for bindings in all_bindings:
        for key, (original, replacement) in bindings._queued.items():
            wanted[key] = (original, replacement, bindings)
        bindings._queued.clear()
    if not wanted:
        return 0
    changed = 0
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or module_name.partition(".")[0] == "ampguard":
            continue
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        try:
            items = list(namespace.items())
        except RuntimeError:  # another thread is importing into this module
            continue
        for name, value in items:
            entry = wanted.get(id(value))
            if entry is not None and value is entry[0]:
                entry[2]._rebind_global(module, name, value, entry[1])
                changed += 1
            elif type(value) is functools.partial:
                entry = wanted.get(id(value.func))
                if entry is not None and value.func is entry[0]:
                    entry[2]._retarget_partial(value, entry[1], f"{module_name}.{name}")
                    changed += 1
    return changed
