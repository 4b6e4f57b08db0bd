"""One sampled step's gradients: per gradient, a row of counts on the device, small ones a batch at a time.

The sample's node hooks (:mod:`ampguard.underflow.measure`) hand each gradient
to :meth:`Gradients.add` with the module it is counted in and the autograd node
it reached. Gradients of fewer than :data:`ALONE_VALUES` values wait in a batch
of their device (module outputs and parameters apart), counted at once when it
holds :data:`BATCH_VALUES` values and when the sample ends: one concatenation
and about a dozen operations for the lot, where counting each alone takes about
fifteen (on a model of small operations that was most of a sampled step's
cost), so the batch's temporaries stay a few megabytes whatever the model.
Larger gradients are counted alone. A parameter's gradient is added once the
backward passes are over, before its scaler unscales it, with no node.

A row is ``[zeros, values at 2**-24, values at 2**-23, zeros and subnormals,
largest magnitude, squared norm, zeros of its sinking columns]`` (:data:`ROW`;
a column sinks where its largest value is ``2**-24`` or ``2**-23``; parameters'
rows have no columns), counted in float32 (a float32 gradient made of float16
values, a parameter's under autocast, holds them exactly). Nothing is read:
:class:`~ampguard.underflow.counts.Transfer` brings the rows to the host.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

SMALLEST_NORMAL = 2.0**-14
SMALLEST_SUBNORMAL = 2.0**-24
ROW = 7  # zeros, at 2**-24, at 2**-23, below normal, peak, squared norm, zeros of its sinking columns
# A column sinks where its largest magnitude is float16's smallest subnormal or twice it: nearly all of it below.
SINKING = 2.5 * SMALLEST_SUBNORMAL
BATCH_VALUES = 1 << 18  # values counted together (the batch's temporaries: about 20 bytes a value)
# A gradient this large is counted alone: its operations' fixed cost is small beside their work, and counted alone
# it needs none of the batch's per-value indices (which cost more than the operations they save).
ALONE_VALUES = 1 << 13


class Entry(NamedTuple):
    """What the host knows of a gradient counted: its module (``slot``), its node (None: a parameter's, one of a
    backward pass that did not complete, or a torch without ``_current_autograd_node``), whether it is float16 or
    float16's (``counted``; else its row only tells whether a flush went on through it), its number of values,
    whether it is a parameter's, and the backward pass it was counted in."""

    slot: int
    node: Any
    counted: bool
    size: int
    parameter: bool = False
    task: int = -1  # the backward pass (graph task) it was counted in


# What a magnitude's bucket is (torch.bucketize: the number of these it is above): 0 zero, 1 at 2**-24, 2 at
# 2**-23, 3 another subnormal, 4 normal (and inf). The cuts lie halfway between float16's values.
_CUTS = (0.0, 1.5 * SMALLEST_SUBNORMAL, 2.5 * SMALLEST_SUBNORMAL, 1023.5 * SMALLEST_SUBNORMAL)


_cuts_on: dict[torch.device, torch.Tensor] = {}


def _cuts(device: torch.device) -> torch.Tensor:
    cuts = _cuts_on.get(device)
    if cuts is None:
        cuts = _cuts_on[device] = _to(torch.tensor(_CUTS), device)
    return cuts


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, without waiting for the device (a copy on its stream)."""
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def columns(gradient: torch.Tensor) -> int:
    """The length of its last dimension (a Linear's features; a 1-d gradient is one column)."""
    return gradient.shape[-1] if gradient.dim() > 1 and gradient.shape[-1] > 0 else 1


def count_alone(gradient: torch.Tensor, by_column: bool = True) -> torch.Tensor:
    """One gradient's row (float64, on its device; ``by_column``: with its sinking columns' zeros, else 0)."""
    magnitude = gradient.detach().reshape(-1).float().abs()
    code = torch.bucketize(magnitude, _cuts(gradient.device))
    counts = torch.stack([torch.count_nonzero(code == index) for index in range(4)])
    kind = exact(gradient.device)
    norm = torch.linalg.vector_norm(magnitude).to(kind).reshape(1)
    peak = magnitude.amax().to(kind).reshape(1)
    table = magnitude.view(-1, columns(gradient))
    sinking = (
        torch.count_nonzero((table == 0) & (table.amax(0) <= SINKING))
        if by_column
        else torch.zeros((), dtype=torch.int64, device=gradient.device)
    )
    return torch.cat(
        [counts[:3].to(kind), counts.sum().to(kind).reshape(1), peak, norm * norm, sinking.to(kind).reshape(1)]
    )


def count_batch(gradients: list[torch.Tensor], by_column: bool = True) -> torch.Tensor:
    """The rows of gradients of one device (``len(gradients) x ROW``, float64): a dozen passes over their values
    in float32, whatever their number (``by_column``: and their sinking columns', a few more; else 0 there)."""
    sizes = [g.numel() for g in gradients]
    device = gradients[0].device
    count, total = len(gradients), sum(sizes)
    magnitude = torch.cat([g.reshape(-1) for g in gradients]).float().abs()
    first = [0]
    for size in sizes[:-1]:
        first.append(first[-1] + size)
    # each value's gradient (segment): 1 where a gradient begins, summed along
    marks = torch.zeros(total, dtype=torch.int64, device=device)
    marks[_to(torch.tensor(first[1:], dtype=torch.int64), device)] = 1
    segment = marks.cumsum_(0)
    code = segment * 5 + torch.bucketize(magnitude, _cuts(device))  # (the segment's row, five counts a row)
    counts = torch.zeros(count * 5, dtype=torch.int64, device=device)
    counts.index_add_(0, code, torch.ones(1, dtype=torch.int64, device=device).expand(total))
    counts = counts.view(count, 5)
    peak = torch.zeros(count, device=device).scatter_reduce_(0, segment, magnitude, "amax")
    energy = torch.zeros(count, device=device).index_add_(0, segment, magnitude.square())
    sinking = _sinking(gradients, magnitude, segment, first) if by_column else torch.zeros_like(peak)
    rows = [counts[:, :3], counts[:, :4].sum(1, keepdim=True), peak.unsqueeze(1), energy.unsqueeze(1)]
    return torch.cat([*rows, sinking.unsqueeze(1)], dim=1).to(exact(device))


def _sinking(
    gradients: list[torch.Tensor], magnitude: torch.Tensor, segment: torch.Tensor, first: list[int]
) -> torch.Tensor:
    """Per gradient, the zeros of its sinking columns (:data:`SINKING`); ``segment``: each value's gradient."""
    device = magnitude.device
    widths = [columns(g) for g in gradients]
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)
    per_gradient = _to(torch.tensor([first, widths, offsets[:-1]], dtype=torch.int64), device)
    start, width, offset = per_gradient[:, segment]
    # each value's column, numbered across the batch: its position in its gradient modulo the gradient's width
    column = (torch.arange(magnitude.numel(), device=device) - start) % width + offset
    zeros = torch.zeros(offsets[-1], dtype=torch.int64, device=device).index_add_(0, column, (magnitude == 0).long())
    column_peak = torch.zeros(offsets[-1], device=device).scatter_reduce_(0, column, magnitude, "amax")
    owner = torch.zeros(offsets[-1], dtype=torch.int64, device=device)
    owner[_to(torch.tensor(offsets[1:-1], dtype=torch.int64), device)] = 1
    owner = owner.cumsum_(0)
    sinking = torch.zeros(len(gradients), dtype=torch.int64, device=device)
    return sinking.index_add_(0, owner, zeros * (column_peak <= SINKING)).float()


