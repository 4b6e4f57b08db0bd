"""The tensors in any nesting of a module's inputs or outputs, found and replaced without touching the containers.

torch's pytree (``torch.utils._pytree``) walks the containers it knows:
tuples, lists, dicts, namedtuples, ``OrderedDict``, ``defaultdict``, ``deque``
and every type registered with it (transformers registers each ``ModelOutput``
class). Dataclasses are not registered by default (torch 2.3 to 2.14), so a
dataclass pytree leaves as one leaf is walked here, field by field, and so is
a namedtuple a torch without pytree's namedtuple support would leave. Any other
object is a leaf and stays as it is: an unknown container is never an error.

:func:`map_tensors` builds new containers only along the paths where a tensor
changed; the caller's objects are never modified.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from ampguard.torch_privates import functorch_unwrapped

try:
    from torch.utils._pytree import tree_flatten, tree_unflatten
except ImportError:  # a torch that moved it: (nested) lists, tuples and dicts, and the fallbacks below

    def tree_flatten(tree: Any) -> tuple[list[Any], Any]:  # type: ignore[misc]
        if type(tree) in (list, tuple):
            parts = [tree_flatten(item) for item in tree]
            return [leaf for leaves, _ in parts for leaf in leaves], (type(tree), [spec for _, spec in parts])
        if type(tree) is dict:
            parts = [tree_flatten(item) for item in tree.values()]
            return [leaf for leaves, _ in parts for leaf in leaves], (dict, list(tree), [spec for _, spec in parts])
        return [tree], None

    def tree_unflatten(leaves: Any, spec: Any) -> Any:  # type: ignore[misc]
        rest = list(leaves)

        def build(spec: Any) -> Any:
            if spec is None:
                return rest.pop(0)
            if spec[0] is dict:
                return {key: build(child) for key, child in zip(spec[1], spec[2])}
            return spec[0](build(child) for child in spec[1])

        return build(spec)


# Deeper than this, a dataclass or namedtuple is left as it is (a cycle of dataclasses).
MAX_DEPTH = 32


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, in a fixed order (the order :func:`map_tensors` visits them)."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(tree, collect)
    return found


def map_tensors(tree: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by ``change(tensor)``: ``tree`` itself when no tensor changed."""
    return _map(tree, change, 0)


def _map(tree: Any, change: Callable[[torch.Tensor], torch.Tensor], depth: int) -> Any:
    if isinstance(tree, torch.Tensor):
        return change(tree)
    leaves, spec = tree_flatten(tree)
    if len(leaves) == 1 and leaves[0] is tree:  # a leaf of pytree's: a tensor, or a container it does not know
        return _map_unknown(tree, change, depth)
    mapped = [_map(leaf, change, depth) for leaf in leaves]
    if all(new is old for new, old in zip(mapped, leaves)):
        return tree
    return tree_unflatten(mapped, spec)


def _map_unknown(value: Any, change: Callable[[torch.Tensor], torch.Tensor], depth: int) -> Any:
    """A dataclass or namedtuple pytree does not walk, field by field; anything else as it is."""
    if depth >= MAX_DEPTH:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        values = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
        changed = {name: new for name, old in values.items() if (new := _map(old, change, depth + 1)) is not old}
        return _with_fields(value, changed) if changed else value
    if isinstance(value, tuple) and hasattr(type(value), "_make") and hasattr(type(value), "_fields"):
        items = [_map(item, change, depth + 1) for item in value]
        kind: Any = type(value)
        return kind._make(items) if any(n is not o for n, o in zip(items, value)) else value
    if isinstance(value, Mapping):
        entries = {key: _map(item, change, depth + 1) for key, item in value.items()}
        changed = {key: new for key, new in entries.items() if new is not value[key]}
        return _with_items(value, changed) if changed else value
    return value


def _with_items(value: Mapping[Any, Any], changed: dict[Any, Any]) -> Any:
    """A shallow copy of the mapping ``value`` with ``changed`` items; ``value`` if it cannot be copied and written."""
    try:
        new = copy.copy(value)
        if new is value or not isinstance(new, MutableMapping):
            return value
        for key, item in changed.items():
            new[key] = item
        return new
    except Exception:  # a mapping that cannot be copied or written: left as it is
        return value


def _with_fields(value: Any, changed: dict[str, Any]) -> Any:
    """A shallow copy of the dataclass ``value`` with ``changed`` fields (frozen ones too); ``value`` if it fails."""
    try:
        new = copy.copy(value)
        for name, field_value in changed.items():
            try:
                setattr(new, name, field_value)
            except dataclasses.FrozenInstanceError:
                object.__setattr__(new, name, field_value)
        return new
    except Exception:  # a dataclass that cannot be copied: left as it is
        return value


def values_in(tree: Any, depth: int = 4) -> list[torch.Tensor]:
    """The dense tensors holding the values of every tensor in ``tree``, looking also ``depth`` levels into the
    instance attributes of objects :func:`tensors` leaves as they are (a batch object of the user's own class), for
    checks that only read. A nested tensor gives its values (jagged: one buffer; strided: its pieces), a tensor made
    inside ``torch.func.vmap`` and kept past it the whole batch's. Modules are not looked into."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.extend(_dense_parts(value))
            return
        leaves = tree_flatten(value)[0]
        if not (len(leaves) == 1 and leaves[0] is value):
            for leaf in leaves:
                visit(leaf, depth)
            return
        inner = tensors(value)
        if inner or not depth or id(value) in seen or isinstance(value, (torch.nn.Module, type)):
            for tensor in inner:
                found.extend(_dense_parts(tensor))
            return
        seen.add(id(value))
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            for item in list(attributes.values()):
                visit(item, depth - 1)

    visit(tree, depth)
    return found


def _dense_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    tensor = functorch_unwrapped(tensor)
    if not tensor.is_nested:
        return [tensor]
    if tensor.layout == torch.strided:
        return list(tensor.unbind())
    return [tensor.values()]  # (jagged)
