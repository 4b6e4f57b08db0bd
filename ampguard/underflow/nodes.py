"""Which autograd nodes a sample counts the incoming gradient of, and the regions it steps aside from.

A view's gradient holds its base's values (:data:`SAME_VALUES`: a module returning a view of its child's output
is counted in the child); a parameter's float16 gradient reaches autocast's cast of it or its accumulator
(:func:`parameter_gradient`); a compiled region's backward is one node (:data:`COMPILED_NODE_KINDS`): its output's
gradient is counted, the gradients inside it are not, which the sample says once; so it does
for a loss whose model it saw no module call of (:data:`UNSEEN`), and inside torch.func transforms
(:data:`TRANSFORMED`).
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import nn

from ampguard.log import event_logger

logger = event_logger("underflow")

# Said once per process and region at INFO when a module call's output comes from a compiled region's backward node.
COMPILED = (
    "underflow sample: the gradients inside the compiled region {region} are not counted (torch.compile makes its "
    "backward one node, whose values ampguard cannot see); the rest of the model is sampled as usual."
)
COMPILED_NODE_KINDS = frozenset({"CompiledFunctionBackward"})
_said: set[str] = set()  # the step-aside lines said in this process


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.info(message)


def step_aside_compiled(module: nn.Module, name: str) -> None:
    """Say once that the compiled region whose output ``module`` (named ``name``) returned is not counted."""
    if type(module).__name__ == "OptimizedModule":
        region = f"{name} (torch.compile of {type(getattr(module, '_orig_mod', module)).__name__})"
    else:
        region = f"called in {name} (a compiled function)"
    _say_once(COMPILED.format(region=region))


# Said once per process at INFO when a scaled loss is given to a sample that saw no module call.
UNSEEN = (
    "underflow sample: no module call of the model ran where the sample can see it (model.compile() runs them "
    "compiled; a model of plain functions has none): its gradients are not counted, and the scale follows torch's "
    "schedule."
)


def step_aside_unseen() -> None:
    _say_once(UNSEEN)


# Said once per process at INFO when scale() is given an iterator of losses (a generator: torch maps it lazily).
LAZY_LOSSES = (
    "underflow sample: the losses given to scaler.scale() in an iterator (a generator, a map) cannot be looked at "
    "without consuming it: their backward passes are not counted, and the scale follows torch's schedule for "
    "them. Pass a list or a tuple of losses to have them sampled."
)


def step_aside_lazy_losses() -> None:
    _say_once(LAZY_LOSSES)


# Said once per process at INFO when the sample first meets a torch.func transform.
TRANSFORMED = (
    "underflow sample: gradients computed inside a torch.func transform (vmap, grad, jacrev: per-sample gradients; "
    "or an operation torch runs through one, as eager flex_attention) are not counted; they are the transform's, and their tensors are functorch's wrappers. The step's own backward "
    "pass is sampled as usual."
)


def step_aside_transformed() -> None:
    _say_once(TRANSFORMED)


# Nodes whose incoming gradient holds the same values as a gradient counted elsewhere (a view's, a slice's, a
# split's pieces, a clone's, an in-place write's through a view, CopySlices: its base's): a module returning a view
# of its child's output leaves it to the child.
SAME_VALUES = frozenset(
    {
        "AliasBackward0",
        "BackwardHookFunctionBackward",  # (register_full_backward_hook's wrapper of a module's outputs)
        "AsStridedBackward0",
        "CloneBackward0",
        "CopySlices",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "TBackward0",
        "TransposeBackward0",
        "UnbindBackward0",
        "UnsafeSplitBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)


def parameter_gradient(node: Any) -> bool:
    """Whether ``node`` takes a parameter's float16 gradient: autocast's cast of a float32 parameter (its incoming
    gradient is the float16 copy's), or a float16 parameter's accumulator."""
    kind = type(node).__name__
    if kind == "AccumulateGrad":
        return bool(node.variable.dtype == torch.float16)
    return kind == "ToCopyBackward0" and any(
        type(following).__name__ == "AccumulateGrad" for following, _ in node.next_functions
    )


def dense(gradient: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """A dense floating gradient with values, a plain tensor (not a tensor subclass: a FakeTensor that torch.cond or
    export traces with, FSDP2's DTensor, a functorch wrapper, whose values the sample cannot count beside
    others)."""
    return (
        type(gradient) is torch.Tensor
        and gradient.is_floating_point()
        and gradient.layout == torch.strided
        and not gradient.is_nested
        and gradient.numel() > 0
    )
