"""Workflows plain torch trains, under ampguard with the headroom watch and the underflow sample on every step.

Issue 31: ampguard never breaks or bends a run that torch trains, and steps aside (one INFO line) where it cannot
see. Each run here is made twice from the same seeds, with plain torch (ampguard uninstalled) and under ampguard
with ``AMPGUARD_WATCH_EVERY=1`` and ``AMPGUARD_UNDERFLOW_EVERY=1`` (tests/parity/test_modern_features.py's harness):

* per-sample gradients with ``torch.func`` (``vmap(grad(...))`` over a functional call of the model, as Opacus-style
  DP training computes them) inside each step: the sample steps aside there, and the weights are torch's;
* a batch holding NaN/inf handed to the model inside a ``UserDict``, a read-only ``Mapping``, a dataclass, a
  namedtuple, an object of the user's own class or a jagged nested tensor is the data's fault: skipped, counted,
  said at INFO, no module blamed and no island (an island was made of the module the container went to);
* ``torch.export.export`` called at any point of the first steps works as with plain torch (torch 2.14's strict
  export refused a model while any global module hook was registered), traces torch's model, and leaves ampguard's
  hooks as they were;
* a ``torch.compile``'d model fed a new sequence length each step trains to torch's weights; ampguard's armed hooks
  cost at most one more graph, once (docs/islands.md, Limits).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import UserDict, namedtuple
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from islands_support import CLASSES, DIM, Net, Result, batch, fresh_islands, make_net  # noqa: F401
from scaler_support import ampguard_log, one_thread  # noqa: F401  (fixtures)
from test_modern_features import STEPS, WATCHED, assert_trained_as_torch, healthy_net, plain_then_watched
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as nn_module

import ampguard
import ampguard.messages as messages
from ampguard.underflow import nodes

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def new_scaler() -> Any:
    return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)


# -- per-sample gradients with torch.func -------------------------------------------------------------------------


def train_with_per_sample_clipping(steps: int = STEPS) -> Result:
    """DP-SGD without noise: each step's gradients are the mean of per-sample gradients (``vmap(grad(...))`` over
    ``functional_call``, under autocast, of the loss scaled as the scaler scales it), each clipped to norm 1; the
    step's ordinary backward pass runs first (the scaler's, and the one ampguard samples)."""
    func = pytest.importorskip("torch.func", reason="torch.func: torch >= 2.0")
    model = healthy_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result = Result(model, optimizer, new_scaler())

    for step in range(steps):
        x, y = batch(step, healthy=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        result.scaler.scale(loss).backward()
        scale = result.scaler.get_scale()

        def scaled_loss(
            params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, scale: float = scale
        ) -> torch.Tensor:
            out = func.functional_call(model, params, (x[None],))
            return F.cross_entropy(out, y[None]) * scale

        params = {name: p.detach() for name, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=torch.float16):
            per_sample = func.vmap(func.grad(scaled_loss), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.float().flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
        factor = (scale / norms).clamp(max=1.0)
        for name, p in model.named_parameters():
            g = per_sample[name].float()
            p.grad = (g * factor.view(-1, *[1] * (g.dim() - 1))).mean(0)
        result.nonfinite_losses += int(not torch.isfinite(loss))
        result.scaler.step(optimizer)
        result.scaler.update()
        result.scales.append(result.scaler.get_scale())
    return result


def test_per_sample_gradients_with_torch_func_inside_a_step(reinstall, ampguard_log, monkeypatch):
    """Before: the sample hooked the graphs torch.func's grad built and counted into its tallies there (an in-place
    add on a captured tensor inside the transform): a contained error, a WARNING asking for a bug report."""
    monkeypatch.setattr(nodes, "_said", set())
    reference, ours = plain_then_watched(reinstall, train_with_per_sample_clipping)
    assert_trained_as_torch(reference, ours, ampguard_log)
    said = [r.getMessage() for r in ampguard_log.records if r.name == "ampguard" and r.levelno == logging.INFO]
    assert said.count(nodes.TRANSFORMED) == 1
    assert ours.scaler.stats.underflow_samples >= STEPS - 2  # the steps' own backward passes were sampled


# -- bad data inside containers -----------------------------------------------------------------------------------

BAD_STEP = 5


class ReadOnly(Mapping[str, Any]):
    def __init__(self, **items: Any) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclasses.dataclass
class Features:
    x: torch.Tensor


Boxed = namedtuple("Boxed", "x")


class Batch:
    """A batch object of the user's own class: no container torch or ampguard knows."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def jagged(x: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor(list(x), layout=torch.jagged)


