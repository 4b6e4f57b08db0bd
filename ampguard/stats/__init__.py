"""What ampguard counts and reports.

- ``counters``: :class:`ScalerStats` (what ``scaler.stats`` returns), :data:`process_counters` (what is counted
  outside any scaler) and the one-line stats record.
- ``file``: ``AMPGUARD_STATS_FILE``, the records as JSON lines.
- ``report``: reading such a file back (``ampguard report``).
- ``summary``: the one-line tally at exit.
"""

from ampguard.stats.counters import ProcessCounters, ScalerStats, log_stats, process_counters, stats_line

__all__ = ["ProcessCounters", "ScalerStats", "log_stats", "process_counters", "stats_line"]
