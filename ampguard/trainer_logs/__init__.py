"""The trainer_logs patch: ampguard's numbers in the trainers' own records, and the trainers' skip detection.

- ``patch``: the patch itself (post-import hooks; nothing is imported that the script did not import).
- ``attach``: which module of which library means that trainer runs, and attaching each integration.
- ``coqui``, ``hf``, ``lightning``: the stats in the coqui trainer's log file, the HF Trainer's log_history,
  Lightning's loggers.
- ``accelerate``: accelerate's ``optimizer_step_was_skipped`` sees the steps ampguard skipped.

docs/trainer-logs.md describes the behaviour.
"""
