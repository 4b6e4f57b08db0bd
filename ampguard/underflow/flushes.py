"""Whether a gradient was flushed, passed down the autograd graph during a sampled backward pass.

An all-zero float16 gradient is lost whole when a gradient it was computed from
was flushed (:func:`ampguard.underflow.counts.passed_on`), a true zero
otherwise. The node hooks of the sample (:mod:`ampguard.underflow.measure`)
learn it here: :meth:`Flushes.fed` before counting a node's incoming gradients,
:meth:`Flushes.pass_on` after, to the nodes its gradients go to. The flags stay
device booleans (no read); a node's ``metadata`` holds ``(session, cell)``, and
the cell holds the flag only while the sample lasts (:meth:`Flushes.clear`), so
nothing stays on a node a model keeps alive (a parameter's accumulator).
"""

from __future__ import annotations

from typing import Any

import torch

import ampguard.underflow.nodes as node_kinds
from ampguard.underflow.counts import on


class Flushes:
    """The flags one sampler passed down, keyed in node metadata by ``key``, valid for one session at a time."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._session = -1
        self._cells: list[list[torch.Tensor]] = []

    def fed(self, node: Any, session: int) -> torch.Tensor | bool:
        """Whether a gradient ``node``'s incoming gradient was computed from was flushed (False: none was passed
        on to it in this session)."""
        entry = node.metadata.get(self.key) if node is not None else None
        if entry is None or entry[0] != session or self._session != session or not entry[1]:
            return False
        fed: torch.Tensor = entry[1][0]
        return fed

    def pass_on(self, node: Any, session: int, passes: torch.Tensor) -> None:
        """``passes`` to the nodes ``node``'s outputs feed, through views (not hooked: their gradient is their
        base's); a node fed by several is flushed-fed if one of them was."""
        if self._session != session:
            self._session, self._cells = session, []
        stack, seen = [next_node for next_node, _ in node.next_functions], set()
        while stack:
            child = stack.pop()
            if child is None or child in seen:
                continue
            seen.add(child)
            if type(child).__name__ in node_kinds.SAME_VALUES:
                stack.extend(next_node for next_node, _ in child.next_functions)
            elif node_kinds.counted(child):  # (not a float32 leaf's accumulator: nothing is computed from its gradient)
                entry = child.metadata.get(self.key)
                if entry is not None and entry[0] == session and entry[1]:
                    cell = entry[1]
                    cell[0] = cell[0] | on(passes, cell[0].device)
                else:
                    cell = [passes]
                    self._cells.append(cell)
                    child.metadata[self.key] = (session, cell)

    def clear(self) -> None:
        """The sample ended: the cells let go of their flags (the nodes keep empty cells)."""
        for cell in self._cells:
            cell.clear()
        self._session, self._cells = -1, []
