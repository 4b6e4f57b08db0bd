"""Review 23: rows known on the host without a sync (ampguard.scaler.row_copies), judged against what happened."""

from __future__ import annotations

import logging

import pytest
from islands_support import fresh_islands  # noqa: F401  (fixture)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from test_islands_fused import reads_by_step
from test_row_copies import rows_one_update_late  # noqa: F401  (fixture)

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_islands"), needs_fused_adam]


@pytest.mark.usefixtures("rows_one_update_late")
def test_review23_an_overflow_the_probe_read_is_not_learned_again_from_its_row_one_update_later(ampguard_log):
    """Rows known one update late (a GPU's copies, mocked as in test_row_copies): the overflow at step 20 that the
    armed probe read itself and turned into the island is told again by its row at step 21, as an overflow nobody
    saw: the probe arms again (a read at each of steps 22..40) although nothing overflows any more."""
    reads_at, _torch_reads, islands = reads_by_step(40)
    assert islands == ("blocks.1.attn",)
    armed = records(ampguard_log, logging.INFO, "forward overflow in the step learned at step")
    assert len(armed) == 1, [r.getMessage()[:60] for r in armed]
    assert reads_at == {step: 1 for step in range(12, 21)}  # ampguard: also one at each of steps 22..40
