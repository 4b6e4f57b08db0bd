"""The no-scaler guard of ``clip_grad_norm_``: bf16/fp32 training (no GradScaler in play), where an inf/NaN norm
skips the step. One host read per call; the clipped parameters' ``.grad`` set to None make the optimizer change
neither the parameters nor its state (docs/clipping.md)."""

from __future__ import annotations

import logging
import math

from torch import Tensor

import ampguard.clip_grad.kernels as kernels
import ampguard.stats.summary as summary
from ampguard.clip_grad.state import ClipState
from ampguard.log import is_rank_zero, logger
from ampguard.stats.counters import process_counters

SKIPPED_STEP = (
    "clip_grad_norm_: the total gradient norm is {norm} and no GradScaler is in play (bf16/fp32 training): "
    "this optimizer step is skipped (the gradients of the {count} clipped parameters are set to None, "
    "so the optimizer changes neither the parameters nor its state). {total} step(s) skipped so far in this run "
    "(ampguard.stats.counters.process_counters.clip_skipped){suppressed}. Likely causes: a bad batch, a learning rate "
    "too high, an fp16 overflow in a model run without a GradScaler."
)


def clip(
    state: ClipState,
    pairs: list[tuple[Tensor, Tensor]],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> Tensor:
    """No loss was scaled (bf16 / fp32 training): a non-finite norm skips the step. One host read."""
    grads = [g for _, g in pairs]
    groups = kernels.groups(grads, foreach)
    total = kernels.total_norm(groups, norm_type)
    if error_if_nonfinite:
        kernels.raise_if_nonfinite(total, norm_type)  # torch's host read; finite from here on
        kernels.multiply_(groups, kernels.clip_coefficient(max_norm, total))
        return total
    # Queue the multiplication before reading, so that on a GPU it overlaps the read.
    kernels.multiply_(groups, kernels.clip_coefficient(max_norm, total))
    norm = float(total)
    if not math.isfinite(norm):
        _skip_step(state, pairs, norm)
    state.guarded_calls += 1
    if state.stats_every and state.guarded_calls % state.stats_every == 0:
        _log_guard_stats(state)
    return total


def _log_guard_stats(state: ClipState) -> None:
    if is_rank_zero() and logger.isEnabledFor(logging.INFO):
        logger.info("%s", state.guard_stats_line())


def _skip_step(state: ClipState, pairs: list[tuple[Tensor, Tensor]], norm: float) -> None:
    for param, _ in pairs:
        param.grad = None
    process_counters.clip_skipped += 1
    state.guarded_skipped += 1
    summary.arm()
    limiter = state.skip_log
    suppressed_before = limiter.suppressed
    if limiter.ready():
        suppressed = (
            f"; {suppressed_before} similar message(s) suppressed since the previous one" if suppressed_before else ""
        )
        limiter.suppressed = 0
        logger.warning(
            SKIPPED_STEP.format(norm=norm, count=len(pairs), total=process_counters.clip_skipped, suppressed=suppressed)
        )
