"""The live instances of some classes, found by one pass over the garbage collector's objects.

For the failure path and uninstall only (the model tree above a module the probe
named, the compiled models holding an island, copies of ampguard's module hooks,
whether a DDP/FSDP wrapper exists): never on a healthy step. The pass filters by
exact type against the set of the classes' live subclasses, inside C iterators
(``map``, ``itertools.compress``): no Python call per object, several times faster
than a Python loop over a heap of a million objects. ``type(obj)``, not
``isinstance``: it reads no ``__class__``, which some objects warn or raise on.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any


def subclasses(bases: tuple[type, ...]) -> set[type]:
    """``bases`` and every live subclass of theirs (classes made at run time included)."""
    found: set[type] = set()
    stack = list(bases)
    while stack:
        cls = stack.pop()
        if cls in found:
            continue
        found.add(cls)
        stack.extend(type.__subclasses__(cls))
    return found


def instances(*bases: type) -> list[Any]:
    """Every live object whose class is one of ``bases`` or a subclass of one (one pass over gc's objects)."""
    kinds = subclasses(bases)
    objects = gc.get_objects()
    return list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
