"""fp32 master weights for half-precision parameters: which tensors hold the gradients, the copies, the state.

A model loaded in float16 (``torch_dtype=torch.float16``, ``model.half()``)
cannot be trained by stepping its float16 weights: AdamW's ``eps`` and second
moment underflow (NaN after one step) and SGD's small updates round away.
apex O2, DeepSpeed, Megatron and fairseq keep a float32 "master" copy of each
such weight; this package does it for any ``torch.optim.Optimizer``.

The mechanism (apex O2's swap, but only for the length of each step):

* **Which parameters** (:mod:`.records`). At an optimizer's first
  ``unscale_``, ``step`` or ``load_state_dict``, every trainable
  (``requires_grad``) float16 parameter in its ``param_groups`` (bfloat16 too
  with ``AMPGUARD_MASTER_WEIGHTS=all``) gets a float32 master. Frozen ones
  never do; one that starts receiving gradients later gets its master then. An
  optimizer without half-precision parameters is not touched at all.
* **One copy per memory** (:mod:`.storage`). Masters are views of a float32
  buffer per half-precision storage: the same parameter in two optimizers, or
  two Parameters over one tensor, step one float32 copy, and torch's sum of
  their updates is kept.
* **What the user holds is unchanged.** Between steps ``param_groups`` hold the
  model's own parameters; ``optimizer.state`` is keyed by the masters and is
  float32.
* **Gradients** (:mod:`.gradient_copies`). The half-precision gradient is copied
  into ``master.grad`` (float32): by the GradScaler's ``unscale_``, which then
  unscales and checks it there, or, without a scaler, just before the step.
  From that copy until the step, :func:`.step.gradients` / :func:`.gradient_copies.gradient_pairs` answer
  "which tensor holds this parameter's gradient" for the scaler, ``clip_grad_norm_`` and the skipped-step
  report, which ask the scaler's bus (``ampguard.scaler.listeners.gradients``): the patch holds them there.
* **The step** (:mod:`.step`). The optimizer's own last step pre-hook (after
  the user's, which see their own parameters) puts the master lists into
  ``param_groups``; the optimizer steps the masters; its own first post-hook
  puts the model's lists back and copies the rounded masters into the
  parameters (one foreach copy). A step that raises puts them back too.
* **Checkpoints and copies** (:mod:`.checkpoints`). ``state_dict`` /
  ``load_state_dict`` save and load the state in float32 with the masters
  under :data:`STATE_KEY`; ``copy.deepcopy`` and pickle carry which master is
  whose; ``Module.load_state_dict`` refreshes the masters of what it loaded.
* **Steps with a closure** (:mod:`.closure`: LBFGS, Lightning): each closure call
  runs on the rounded masters so far and feeds their float32 gradients.
* **The patch** (:mod:`.patch`): the hooks and wrappers above, and their undo. It holds the
  :class:`~.records.MasterWeights` of its application (the optimizers with masters, their float32 memory),
  which its hooks and wrappers read at each call.

Optimizers ampguard cannot wrap (not a hooked ``torch.optim.Optimizer``, own
``state_dict``, tensor-subclass parameters, sparse gradients) get one message
and run as they do without master weights.
"""

from __future__ import annotations

from ampguard.master_weights.patch import applied_masters, masters_of
from ampguard.master_weights.records import STATE_KEY, MasterWeights, label
from ampguard.scaler.listeners import gradients  # documented here (docs/master-weights.md); the patch answers it

__all__ = [
    "STATE_KEY",
    "MasterWeights",
    "applied_masters",
    "gradients",
    "label",
    "masters_of",
]
