"""One side of the differential comparison of tests/parity/test_differential.py: a generated training program, run.

``python tests/support/differential_support.py torch`` runs programs under plain torch (ampguard is never imported);
``python tests/support/differential_support.py ampguard`` imports ampguard first, as a training script does. Each
process reads one program per line of stdin (JSON) and answers one line: the outcome of every step. Start-up
(importing torch) is paid once per process, not once per program.

A program is data: the scaler's settings, one or two optimizers (kind, param groups, half-precision
parameters, an LR scheduler) and the steps (micro-batches, an inf/NaN/huge gradient injected after a
backward, ``unscale_``, a clip, ``update(new_scale)``, a state_dict/pickle/deepcopy round trip of the
scaler). The two sides run the same program, except where docs/torch-parity.md and docs/clipping.md say
ampguard differs on purpose: there the torch side runs the *substitute* those docs name (see
:func:`_clip` and :func:`_step_schedulers`), so every compared number must be equal bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import pickle
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

UNDER_AMPGUARD = len(sys.argv) > 1 and sys.argv[1] == "ampguard"
if UNDER_AMPGUARD:
    import ampguard  # first, as a training script does
    import ampguard.master_weights

OPTIMIZER_KINDS = ("sgd", "sgd_momentum", "sgd_nesterov", "adam", "adamw", "rmsprop", "adagrad")
FUSABLE = ("sgd", "adam", "adamw")
SCHEDULERS = ("step", "exponential", "lambda")
SHAPES = ((3, 4), (3,))


def _optimizer(kind: str, groups: list[dict[str, Any]], implementation: str) -> torch.optim.Optimizer:
    flags: dict[str, Any] = {}
    if implementation in ("foreach", "fused"):
        flags[implementation] = True
    else:
        flags["foreach"] = False
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, **flags)
    if kind in ("sgd_momentum", "sgd_nesterov"):
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=kind == "sgd_nesterov", **flags)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01, **flags)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, **flags)
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=0.01, momentum=0.5, **flags)
    return torch.optim.Adagrad(groups, lr=0.1, **flags)


def _scheduler(kind: str | None, optimizer: torch.optim.Optimizer) -> Any:
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if kind == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    return None


@dataclass
class Trainee:
    """One optimizer, the parameters it steps and, for half-precision ones on the torch side, their masters."""

    spec: dict[str, Any]
    params: list[torch.Tensor]
    stepped: list[torch.Tensor]  # what the optimizer holds: params, or (torch side, float16) fp32 masters
    optimizer: torch.optim.Optimizer
    scheduler: Any
    norms: list[str] = field(default_factory=list)

    @property
    def fused(self) -> bool:
        return bool(self.spec["implementation"] == "fused")

    def copy_grads_to_masters(self) -> None:
        """The torch side's master-weight recipe (apex O2): the float16 gradient, in float32, on the master."""
        if self.stepped is not self.params:
            for param, master in zip(self.params, self.stepped):
                if master.grad is None and param.grad is not None:
                    master.grad = param.grad.float()

    def copy_masters_back(self) -> None:
        if self.stepped is not self.params:
            with torch.no_grad():
                for param, master in zip(self.params, self.stepped):
                    param.copy_(master)
                    master.grad = None


def _trainee(spec: dict[str, Any], index: int, seed: int) -> Trainee:
    generator = torch.Generator().manual_seed(seed * 10 + index)
    dtype = torch.float16 if spec["half"] else torch.float32
    params = [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in SHAPES * spec["groups"]]
    stepped = params
    if spec["half"] and not UNDER_AMPGUARD:
        stepped = [p.detach().float().requires_grad_() for p in params]
    per_group = len(SHAPES)
    groups = [
        {"params": stepped[g * per_group : (g + 1) * per_group], **({"lr": 0.05} if g else {})}
        for g in range(spec["groups"])
    ]
    optimizer = _optimizer(spec["kind"], groups, spec["implementation"])
    return Trainee(spec, params, stepped, optimizer, _scheduler(spec["scheduler"], optimizer))


