"""fp32 masters (issue 20): what a user's optimizer step pre-hook sees, against the float32 run.

torch runs an optimizer's step pre-hooks with the model's parameters in
``param_groups``; a hook that masks gradients (pruning) looks them up by
identity. The masked weights must stay where they are, as in torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from master_events_support import Run, assert_like, batch, model_of, sgd
from scaler_support import one_thread  # noqa: F401
from torch.optim import optimizer as optimizer_module

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_gradient_mask_applied_by_a_step_pre_hook_keeps_pruned_weights_like_torch():
    finals = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        optimizer = sgd(model.parameters())
        masks = {model[0].weight: (torch.arange(16) % 2 == 0).to(dtype).expand(16, 16)}

        def mask_gradients(optimizer, args, kwargs, masks=masks):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param in masks:
                        param.grad.mul_(masks[param])

        optimizer.register_step_pre_hook(mask_gradients)
        start = model[0].weight.detach().clone()
        Run(model, [optimizer], dtype).steps(5)
        pruned = (torch.arange(16) % 2 == 1).expand(16, 16)
        assert torch.equal(model[0].weight[pruned], start[pruned]), f"{dtype}: pruned weights moved"
        finals.append(model)
    torch.testing.assert_close(finals[0][0].weight.float(), finals[1][0].weight, atol=2e-3, rtol=0)


def seen_by_hooks(dtype: torch.dtype, scaler: bool) -> list[tuple[str, int, list[bool]]]:
    """What each kind of step hook of the user's saw, step by step: (hook, step, [param_groups entry is the model's
    parameter, in order]); the per-optimizer ones registered before the first step and after it."""
    model = model_of(dtype)
    optimizer = sgd(model.parameters())
    own = list(model.parameters())
    seen: list[tuple[str, int, list[bool]]] = []
    steps = [0]

    def hook(name: str):
        def record(optimizer, args, kwargs):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            seen.append((name, steps[0], [p is q for p, q in zip(params, own, strict=True)]))

        return record

    handles = [
        optimizer_module.register_optimizer_step_pre_hook(hook("global pre")),
        optimizer_module.register_optimizer_step_post_hook(hook("global post")),
        optimizer.register_step_pre_hook(hook("pre")),
        optimizer.register_step_post_hook(hook("post")),
    ]
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaler)
    try:
        for step in range(3):
            steps[0] = step
            if step == 1:  # registered after ampguard's own hooks were made at the first step
                handles.append(optimizer.register_step_pre_hook(hook("late pre")))
                handles.append(optimizer.register_step_post_hook(hook("late post")))
            optimizer.zero_grad()
            x, y = batch(step, dtype)
            grad_scaler.scale(F.mse_loss(model(x).float(), y)).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("scaler", [False, True], ids=["no scaler", "GradScaler"])
def test_every_step_hook_of_the_users_sees_its_own_parameters_in_param_groups_as_under_torch(scaler: bool):
    """Global and per-optimizer step pre- and post-hooks (registered after ``import ampguard``, before and after the
    first step) find the model's own parameters in ``param_groups``, as with the float32 model under torch."""
    half, full = seen_by_hooks(torch.float16, scaler), seen_by_hooks(torch.float32, scaler)
    assert half == full
    assert len(full) == 3 * 4 + 2 * 2 and all(all(same) for _, _, same in full)


class CentralizedSGD(torch.optim.SGD):
    """An optimizer subclass that edits the gradients, then calls its parent's step (gradient centralization)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.dim() > 1:
                    param.grad.sub_(param.grad.mean(dim=1, keepdim=True))
        return super().step(closure)


def test_a_subclass_step_that_edits_gradients_before_its_parents_hooked_step_keeps_the_edit():
    """torch hooks both steps once each class has an instance; the parent's hooks must not undo the subclass's edit."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD.step hooked, as in any process that made one
    runs = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        run = Run(model, [CentralizedSGD(model.parameters(), lr=0.05, momentum=0.9)], dtype)
        start = model[0].weight.detach().float().clone()
        run.steps(5)
        moved = model[0].weight.float() - start
        # centralized gradients and momentum: each row of the first weight moves by a zero-mean change
        assert moved.mean(dim=1).abs().max() < 2e-4, f"{dtype}: the gradients were not centralized"
        runs.append(run)
    assert_like(*runs)


def test_step_hooks_around_a_subclass_super_step_see_the_models_parameters_like_torch():
    """torch runs an optimizer's step hooks at each hooked step: for ``CentralizedSGD`` twice per step, the second
    time inside its ``super().step()``; under torch each time with the model's parameters in ``param_groups``."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD.step hooked
    seen = {}
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        optimizer = CentralizedSGD(model.parameters(), lr=0.05, momentum=0.9)
        own = list(model.parameters())
        found: list[tuple[str, bool]] = []
        weights: list[torch.Tensor] = []

        def hook(name: str, own=own, found=found, weights=weights):
            def record(stepped, args, kwargs):
                params = [p for group in stepped.param_groups for p in group["params"]]
                found.append((name, all(p is q for p, q in zip(params, own, strict=True))))
                weights.append(params[0].detach().float().clone())

            return record

        optimizer.register_step_pre_hook(hook("pre"))
        optimizer.register_step_post_hook(hook("post"))
        Run(model, [optimizer], dtype).steps(2)
        seen[dtype] = found, weights
    (half, half_weights), (full, full_weights) = seen[torch.float16], seen[torch.float32]
    assert half == full and len(full) == 8 and all(same for _, same in full)
    for mine, reference in zip(half_weights, full_weights, strict=True):  # the post-hooks' weights: updated
        torch.testing.assert_close(mine, reference, atol=2e-3, rtol=0)