PACKS: dict[str, Callable[[torch.Tensor], Any]] = {
    "UserDict": lambda x: UserDict(x=x),
    "Mapping": lambda x: ReadOnly(x=x),
    "dataclass": Features,
    "namedtuple": Boxed,
    "an object of its own class": Batch,
    "jagged nested tensor": jagged,
}


def unpack(box: Any) -> torch.Tensor:
    if isinstance(box, torch.Tensor):
        return box.values().unflatten(0, (box.size(0), -1)) if box.is_nested else box
    return box["x"] if isinstance(box, Mapping) else box.x


class Inner(nn.Module):
    """tests/support/islands_support.py's net (``blocks.1.attn`` within 64x of float16's limit), fed from the container."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, box: Any) -> torch.Tensor:
        return self.net(unpack(box))


class Root(nn.Module):
    """Hands the container on, as it came, to the module that unpacks it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, box: Any) -> torch.Tensor:
        return self.inner(box)


def train_boxed(pack: Callable[[torch.Tensor], Any], value: float, steps: int = 8) -> tuple[Result, list[int]]:
    model = Root()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result, lost = Result(model, optimizer, new_scaler()), []
    for step in range(steps):
        x, y = batch(step, healthy=True)
        if step == BAD_STEP:
            x[0, 0, 0] = value  # a corrupt sample: the data's fault, no module's
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(pack(x)), y)
        if not torch.isfinite(loss):
            lost.append(step)
        result.scaler.scale(loss).backward()
        result.scaler.step(optimizer)
        result.scaler.update()
    return result, lost


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("how", list(PACKS))
def test_non_finite_inputs_inside_a_container_are_bad_data(reinstall, ampguard_log, how: str, value: float):
    """Before (UserDict, Mapping, an object of its own class, a jagged nested tensor): the inputs looked finite,
    the forward ran again, and the probe, seeing no tensor in the container, made an island of ``inner``."""
    if how.startswith("jagged") and not hasattr(torch, "jagged"):
        pytest.skip("torch.jagged: a torch with jagged nested tensors")
    ampguard.uninstall()
    reference, their_lost = train_boxed(PACKS[how], value)
    reinstall(**WATCHED)
    ampguard_log.clear()
    ours, lost = train_boxed(PACKS[how], value)
    assert their_lost == lost == [BAD_STEP]
    assert (ours.scaler.stats.skipped, ours.scaler.stats.nonfinite_loss) == (1, 1)
    assert ours.scaler.stats.fp32_islands == ()
    said = [r.getMessage() for r in ampguard_log.records if "the batch itself held inf/NaN" in r.getMessage()]
    assert said == [messages.BAD_BATCH.format(step=BAD_STEP + 1)]
    assert not any("located in" in r.getMessage() for r in ampguard_log.records)  # no module named for it
    # torch's weights: the bad step skipped by both (the scale each kept or halved is exact)
    assert all(torch.equal(a, b) for a, b in zip(reference.model.parameters(), ours.model.parameters()))


# -- torch.export mid-training ------------------------------------------------------------------------------------

# Two steps see every set of global module hooks ampguard holds as training starts: none (the first forward and
# backward), the buffer guard's discovery hook with the watch's and the sample's (from the first update to the second
# backward), the watch's and the sample's (from the second update on, as at every later step)
EXPORT_STEPS = 2
WHERE = ("before the forward pass", "after the backward pass", "after update()")


def global_hooks() -> list[list[tuple[int, Any]]]:
    tables = (
        nn_module._global_forward_pre_hooks,
        nn_module._global_forward_hooks,
        nn_module._global_forward_hooks_always_called,
    )
    return [list(table.items()) for table in tables]


