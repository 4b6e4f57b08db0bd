"""What the headroom watch's sightings decide: an island before an overflow, or the module blamed at the first one.

:mod:`ampguard.headroom_watch` watches; :mod:`ampguard.fp32_islands.healing`
calls :func:`judge` at each update where the watch has something to say, or a
forward overflow came. Islands are made (or, in report mode, named) by
:meth:`ampguard.fp32_islands.islands.Islands.decide`, with the watch's own messages.
"""

from __future__ import annotations

import ampguard.messages as messages
from ampguard.fp32_islands.islands import Islands
from ampguard.headroom_watch.sighting import FLOAT16_MAX
from ampguard.headroom_watch.watch import HeadroomWatch


def judge(
    islands: Islands,
    watch: HeadroomWatch,
    step: int,
    overflow: bool,
    verdict: int,
    mode: str,
    max_islands: int,
    may_blame: bool,
    watched_overflow: bool | None = None,
) -> bool:
    """One update's verdict; True when a forward overflow was blamed on a module (an island made for it).

    ``verdict``: the watch's, as read with the scaler's read (0: none, or not
    read in this update). Without a forward overflow, a verdict makes its
    module an island before it overflows (its peak, for the message, comes with
    the verdict's host copy: no read). At a forward overflow (``may_blame``: the probe is not armed and
    islands may still be made), the module the last watch saw closest to the
    limit is made one, when it was close enough (:meth:`HeadroomWatch.suspect`);
    the probe stays the fallback. ``watched_overflow``: whether
    the watched iteration itself overflowed, when it is not this update's (device
    mode, where one read covers many iterations).
    """
    sighting = watch.settle(overflow if watched_overflow is None else watched_overflow)
    if overflow:
        if not may_blame:
            return False
        suspect = watch.suspect()
        if suspect is None:
            return False
        (module, root, outputs), peak, seen = suspect
        made = islands.decide(
            module, root, outputs, step=step, mode=mode, max_islands=max_islands,
            made=messages.ISLAND_BLAMED, reported=messages.ISLAND_BLAMED_REPORT, peak=peak, seen=seen,
        )  # fmt: skip
        if made:  # not seen to overflow: taken back if the next module named is another
            islands.mark_blamed(module)
        return made
    found = sighting.candidate(verdict - 1) if sighting is not None and sighting.clean and verdict else None
    if sighting is not None and found is not None:
        module, root, outputs = found
        if sighting.shown is None:
            sighting.read_verdict()
        peak = sighting.verdict_peak
        islands.decide(
            module, root, outputs, step=sighting.step, mode=mode, max_islands=max_islands,
            made=messages.ISLAND_AHEAD, reported=messages.ISLAND_AHEAD_REPORT, limited=messages.ISLAND_AHEAD_LIMIT,
            peak=peak, share=peak / FLOAT16_MAX, headroom=watch.headroom,
        )  # fmt: skip
    return False