def _scaler(program: dict[str, Any]) -> Any:
    return torch.amp.GradScaler(
        "cpu", init_scale=program["init_scale"], growth_interval=program["growth_interval"], growth_factor=2.0
    )


def _loss(trainees: list[Trainee], seed: int, step: int, micro: int) -> torch.Tensor:
    """Bounded, so finite however far a huge gradient moved the weights; NaN only once the weights are (a huge
    gradient clipped with max_norm=inf: torch's own coefficient is inf/inf), or where the program makes it
    non-finite (:func:`_nonfinite_loss`). Then :func:`_keep_scale` applies ampguard's intended difference to
    torch's run."""
    generator = torch.Generator().manual_seed(seed * 1000 + step * 10 + micro)
    total = torch.zeros(())
    for trainee in trainees:
        for param in trainee.params:
            x = torch.randn(param.shape, generator=generator)
            total = total + torch.tanh(param.float() * x).sum() + 0.1 * (torch.tanh(param.float()) ** 2).sum()
    return total


def _nonfinite_loss(loss: torch.Tensor, what: str) -> torch.Tensor:
    """A non-finite loss: with non-finite gradients ("inf", "nan": the loss times it, a forward overflow, where
    :func:`_keep_scale` applies ampguard's documented difference), or with finite ones ("inf_constant": a step
    both sides take and count)."""
    if what == "inf_constant":
        return loss + math.inf
    return loss * {"inf": math.inf, "nan": math.nan}[what]


def _inject(trainee: Trainee, what: str) -> None:
    grad = trainee.params[0].grad
    assert grad is not None
    with torch.no_grad():
        if what == "huge":
            grad.mul_(1e30)
        else:
            grad.view(-1)[0] = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[what]


def _found_inf(scaler: Any, trainee: Trainee) -> torch.Tensor | None:
    state = scaler._per_optimizer_states[id(trainee.optimizer)]
    flags = list(state["found_inf_per_device"].values())
    return flags[0] if flags else None


def _unscale(scaler: Any, trainee: Trainee) -> None:
    trainee.copy_grads_to_masters()
    scaler.unscale_(trainee.optimizer)


def _overflowed(param: torch.Tensor) -> bool:
    return param.grad is not None and not bool(torch.isfinite(param.grad).all())


