"""Which all-zero gradients of a sample were lost whole: those computed from a flushed one.

An all-zero float16 gradient is lost whole when a gradient it was computed from
was *flushed*: it held nonzero values but no normal one, or it was itself exact
zeros computed from a flushed one (the flush going on down the graph).
Otherwise its zeros are true zeros (a ``0.0 * aux_loss`` term, a zero LoRA
``B``), which float32 has too.

Judged on the host once a sample's rows are known
(:class:`~ampguard.underflow.counts.Transfer`), from the autograd nodes the
gradients reached: a walk down the graph from each flushed gradient's node,
through the nodes no gradient was counted at and those whose gradients were
all zero (or, float32 ones, below float16's normal range: what a float16
gradient is cast from passes the flush on), to the first gradient with a value
it could hold. No walk at all when no gradient was flushed (a healthy step).
"""

from __future__ import annotations

from typing import Any

from ampguard.underflow.gradients import SMALLEST_NORMAL, Entry


def lost_whole(entries: list[Entry], peaks: list[float]) -> tuple[set[int], set[int]]:
    """The indices of the all-zero float16 gradients lost whole (``peaks``: each entry's largest magnitude), and
    those of the gradients with a normal value that a flushed one fed (their all-zero columns are lost)."""
    flushed = [
        entry.node
        for entry, peak in zip(entries, peaks)
        if entry.counted and entry.node is not None and 0 < peak < SMALLEST_NORMAL
    ]
    lost: set[int] = set()
    fed: set[int] = set()
    if not flushed:
        return lost, fed
    by_node: dict[Any, list[int]] = {}
    for index, entry in enumerate(entries):
        if entry.node is not None:
            by_node.setdefault(entry.node, []).append(index)
    seen: set[Any] = set(flushed)
    stack = [following for node in flushed for following, _ in node.next_functions]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        indices = by_node.get(node)
        if indices:
            if any(peaks[i] >= SMALLEST_NORMAL for i in indices):
                fed.update(indices)
                continue  # a value float16 could hold: the flush ends there
            lost.update(i for i in indices if entries[i].counted and peaks[i] == 0)
            # (a float16 gradient with subnormal values is flushed itself, and walked from already)
        stack.extend(following for following, _ in node.next_functions)
    return lost, fed
