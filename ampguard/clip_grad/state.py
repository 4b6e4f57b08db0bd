"""What the clip_grad patch set up, read on every call: on or off, torch's function, the no-scaler guard."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ampguard.log import RateLimiter

SKIP_LOG_INTERVAL = 60.0  # seconds between two "step skipped" warnings


class _State:
    """What the clip patch set up: read on every call, so plain attributes."""

    def __init__(self) -> None:
        self.active = False
        self.original: Callable[..., Tensor] | None = None  # torch's clip_grad_norm_
        # torch's get_total_norm and clip_grads_with_norm_ (>= 2.6), unwrapped: what its clip_grad_norm_ calls.
        self.halves: tuple[Callable[..., Tensor], Callable[..., None]] | None = None
        self.deprecation: tuple[type[Warning], str] | None = None  # what torch's clip_grad_norm warns
        # The no-scaler guard: on only when the grad_scaler patch is applied, so
        # that every GradScaler is a SafeGradScaler and "none in
        # scalers_in_iteration" means "no loss was scaled".
        self.guard = False
        self.foreign_scaler = False
        self.skip_log = RateLimiter(SKIP_LOG_INTERVAL)
        self.warned_ambiguous = False
        # bf16/fp32 training has no scaler, hence no scaler stats line: the
        # guard logs its own every `stats_every` calls (AMPGUARD_STATS_EVERY).
        self.stats_every = 0
        self.guarded_calls = 0  # since activate(): the guard's "whole run"
        self.guarded_skipped = 0  # of those, the steps it skipped
        self.skipped_at_last_line = 0  # guarded_skipped when its previous stats line was logged


state = _State()


def activate(
    original: Callable[..., Tensor],
    *,
    guard: bool,
    deprecation: tuple[type[Warning], str] | None = None,
    stats_every: int = 0,
    halves: tuple[Callable[..., Tensor], Callable[..., None]] | None = None,
) -> None:
    """Turn the safe clip on (called by the clip_grad patch with torch's ``clip_grad_norm_``)."""
    state.active = True
    state.stats_every = stats_every
    state.guarded_calls = 0
    state.guarded_skipped = 0
    state.skipped_at_last_line = 0
    state.original = original
    state.halves = halves
    state.deprecation = deprecation
    state.guard = guard
    state.foreign_scaler = False
    state.skip_log = RateLimiter(SKIP_LOG_INTERVAL)
    state.warned_ambiguous = False


def guard_stats_line() -> str:
    """The no-scaler guard's stats line, each figure under the words that say what it counts, as in a scaler's.

    ``stats clip_calls=1000 | this interval: clip_skipped=0 of 500 calls | whole run: clip_skipped=2 (0.20% of
    1000 calls)``: "this interval" is the guarded calls since the previous line, "whole run" every guarded call
    since ampguard was installed. Called once an interval; the next interval starts here.
    """
    calls, skipped = state.guarded_calls, state.guarded_skipped
    in_interval = skipped - state.skipped_at_last_line
    interval_calls = state.stats_every if state.stats_every and calls >= state.stats_every else calls
    state.skipped_at_last_line = skipped
    share = 100.0 * skipped / calls if calls else 0.0
    return (
        f"stats clip_calls={calls} | this interval: clip_skipped={in_interval} of {interval_calls} calls "
        f"| whole run: clip_skipped={skipped} ({share:.2f}% of {calls} calls)"
    )


def deactivate() -> None:
    """Turn it off: wrappers still held somewhere call torch's function unchanged."""
    state.active = False
    state.guard = False


def guard_active() -> bool:
    """Whether a non-finite norm with no scaler in play skips the step right now."""
    return state.active and state.guard and not state.foreign_scaler


def original_clip_grad_norm_() -> Callable[..., Tensor]:
    return state.original if state.original is not None else torch.nn.utils.clip_grad.clip_grad_norm_
