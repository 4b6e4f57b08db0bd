"""The clip_grad patch: torch's clipping functions act on unscaled gradients, with float32 norms.

- ``patch``: what is wrapped (``clip_grad_norm_`` and its other names, ``clip_grad_value_``,
  ``get_total_norm``, ``clip_grads_with_norm_``, the deprecated ``clip_grad_norm``).
- ``norm``: ``clip_grad_norm_`` made safe (the recipe's case first: torch's clip with float32 norms), and the
  wrappers torch's names are bound to.
- ``no_scaler``: the guard for bf16/fp32 training: no GradScaler in play, an inf/NaN norm skips the step.
- ``api``: the rest of the clipping API (``clip_grad_value_``, ``get_total_norm``, ``clip_grads_with_norm_``).
- ``scalers``: which GradScalers scaled a loss, which optimizers they unscaled, the scale to divide by.
- ``kernels``: torch's algorithm (grouping, per-tensor norms, the coefficient), with float32 norms.
- ``wrapping``: the wrapt wrapper that survives torch.compile, copy and pickle; failures fall back to torch.
- ``state``: what the patch set up, read on every call.

docs/clipping.md describes the behaviour.
"""
