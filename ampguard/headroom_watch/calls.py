"""The module calls of a watched pass: which are still running, and what the watch says where it does not follow.

torch calls an ``always_call`` forward hook when a forward raises an
``Exception``, not a ``KeyboardInterrupt`` (Ctrl-C in a notebook), a
``SystemExit`` or a ``GeneratorExit``: the calls such an exception went
through stay on the watch's stack, and its dispatch mode stays pushed. Each
call on the stack holds torch's frame running it; a module called later looks
for the innermost one among its callers (a few frames up when it is running):
:func:`live_depth`.
"""

from __future__ import annotations

from typing import Any

INTERRUPTED = (
    "headroom watch: a watched forward pass ended in an exception its module hooks never see (KeyboardInterrupt, "
    "SystemExit): the watch stopped there, at the next module call, its samples of this iteration are dropped, and "
    "it watches again when next due."
)
OTHER_THREAD = (
    "headroom watch: `%s` runs in thread %r, not in the thread that trains (the one calling scaler.update()): "
    "forward passes in other threads (nn.DataParallel's replicas, a model called from a worker thread) are not "
    "watched, since the watch's dispatch mode and module stack belong to one thread. Training there is as without "
    "the watch; forward overflows are still found by the probe."
)


def live_depth(calls: list[Any], frame: Any) -> int:
    """How many of ``calls`` (outermost first, each with its frame in ``.call``) still run below ``frame``."""
    innermost, live = calls[-1].call, set()
    while frame is not None:
        if frame is innermost:
            return len(calls)  # the usual case, a few frames up
        live.add(id(frame))  # (the calls' frames are held, so no live frame has the id of one of them)
        frame = frame.f_back
    depth = len(calls)
    while depth and id(calls[depth - 1].call) not in live:
        depth -= 1
    return depth
