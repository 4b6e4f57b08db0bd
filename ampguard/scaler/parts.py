"""What every part of a SafeGradScaler may read of it: the one object's state, declared once.

SafeGradScaler is one object made of parts, one file each (the scale policy,
device-mode and host-mode bookkeeping, checkpoints, the classic crashes,
gradient accumulation): each part is a class whose methods use ``self``, so
the state stays the scaler's own, as in torch's ``GradScaler``. The parts
derive from :class:`ScalerParts`, which declares that state for type checkers
(at run time it is ``object``: the attributes are set by SafeGradScaler and
torch's ``GradScaler``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ampguard.scaler.counters import Counters
    from ampguard.scaler.handle import ScalerHandle
    from ampguard.scaler.iteration import Iteration
    from ampguard.scaler.live import TorchGradScaler as _Torch
    from ampguard.scaler.settings import Settings
else:
    _Torch = object


class ScalerParts(_Torch):
    """The state of a SafeGradScaler its parts share (besides torch's own attributes)."""

    _settings: Settings
    _counters: Counters  # what it counts and mirrors on the host
    _iteration: Iteration  # the iteration in progress
    _handle: ScalerHandle  # what the features hold of it: the listeners hear it, never the scaler
    _min_scale: float
    _max_scale: float
    # The host replay of the scale update is exact for torch's update(); a subclass whose update() differs
    # (ShardedGradScaler) sets this False and always keeps its bookkeeping on the device.
    _host_mirror_exact: ClassVar[bool] = True
    _torch_updated: bool  # update() ran torch's update in this call

    if TYPE_CHECKING:

        def _ampguard_setup(self, settings: Settings) -> None: ...  # SafeGradScaler's: its state made anew
        def _new_handle(self) -> None: ...  # SafeGradScaler's: its handle made anew
