"""Where the NaN came from: called by SafeGradScaler on skipped steps only (nothing runs on healthy steps)."""

from __future__ import annotations

from typing import Any

from ampguard.log import logger


def on_skipped_step(scaler: Any, optimizer: Any, *, loss_nonfinite: bool, step: int) -> None:
    """Explain a step the scaler skipped: forward or backward overflow."""
    where = "the loss itself was inf/NaN (forward overflow)" if loss_nonfinite else "gradients held inf/NaN (backward overflow)"
    logger.debug("step %d skipped: %s", step, where)
