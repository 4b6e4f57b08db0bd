"""The clip_grad patch's current state, for tests that read or adjust it."""

from __future__ import annotations

from ampguard.clip_grad.state import ClipState
from ampguard.registry import applied_patch


def clip_state() -> ClipState:
    """The state of the clip_grad patch as applied now (a new one after each install)."""
    patch = applied_patch("clip_grad")
    state = getattr(patch, "clip", None)
    assert isinstance(state, ClipState), "the clip_grad patch is applied"
    return state
