"""DeepSpeed's fp16 dynamic loss scaling under ampguard's policy (patch ``deepspeed_fp16``; docs/deepspeed.md).

- ``patch``: the patch, applied when DeepSpeed is imported (before or after ampguard), and its version gate.
- ``hooks``: the replacements of DeepSpeed's loss-scale methods: a safe start, a floor and cap, no "Exiting run".
- ``tracking``: the counts per DeepSpeed scaler, its stats line, the collapse and stall reports.
"""