def _clip(scaler: Any, trainees: list[Trainee], clip: dict[str, Any], unscaled: set[int]) -> str | None:
    """The clip the program says; on the torch side, where ampguard differs on purpose, its substitute.

    ``api``: ``clip_grad_norm_`` ("norm"), ``clip_grad_value_`` ("value"), or ``get_total_norm`` then
    ``clip_grads_with_norm_`` ("split", torch >= 2.6); the returned norm is compared ("value": none).

    * ``forgotten``: still-scaled gradients, an unscaled threshold, no ``get_scale()`` read. ampguard gives the
      recipe's result (docs/clipping.md): the torch side runs the recipe, ``unscale_`` then clip.
    * ``scaled_threshold``: ``max_norm * scaler.get_scale()`` (``clip_value * scaler.get_scale()``) on still-scaled
      gradients: torch's own idiom, the same call on both sides.
    * ``unscaled``: the recipe, the same call on both sides.
    A non-finite norm with a scaler in play (clipping.md, "Non-finite norms"), outside ``clip_grad_norm_``'s
    recipe case of one optimizer already unscaled: ampguard's coefficient is NaN, not torch's 0, so every optimizer
    in the call skips its step. The torch side does what ampguard does: NaN gradients, and the found-inf flags
    already recorded raised. (``clip_grad_value_`` never makes a gradient non-finite; a forgotten ``unscale_``'s
    inf is kept for the scaler to find, as the recipe's ``unscale_`` finds it: the same skips on both sides.)
    """
    members = [trainees[i] for i in clip["optimizers"]]
    mode = clip["mode"]
    max_norm = clip["max_norm"]
    if mode == "scaled_threshold":
        max_norm = max_norm * scaler.get_scale()
    if mode == "forgotten" and not UNDER_AMPGUARD:
        for index in clip["optimizers"]:
            if index not in unscaled:
                _unscale(scaler, trainees[index])
    if UNDER_AMPGUARD or mode == "scaled_threshold":
        params = [p for trainee in members for p in trainee.params]
    else:
        params = [p for trainee in members for p in trainee.stepped]
    foreach = clip["foreach"]
    if clip["api"] == "value":
        clip_value = clip["clip_value"] * (scaler.get_scale() if mode == "scaled_threshold" else 1.0)
        # The idiom's one difference (docs/clipping.md): a still-scaled gradient holding inf/NaN becomes NaN, all of
        # it, where torch's clamp hides the overflow; so its optimizer skips the step.
        hidden = [] if UNDER_AMPGUARD or mode != "scaled_threshold" else [p.grad for p in params if _overflowed(p)]
        torch.nn.utils.clip_grad_value_(params, clip_value, foreach=foreach)
        for grad in hidden:
            grad.fill_(float("nan"))
        return None
    if clip["api"] == "split":
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, clip["norm_type"], foreach=foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
        recipe_case = False  # the split API has no recipe case: a non-finite total always skips
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=clip["norm_type"], foreach=foreach)
        recipe_case = mode != "scaled_threshold" and all(i in unscaled for i in clip["optimizers"])
        recipe_case = recipe_case and len(members) == 1
    if not UNDER_AMPGUARD and not recipe_case and not bool(torch.isfinite(norm)):
        for trainee in members:
            flag = _found_inf(scaler, trainee)
            if flag is not None:
                flag.fill_(1.0)
        for param in params:
            if param.grad is not None:
                param.grad.fill_(math.nan)  # ampguard's NaN coefficient: the scaler's unscale_ finds it
    return str(norm.double().item().hex())


def _step_schedulers(trainees: list[Trainee], skipped: list[bool]) -> None:
    """ampguard holds a scheduler whose optimizer step the scaler skipped (docs/schedulers.md; a fused one's on
    the CPU at once, its row known in place); torch's substitute is the loop accelerate and DeepSpeed run: step
    the scheduler only after a real step. The iteration's row says how many fused optimizers skipped, not
    which: their schedulers hold when every fused one skipped (ampguard/scaler/ledger.py, RowCopies)."""
    fused_all_skipped = all(was_skipped for trainee, was_skipped in zip(trainees, skipped) if trainee.fused)
    for trainee, was_skipped in zip(trainees, skipped):
        if trainee.scheduler is None:
            continue
        held = was_skipped and (fused_all_skipped or not trainee.fused)
        if UNDER_AMPGUARD or not held:
            trainee.scheduler.step()


def _round_trip(scaler: Any, how: str, program: dict[str, Any]) -> Any:
    if how == "state_dict":
        fresh = torch.amp.GradScaler("cpu", init_scale=3.0, growth_interval=7)
        fresh.load_state_dict(scaler.state_dict())
        return fresh
    if how == "pickle":
        return pickle.loads(pickle.dumps(scaler))
    if how == "deepcopy":
        return copy.deepcopy(scaler)
    return scaler


def _hex(tensor: torch.Tensor) -> list[str]:
    return [value.hex() for value in tensor.detach().double().flatten().tolist()]


