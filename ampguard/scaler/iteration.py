"""What a scaler knows about the iteration in progress, from its first ``scale()`` to ``update()``.

A SafeGradScaler holds one :class:`Iteration` and replaces it with a fresh one
when ``update()`` ends the iteration; a pickled scaler leaves it out
(:mod:`~ampguard.scaler.checkpoint`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class Iteration:
    """The per-iteration state of a SafeGradScaler."""

    __slots__ = (
        "fields",
        "host_found",
        "loss_check",
        "loss_nonfinite",
        "optimizers",
        "scale_given",
        "scale_read",
        "scaling_thread",
        "unscaled_optimizers",
    )

    def __init__(self) -> None:
        # loss - loss of every loss scale()d this iteration, summed: 0 while all were finite, NaN otherwise.
        self.loss_check: torch.Tensor | None = None
        # id(optimizer) -> its found_inf, as step()'s one host read gave it (host mode).
        self.host_found: dict[int, bool] = {}
        # id(optimizer) -> the optimizer, for each one step() was called with.
        self.optimizers: dict[int, Any] = {}
        # Each listener's field of those reads, the largest (ampguard.scaler.listeners).
        self.fields: dict[Any, int] = {}
        # Optimizers unscale_()d since the last scale() (ampguard.scaler.accumulation, the clip patch).
        self.unscaled_optimizers: list[Any] = []
        # That host read also said the loss itself was inf/NaN (a forward overflow).
        self.loss_nonfinite = False
        # update(new_scale) is ending the iteration: the caller sets the scale (no capability grows it).
        self.scale_given = False
        # get_scale() read after scale(): clip thresholds may be scaled ones (ampguard.clip_grad.norm).
        self.scale_read = False
        # The thread that called scale(): clip_grad_norm_ in a thread looks at that thread's scalers.
        self.scaling_thread: int | None = None

    def note_loss(self, outputs: Any) -> None:
        """At ``scale(outputs)``: the calling thread, and the loss check of ``outputs`` added to the iteration's."""
        self.scaling_thread = threading.get_ident()
        check: torch.Tensor | None
        if isinstance(outputs, torch.Tensor):  # (loss_check's first case, inlined: every scale())
            with torch.no_grad():
                difference = outputs - outputs
                check = difference.sum() if difference.dim() else difference
        else:
            check = loss_check(outputs)
        if check is not None:
            self.loss_check = check if self.loss_check is None else self.loss_check + check.to(self.loss_check.device)


def loss_check(outputs: Any) -> torch.Tensor | None:
    """``loss - loss`` summed over every tensor of ``outputs`` (nested lists and tuples, as ``scale()`` takes).

    0 while every loss is finite, NaN otherwise; one kernel per loss
    (``torch.isfinite(...).all()`` is five; no ``detach()`` either, under no_grad).
    None when there is no tensor, or ``outputs`` is another iterable, which
    ``scale()`` maps lazily.
    """
    if isinstance(outputs, torch.Tensor):
        with torch.no_grad():
            check = outputs - outputs
            return check.sum() if check.dim() else check
    if not isinstance(outputs, (list, tuple)):
        return None
    total: torch.Tensor | None = None
    for item in outputs:
        item_check = loss_check(item)
        if item_check is not None:
            total = item_check if total is None else total + item_check.to(total.device)
    return total
