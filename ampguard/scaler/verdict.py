"""What one ``update()`` decided: :class:`StepVerdict`, made once per iteration, counted by one path.

Host mode makes it at the update, from torch's one read in ``step()``; device
mode (fused optimizers) makes one per row of its ledger when the rows are read
(:mod:`ampguard.scaler.ledger`). Both hand it to
:meth:`~ampguard.scaler.policy.ScalePolicy._count`, so the two modes cannot
count differently; listeners of host-mode updates receive it
(:mod:`ampguard.scaler.listeners`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepVerdict:
    """One iteration's verdict, on the host.

    ``forward_overflow``: the gradients overflowed while a loss itself was inf/NaN (agreed between ranks): the
    scale was not the cause and is kept (:func:`ampguard.scaler.policy.forward_overflow`). ``scale_before``: the
    scale the iteration ran at; ``scale``: the scale after it, within the floor and cap.
    """

    found_inf: bool  # an optimizer found inf/NaN gradients
    skipped_steps: int  # optimizer steps skipped
    loss_nonfinite: bool  # a loss of this rank was inf/NaN
    forward_overflow: bool
    scale_before: float
    scale: float