def train_exporting(strict: bool) -> tuple[Result, list[tuple[int, str, Any]]]:
    """The healthy net trained :data:`EXPORT_STEPS` steps, exported at each of :data:`WHERE` in every step: (the
    training, each export's outputs on a fixed batch or the error it raised)."""
    model = healthy_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result, exports = Result(model, optimizer, new_scaler()), []
    probe_x = batch(100, healthy=True)[0]

    def export(step: int, where: str) -> None:
        hooks = global_hooks()
        try:
            program = torch.export.export(model, (probe_x,), strict=strict)
            exports.append((step, where, program.module()(probe_x)))
        except Exception as error:
            exports.append((step, where, f"{type(error).__name__}: {str(error)[:200]}"))
        assert global_hooks() == hooks, "ampguard's global hooks were not put back as they were"

    for step in range(EXPORT_STEPS):
        x, y = batch(step, healthy=True)
        export(step, WHERE[0])
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        result.scaler.scale(loss).backward()
        export(step, WHERE[1])
        result.scaler.step(optimizer)
        result.scaler.update()
        result.scales.append(result.scaler.get_scale())
        export(step, WHERE[2])
    return result, exports


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_torch_export_at_any_point_of_the_first_steps(reinstall, ampguard_log, strict: bool):
    """Before: on torch 2.14, every strict export from the end of the first step on raised ``Unsupported:
    Attempted to inline function marked as skipped`` (any global module hook does, with plain torch too)."""
    if not hasattr(torch, "export") or not hasattr(torch.export, "export"):
        pytest.skip("torch.export.export: torch >= 2.1")
    (reference, theirs), (ours, mine) = plain_then_watched(reinstall, lambda: train_exporting(strict))
    assert all(isinstance(out, torch.Tensor) for _, _, out in theirs)  # the test's premise: torch exports
    assert [(step, where) for step, where, out in mine if not isinstance(out, torch.Tensor)] == []
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(theirs, mine))  # the same programs' outputs
    assert_trained_as_torch(reference, ours, ampguard_log)


# -- torch.compile with a new sequence length each step -----------------------------------------------------------


def train_compiled_variable_lengths(whole: bool) -> tuple[Result, list[int]]:
    """The healthy net (compiled whole, or its second block), fed sequence lengths 8, 9, 10, ... (dynamic=None:
    dynamo makes the length dynamic at its second value): (the training, dynamo's graphs by the end of each step)."""
    torch._dynamo.reset()
    model = healthy_net()
    if whole:
        called: nn.Module = torch.compile(model, backend="aot_eager")
    else:
        model.blocks[1] = torch.compile(model.blocks[1], backend="aot_eager")
        called = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result, graphs = Result(model, optimizer, new_scaler()), []
    start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8 + step, DIM, generator=gen)
        y = torch.randint(0, CLASSES, (4,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(called(x), y)
        result.nonfinite_losses += int(not torch.isfinite(loss))
        result.scaler.scale(loss).backward()
        result.scaler.step(optimizer)
        result.scaler.update()
        result.scales.append(result.scaler.get_scale())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - start)
    return result, graphs


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("dynamo_reset")
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("whole", [True, False], ids=["model compiled", "block compiled"])
def test_compiled_with_a_new_sequence_length_each_step(reinstall, ampguard_log, whole: bool):
    """The dynamic graph is compiled at the second step, while the sample and the buffer guard's discovery hook are
    armed; dynamo guards it on the number of global hooks, so the next step (discovery over) compiles it once more:
    one more graph than torch, then none (torch 2.3.1 and 2.14 alike). The weights are torch's bit for bit."""
    (reference, theirs), (ours, mine) = plain_then_watched(reinstall, lambda: train_compiled_variable_lengths(whole))
    assert_trained_as_torch(reference, ours, ampguard_log)
    assert theirs[-1] == 2  # the test's premise: a static graph, then a dynamic one
    assert mine[-1] <= theirs[-1] + 1
    assert mine[3:] == [mine[-1]] * (STEPS - 3)  # nothing compiled after the third step


def test_torch_export_with_the_sample_alone(reinstall, ampguard_log):
    """fp32_islands off (``AMPGUARD_DISABLE=fp32_islands``): the underflow patch lifts the sample's hooks itself."""
    if not hasattr(torch, "export") or not hasattr(torch.export, "export"):
        pytest.skip("torch.export.export: torch >= 2.1")
    reinstall(**WATCHED, AMPGUARD_DISABLE="fp32_islands")
    ours, mine = train_exporting(strict=True)
    assert ours.scaler.stats.underflow_samples > 0  # the sample's hooks were armed between the steps
    assert [(step, where, out) for step, where, out in mine if not isinstance(out, torch.Tensor)] == []
