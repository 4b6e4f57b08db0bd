"""Review of the headroom watch with a fused optimizer (the scaler's device mode) on a GPU, the device mocked.

On CUDA the watch's summary reaches the host through a non-blocking copy and an event; a copy whose event is not
reached yet is read with a sync (``ampguard.syncs.HostCopy.values``). Device mode learns each iteration's ledger row from its own
host copy, queued *before* the watch's in ``update()``, and tells the listeners at the updates after.
"""

from __future__ import annotations

import pytest
import torch
from islands_support import batch, fresh_islands, make_net, train  # noqa: F401
from scaler_support import needs_fused_adam, one_thread  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


@needs_fused_adam
def test_mocked_cuda_fused_optimizer_healthy_watched_steps_add_no_host_read(reinstall, monkeypatch):
    """The watch's copy is modelled as a GPU's: not reached during the update that queued it, reached by the next.
    Torch reads nothing on the host with a fused optimizer; ampguard must not either. Today the update of the watched
    iteration tells the listeners the rows known so far, and ``after_stats_read`` decodes the pending verdict at once
    from a copy queued microseconds earlier: one sync per watch."""
    from ampguard import syncs
    from ampguard.headroom_watch import sighting as headroom

    reinstall(AMPGUARD_WATCH_EVERY="5")
    updates = [0]
    reads: list[int] = []

    class GpuEvent:
        def __init__(self) -> None:
            self.queued_at = updates[0]

        def query(self) -> bool:
            return updates[0] > self.queued_at  # the device reaches the copy after the update that queued it

    class GpuCopy(syncs.HostCopy):
        def __init__(self, tensor: torch.Tensor) -> None:
            super().__init__(tensor)
            self.event = GpuEvent()

    def read_to_host(tensor: torch.Tensor) -> list[float]:
        reads.append(updates[0])
        return list(tensor.tolist())

    monkeypatch.setattr(headroom, "HostCopy", GpuCopy)
    monkeypatch.setattr(syncs, "read_to_host", read_to_host)
    torch.manual_seed(0)
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def one_update_later(step: int) -> None:
        updates[0] += 1

    train(12, model=model, optimizer=optimizer, healthy=True, check_losses=False, after_update=one_update_later)
    assert reads == []  # healthy steps, watched ones included: no read torch does not make
