"""What a feature holds of a SafeGradScaler: :class:`ScalerHandle`, never the scaler itself.

The step listeners (:mod:`ampguard.scaler.listeners`) receive a scaler's handle
with every event. It is the key a feature keeps its per-scaler state under
(``weakref.WeakKeyDictionary``, ``weakref.finalize``, ``id()``), it reads the
scaler through :meth:`ScalerHandle.view` and :attr:`ScalerHandle.steps`, and it
asks for a change through the requests the scaler answers publicly
(:meth:`ScalerHandle.grow_now`, :meth:`ScalerHandle.skip_step_if`).

**Lifetime.** A scaler makes its handle once (``_ampguard_setup``, or a new one
for an unpickled or deep-copied scaler) and keeps it; the handle holds only a
weak reference to it. Nothing else holds a handle strongly (features keep it
in weak structures), so it goes with its scaler, and so do the features'
entries keyed by it. A handle is never pickled or copied: a copy of a scaler
gets its own, and features' state for the copy is the copy's own.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, NoReturn

from ampguard.scaler.view import ScalerView

if TYPE_CHECKING:
    import torch

    from ampguard.scaler.counters import Counters
    from ampguard.scaler.safe import SafeGradScaler


class ScalerHandle:
    """One SafeGradScaler as a feature sees it: read-only views and requests, no attribute of the scaler.

    Hashable and compared by identity (one handle per scaler), weak-referenceable.
    A handle whose scaler is gone (held strongly past it, against the rule above)
    answers harmlessly: :attr:`steps` the last count, :meth:`view` a view with no
    scale and ``scale_given`` set (nothing to act on), and the requests do
    nothing (:meth:`grow_now` returns None).
    """

    __slots__ = ("__weakref__", "_counters", "_scaler")

    def __init__(self, scaler: SafeGradScaler, counters: Counters) -> None:
        """``counters``: the scaler's host counters, which it keeps for its life (one that makes new counters
        makes a new handle)."""
        self._scaler = weakref.ref(scaler)
        self._counters = counters

    @property
    def steps(self) -> int:
        """The optimizer steps requested through the scaler's ``step()`` (as ``view().steps``, without making
        a view)."""
        return self._counters.steps

    def view(self) -> ScalerView:
        """What may be read of the scaler now (no device read): :meth:`SafeGradScaler.view`."""
        scaler = self._scaler()
        if scaler is None:
            return ScalerView(
                steps=self._counters.steps,
                scale=None,
                last_skipped=None,
                scale_given=True,
                growth_factor=1.0,
                backoff_factor=1.0,
                max_scale=0.0,
                device="",
                scale_on_device=None,
            )
        return scaler.view()

    def grow_now(self, below: float = float("inf")) -> float | None:
        """Ask the scaler to grow its scale now, below ``below``: :meth:`SafeGradScaler.grow_now
        <ampguard.scaler.policy.ScalePolicy.grow_now>` (its answer). None, and nothing done, when it is gone."""
        scaler = self._scaler()
        return scaler.grow_now(below=below) if scaler is not None else None

    def skip_step_if(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        """Ask the scaler to skip ``optimizer``'s next step when ``flag`` (on the device) is 1:
        :meth:`SafeGradScaler.skip_step_if`. Nothing when it is gone."""
        scaler = self._scaler()
        if scaler is not None:
            scaler.skip_step_if(optimizer, flag)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("a ScalerHandle is neither pickled nor copied: a copy of its scaler makes its own")

    def __repr__(self) -> str:
        return f"<ScalerHandle of step {self._counters.steps}{'' if self._scaler() is not None else ', scaler gone'}>"
