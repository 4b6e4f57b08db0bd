"""Removing the master weights' optimizer step hooks, also from inside a step.

torch iterates an optimizer's step hooks (the global ones, then its own) while it
steps. An uninstall called from one of them (a user's hook, or ampguard giving up
on an optimizer) must not remove a hook from the dict torch is iterating: that
raises "OrderedDict mutated during iteration" into the user's step. Such removals
wait for the step to end: the wrapper of every hooked step
(:func:`ampguard.master_weights.step.put_back_on_error`) calls :func:`steps_ended`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampguard.master_weights.records import MasterWeights


def remove_hook(masters: MasterWeights | None, handle: Any) -> None:
    """``handle.remove()`` now, or when the steps running now have ended."""
    if masters is not None and masters.step_depth:
        masters.removals_after_step.append(handle)
    else:
        handle.remove()


def steps_ended(masters: MasterWeights) -> None:
    """The removals that waited for the steps to end."""
    removals, masters.removals_after_step = masters.removals_after_step, []
    for handle in removals:
        handle.remove()
