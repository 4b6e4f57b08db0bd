"""The scheduler_hold patch: an LR scheduler does not advance on an optimizer step the GradScaler skipped.

- ``patch``: the wrapping of ``LRScheduler.step`` (and torch's "step() before optimizer.step()" warning).
- ``hold``: which optimizer steps were skipped, and the scheduler steps held for them.

docs/schedulers.md describes the behaviour.
"""
