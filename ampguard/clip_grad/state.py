"""What one application of the clip_grad patch set up, read on every clip call: torch's functions, the guard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from ampguard.log import RateLimiter

SKIP_LOG_INTERVAL = 60.0  # seconds between two "step skipped" warnings


class ClipState:
    """What the clip patch set up when it was applied (a new one each apply): plain attributes, read every call.

    The wrappers torch's names are bound to ask their :class:`ClipOwner` for it
    at each call: None (the patch reverted) means torch's function, unchanged.
    """

    def __init__(
        self,
        original: Callable[..., Tensor],
        *,
        guard: bool,
        deprecation: tuple[type[Warning], str] | None = None,
        stats_every: int = 0,
        halves: tuple[Callable[..., Tensor], Callable[..., None]] | None = None,
    ) -> None:
        self.original = original  # torch's clip_grad_norm_
        # torch's get_total_norm and clip_grads_with_norm_ (>= 2.6), unwrapped: what its clip_grad_norm_ calls.
        self.halves = halves
        self.deprecation = deprecation  # what torch's clip_grad_norm warns
        # The no-scaler guard: on only when the grad_scaler patch is applied, so
        # that every GradScaler is a SafeGradScaler and "none in
        # scalers_in_iteration" means "no loss was scaled".
        self.guard = guard
        self.foreign_scaler = False
        self.skip_log = RateLimiter(SKIP_LOG_INTERVAL)
        self.warned_ambiguous = False
        # bf16/fp32 training has no scaler, hence no scaler stats line: the
        # guard logs its own every `stats_every` calls (AMPGUARD_STATS_EVERY).
        self.stats_every = stats_every
        self.guarded_calls = 0  # since the patch was applied: the guard's "whole run"
        self.guarded_skipped = 0  # of those, the steps it skipped
        self.skipped_at_last_line = 0  # guarded_skipped when its previous stats line was logged

    def guard_active(self) -> bool:
        """Whether a non-finite norm with no scaler in play skips the step right now."""
        return self.guard and not self.foreign_scaler

    def guard_stats_line(self) -> str:
        """The no-scaler guard's stats line, each figure under the words that say what it counts, as in a scaler's.

        ``stats clip_calls=1000 | this interval: clip_skipped=0 of 500 calls | whole run: clip_skipped=2 (0.20% of
        1000 calls)``: "this interval" is the guarded calls since the previous line, "whole run" every guarded
        call since the patch was applied. Called once an interval; the next interval starts here.
        """
        calls, skipped = self.guarded_calls, self.guarded_skipped
        in_interval = skipped - self.skipped_at_last_line
        interval_calls = self.stats_every if self.stats_every and calls >= self.stats_every else calls
        self.skipped_at_last_line = skipped
        share = 100.0 * skipped / calls if calls else 0.0
        return (
            f"stats clip_calls={calls} | this interval: clip_skipped={in_interval} of {interval_calls} calls "
            f"| whole run: clip_skipped={skipped} ({share:.2f}% of {calls} calls)"
        )


class ClipOwner(Protocol):
    """What a wrapper is built with: the clip_grad patch, whose ``clip`` is its current application's state."""

    clip: ClipState | None
