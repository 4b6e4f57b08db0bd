"""One float32 master storage per half-precision parameter storage, shared by every optimizer that steps it.

torch adds the updates of every optimizer that holds a parameter (a shared
encoder, a GAN, a second optimizer for a subset), and of every Parameter that
views the same memory (two Parameters over one tensor). The masters must do
the same, or the last optimizer to step overwrites the other's update with its
own stale copy. So the float32 copy is made per *storage*: each master is a
view of a float32 buffer that mirrors the half-precision parameter's storage
(same offset and strides), and a second parameter over the same memory, or the
same parameter in another optimizer, gets a view of that same buffer. Each
optimizer keeps master objects of its own (its state is keyed by them, its
gradients are its own copies), while their values are one.

A parameter that covers part of a buffer made for another and part outside it
cannot be mirrored (views cannot grow); the optimizer is then refused by name
(:class:`~ampguard.master_weights.records.Unwrappable`), never silently split.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor


class PartialOverlap(Exception):
    """A parameter overlaps, without being inside, the memory another parameter's master mirrors."""


@dataclass(eq=False)
class _Buffer:
    """A float32 copy of the elements ``[start, stop)`` of one half-precision storage."""

    origin: int  # the element of the half-precision storage at offset 0 of the float32 one
    start: int
    stop: int
    views: list[weakref.ref[Tensor]]  # masters made from it: the buffer lives as long as one of them does
    owners: list[weakref.ref[Tensor]]  # parameters it was made for: the storage is theirs while one still has it

    def alive(self, pointer: int) -> Tensor | None:
        """A live master of this buffer, if the storage it mirrors is still the one at ``pointer``; else None."""
        if not any(o() is not None and o().untyped_storage().data_ptr() == pointer for o in self.owners):  # type: ignore[union-attr]
            return None
        return next((v for v in (ref() for ref in self.views) if v is not None), None)


def _key(param: Tensor) -> tuple[torch.device, int, torch.dtype]:
    return param.device, param.untyped_storage().data_ptr(), param.dtype


def _span(param: Tensor) -> tuple[int, int]:
    """The elements of its storage ``param`` covers: ``[offset, last + 1)``."""
    start = int(param.storage_offset())
    return start, start + 1 + sum((int(size) - 1) * int(stride) for size, stride in zip(param.shape, param.stride()))


class MasterMemory:
    """The float32 buffers mirroring half-precision storages, for one application of the master_weights patch.

    Example::

        memory = MasterMemory()
        master = memory.master_for(param)  # a float32 view mirroring param's memory
        memory.master_for(alias) is not master  # another Parameter over that memory: a view of the same buffer
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, int, torch.dtype], list[_Buffer]] = {}
        self._prune_above = 4096  # entries of models gone since are dropped when the registry grows past this

    def _prune(self) -> None:
        for key in list(self._buffers):
            self._live(key)
        self._prune_above = max(4096, 2 * len(self._buffers))

    def _live(self, key: tuple[torch.device, int, torch.dtype]) -> list[tuple[_Buffer, Tensor]]:
        found = [
            (buffer, view)
            for buffer in self._buffers.get(key, ())
            for view in [buffer.alive(key[1])]
            if view is not None
        ]
        if found:
            self._buffers[key] = [buffer for buffer, _ in found]
        else:
            self._buffers.pop(key, None)
        return found

    def master_for(self, param: Tensor) -> Tensor:
        """A float32 master for ``param``: a view of the buffer that already mirrors its memory, or of a new one.

        Raises :class:`PartialOverlap` when ``param`` straddles the edge of such a buffer.
        """
        if param.numel() == 0:
            return torch.nn.Parameter(param.detach().to(torch.float32, copy=True))
        if len(self._buffers) > self._prune_above:
            self._prune()
        key = _key(param)
        start, stop = _span(param)
        live = self._live(key)
        for buffer, view in live:
            if buffer.start <= start and stop <= buffer.stop:
                offset = start - buffer.origin
                master = torch.nn.Parameter(view.detach().as_strided(param.shape, param.stride(), offset))
                buffer.views.append(weakref.ref(master))
                buffer.owners.append(weakref.ref(param))
                # the parameter may have been written since (model.load_state_dict before a new optimizer, the old
                # one still alive): take it where the float32 value no longer rounds to it (no host read)
                take_where_changed(master, param)
                return master
        if any(start < buffer.stop and buffer.start < stop for buffer, _ in live):
            raise PartialOverlap
        data = torch.empty(stop - start, dtype=torch.float32, device=param.device)
        master = torch.nn.Parameter(data.as_strided(param.shape, param.stride(), 0))
        with torch.no_grad():
            master.copy_(param)
        self._buffers.setdefault(key, []).append(
            _Buffer(start, start, stop, [weakref.ref(master)], [weakref.ref(param)])
        )
        return master

    def adopt(self, param: Tensor, master: Tensor) -> Tensor:
        """Register ``master`` (made elsewhere: an unpickled optimizer's) as the copy of ``param``'s memory.

        A later optimizer holding ``param`` then shares it. When the memory is
        mirrored already (the same parameter in another optimizer of the copy:
        ``copy.deepcopy`` copies each master on its own), the master to use is a
        view of that copy, returned with ``master``'s values; else ``master``
        itself (also when it does not match ``param``'s layout, or straddles a copy).
        """
        if param.numel() == 0 or master.shape != param.shape or master.stride() != param.stride():
            return master
        key = _key(param)
        start, stop = _span(param)
        live = self._live(key)
        if any(view.untyped_storage().data_ptr() == master.untyped_storage().data_ptr() for _, view in live):
            return master  # one pickle of both optimizers: already a view of the same copy
        if any(buffer.start < stop and start < buffer.stop for buffer, _ in live):
            try:
                shared = self.master_for(param)
            except PartialOverlap:
                return master
            with torch.no_grad():
                shared.copy_(master)
            return shared
        origin = start - int(master.storage_offset())
        self._buffers.setdefault(key, []).append(
            _Buffer(origin, start, stop, [weakref.ref(master)], [weakref.ref(param)])
        )
        return master


@torch.no_grad()
def take_where_changed(master: Tensor, param: Tensor) -> None:
    """``param``'s value into ``master`` wherever ``master`` no longer rounds to it (the float32 value kept elsewhere)."""
    master.copy_(torch.where(master.to(param.dtype) == param, master, param.to(master.dtype)))