def exact(device: torch.device) -> torch.dtype:
    """The dtype rows travel in: float64, float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


class Gradients:
    """The gradients of one sample, as rows on the device; :attr:`entries` says whose each row is."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.names: dict[int, str] = {}  # slot -> the module's qualified name
        self.counted = False  # a float16 gradient was added
        self._unfinished: set[int] = set()  # backward passes whose entries hold nodes, not known to have completed
        self._waiting: dict[tuple[torch.device, bool], tuple[list[int], list[torch.Tensor], list[int]]] = {}
        self._rows: list[tuple[list[int], torch.Tensor]] = []  # (entry indices, their rows)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(
        self, slot: int, node: Any, gradient: torch.Tensor, counted: bool, parameter: bool = False, task: int = -1
    ) -> None:
        """Count ``gradient`` (dense, floating, with values) in ``slot``'s module; ``node``: the node it reached in
        backward pass ``task`` (None: a parameter's gradient, counted after the backward pass)."""
        index, size = len(self.entries), gradient.numel()
        self.counted = self.counted or counted
        self.entries.append(Entry(slot, node, counted, size, parameter, task))
        if node is not None:
            self._unfinished.add(task)
        if size >= ALONE_VALUES:
            self._rows.append(([index], count_alone(gradient, by_column=not parameter).unsqueeze(0)))
            return
        key = (gradient.device, not parameter)  # (a batch a device for outputs, one for parameters: by column)
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = ([], [], [0])
        waiting[0].append(index)
        waiting[1].append(gradient.detach())  # (held until its batch is counted: a few megabytes at most)
        waiting[2][0] += size
        if waiting[2][0] >= BATCH_VALUES:
            self._flush(key)

    def _flush(self, key: tuple[torch.device, bool]) -> None:
        indices, gradients, _ = self._waiting.pop(key)
        self._rows.append((indices, count_batch(gradients, by_column=key[1])))

    def finished(self, task: int) -> None:
        """Backward pass ``task`` completed: its nodes ran, their saved tensors are freed; its entries keep them."""
        self._unfinished.discard(task)

    def let_go_of_unfinished(self) -> None:
        """Entries of backward passes that did not complete (raised midway: an out-of-memory retry) let go of their
        nodes, which still hold the saved tensors of the nodes below them: their all-zero gradients are then
        judged by the step alone."""
        if self._unfinished:
            self.entries = [
                entry._replace(node=None) if entry.node is not None and entry.task in self._unfinished else entry
                for entry in self.entries
            ]
            self._unfinished = set()

    def count_now(self) -> None:
        """Count the gradients waiting in batches (before their tensors change: the scaler unscales the parameters'
        gradients in place). No read."""
        for key in list(self._waiting):
            self._flush(key)

    def rows(self, device: torch.device | None = None) -> tuple[list[int], torch.Tensor]:
        """Every row (on ``device``, else the first's: copies without a synchronisation) and the index of the
        entry each row is of. No read."""
        self.count_now()
        if not self._rows:
            where = torch.device(device or "cpu")
            return [], torch.zeros(0, ROW, dtype=exact(where), device=where)
        target = device if device is not None else self._rows[0][1].device
        order = [index for indices, _ in self._rows for index in indices]
        pieces = [rows if rows.device == target else rows.to(target, non_blocking=True) for _, rows in self._rows]
        return order, torch.cat(pieces)

    @property
    def device(self) -> torch.device | None:
        """The device of the first gradient counted (None: none was)."""
        for _, rows in self._rows:
            return rows.device
        for device, _ in self._waiting:
            return device
        return None
