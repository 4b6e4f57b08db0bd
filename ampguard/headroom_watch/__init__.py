"""The headroom watch: every AMPGUARD_WATCH_EVERY steps, each module's float16 peak, seen before it overflows.

- ``watch``: :class:`~ampguard.headroom_watch.watch.HeadroomWatch`: the schedule, the end of a watched pass (its
  sighting), and which module a sudden overflow is blamed on.
- ``watched_pass``: :class:`~ampguard.headroom_watch.watched_pass.WatchedPass`: the module hooks of a watched
  iteration, its stack of module calls, the dispatch mode entered with the model, each module's samples.
- ``observer``: the dispatch mode of a watched pass: which op outputs are measured (not memory no op wrote), and
  where the watch steps aside (compiled code, higher-order operators).
- ``sighting``: one watched iteration's peaks and verdict, on the device (sentinels are not peaks); a module's
  samples folded every 32 op outputs.
- ``calls``: which module calls of a watched pass still run (a forward ended by Ctrl-C is found at the next call),
  and the line said for calls in other threads, which are not watched.

:mod:`ampguard.fp32_islands` consumes the verdicts (``watch_verdicts``: an island before an overflow, or the module
blamed at the first one); docs/islands.md describes the behaviour.
"""
