"""The underflow patch: how much of float16's gradient traffic the loss scale loses, and a scale that follows.

- ``measure``: the sampled step's hooks (:class:`~ampguard.underflow.measure.Sampler`).
- ``counts``: what they count, on the device and on the host (:class:`~ampguard.underflow.counts.Measurement`).
- ``policy``: when measured underflow grows the scale (:func:`~ampguard.underflow.policy.decide`).
- ``listener``: the SafeGradScaler step listener that samples, decides and reports.
- ``checkpoint``: its per-scaler state in ``state_dict()["ampguard"]``, pickles and deep copies.
- ``patch``: ``AMPGUARD_UNDERFLOW=adapt|report|off``.

docs/underflow.md describes the behaviour and the numbers behind the thresholds.
"""