def _snapshot(scaler: Any, trainees: list[Trainee]) -> dict[str, Any]:
    snapshot: dict[str, Any] = {
        "scale": float(scaler.get_scale()).hex(),
        "growth_tracker": scaler._get_growth_tracker(),
    }
    for index, trainee in enumerate(trainees):
        state = trainee.optimizer.state_dict()
        snapshot[f"opt{index}"] = {
            "params": [_hex(p) for p in trainee.params],
            "masters": [_hex(m) for m in _masters(trainee)],
            "lr": [group["lr"] for group in state["param_groups"]],
            "state": {
                f"{key}/{name}": _hex(value) if torch.is_tensor(value) else value
                for key, entry in sorted(state["state"].items())
                for name, value in sorted(entry.items())
            },
        }
    return snapshot


def _masters(trainee: Trainee) -> list[torch.Tensor]:
    if UNDER_AMPGUARD:
        return [master for _, master in ampguard.master_weights.masters_of(trainee.optimizer)]
    return trainee.stepped if trainee.stepped is not trainee.params else []


@contextlib.contextmanager
def _keep_scale(scaler: Any, forward_overflow: bool) -> Iterator[None]:
    """torch's substitute for ampguard's intended difference (docs/torch-parity.md): an iteration skipped because
    a loss was itself inf/NaN keeps the scale and the growth tracker (torch backs off)."""
    keep = forward_overflow and not UNDER_AMPGUARD and scaler._scale is not None
    before = (scaler._scale.clone(), scaler._growth_tracker.clone()) if keep else None
    yield
    if before is not None:
        scaler._scale.copy_(before[0])
        scaler._growth_tracker.copy_(before[1])


def run_program(program: dict[str, Any]) -> list[dict[str, Any]]:
    """Every step's outcome: returned norms, skip flags, scale, growth tracker, parameters, optimizer state."""
    seed = program["seed"]
    trainees = [_trainee(spec, index, seed) for index, spec in enumerate(program["optimizers"])]
    scaler = _scaler(program)
    outcomes = []
    for number, step in enumerate(program["steps"]):
        outcome: dict[str, Any] = {}
        try:
            nonfinite_loss = False
            for micro in range(step["micro"]):
                loss = _loss(trainees, seed, number, micro)
                if micro == 0 and step.get("loss") is not None:
                    loss = _nonfinite_loss(loss, step["loss"])
                nonfinite_loss |= not bool(torch.isfinite(loss))
                scaler.scale(loss).backward()
                for inject in step["inject"]:
                    if inject["micro"] == micro:
                        _inject(trainees[inject["optimizer"]], inject["what"])
            unscaled: set[int] = set()
            for index in step["unscale"]:
                _unscale(scaler, trainees[index])
                unscaled.add(index)
            if step["clip"] is not None:
                norm = _clip(scaler, trainees, step["clip"], unscaled)
                if norm is not None:
                    outcome["norm"] = norm
            skipped = []
            for trainee in trainees:
                trainee.copy_grads_to_masters()
                scaler.step(trainee.optimizer)
                flag = _found_inf(scaler, trainee)
                skipped.append(bool(flag is not None and flag.item() > 0))
                trainee.copy_masters_back()
            outcome["skipped"] = skipped
            with _keep_scale(scaler, nonfinite_loss and step["new_scale"] is None and any(skipped)):
                scaler.update(step["new_scale"])
            outcome["any_skipped"] = scaler.last_step_skipped if UNDER_AMPGUARD else any(skipped)
            _step_schedulers(trainees, skipped)
            for trainee in trainees:
                trainee.optimizer.zero_grad(set_to_none=True)
                for param in trainee.params:
                    param.grad = None
            scaler = _round_trip(scaler, step["round_trip"], program)
            outcome.update(_snapshot(scaler, trainees))
        except Exception as error:  # a refusal is an outcome: both sides must refuse alike
            outcome["error"] = f"{type(error).__name__}: {error}"
            outcomes.append(outcome)
            break
        outcomes.append(outcome)
    return outcomes


def main() -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)  # ampguard's skip reports: the outcome is what is compared
    torch.set_num_threads(1)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps({"ampguard_loaded": "ampguard" in sys.modules, "steps": run_program(json.loads(line))}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
