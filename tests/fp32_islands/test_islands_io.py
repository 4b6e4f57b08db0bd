"""An fp32 island's boundary: float32 in, whatever the nesting of its inputs; the caller's dtypes out.

An island runs its module in float32, so its float16 inputs are cast to float32
wherever they sit (a namedtuple, a dataclass, an HF ``ModelOutput``), and its
floating outputs get back the dtypes they had under autocast, so code written
for autocast's float16 around it (an MoE dispatch ``out[mask] = expert(x[mask])``,
``index_add_``, ``index_copy_``, ``scatter_``) keeps working. Before, the first
forward pass after the island was made raised (``mat1 and mat2 must have the
same dtype``, ``Index put requires the source and destination dtypes match``).
"""

from __future__ import annotations

import copy
import logging
from collections import UserDict
from typing import Any

import pytest
import torch
from islands_support import (
    BATCH,
    CLASSES,
    DIM,
    EVERY,
    TOKENS,
    Hidden,
    HiddenState,
    MoE,
    applied_islands,
    batch,
    fresh_islands,  # noqa: F401
    make_moe,
    make_net,
    stock_scaler,
    train,
    unpack,
)
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from torch import nn

import ampguard
import ampguard.scaler
from ampguard.fp32_islands import island_io
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

POSITIONS = torch.arange(TOKENS).expand(BATCH, TOKENS)


def _model_output(hidden: torch.Tensor) -> Any:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    return outputs.BaseModelOutput(last_hidden_state=hidden)


PACKS = {
    "namedtuple": lambda hidden: Hidden(hidden, POSITIONS),
    "dataclass": lambda hidden: HiddenState(hidden, POSITIONS),
    "ModelOutput": _model_output,
    "nested": lambda hidden: {"state": HiddenState(Hidden(hidden, POSITIONS), POSITIONS)},
    # a Mapping pytree does not walk (a tokenizer's BatchEncoding): before, the island's forward raised (mat1 and
    # mat2 must have the same dtype)
    "UserDict": lambda hidden: UserDict(state=HiddenState(hidden, POSITIONS)),
}


@pytest.mark.parametrize("container", list(PACKS))
def test_an_island_fed_its_input_inside_a_container_heals_and_computes_in_float32(container):
    pack = PACKS[container]
    run = train(3 * EVERY, model=make_net(pack=pack))  # before: the forward pass after step 19 raised
    assert run.scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert run.nonfinite_losses == 1  # named at its first overflow from what the headroom watch saw at step 2
    attn = run.model.blocks[1].attn
    hidden = torch.randn(BATCH, TOKENS, DIM).half()
    box = pack(hidden)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        island = attn(box)
    with torch.no_grad():
        reference = attn(pack(hidden.float()))  # no autocast: plain float32 (the island does nothing)
    assert island.dtype == torch.float16
    assert torch.equal(island, reference.half())  # computed in float32, handed back in autocast's float16
    assert unpack(box) is hidden  # the caller's container is not modified


@pytest.mark.parametrize("dispatch", MoE.DISPATCH)
def test_an_moe_dispatch_written_for_autocast_around_an_island_heals(dispatch):
    steps = 4 * EVERY
    reference = train(steps, model=make_moe(dispatch), scaler=stock_scaler())
    assert reference.nonfinite_losses == 4  # plain torch loses every loud batch
    run = train(steps, model=make_moe(dispatch))  # before: RuntimeError from the dispatch at step 20
    assert run.scaler.stats.fp32_islands == ("experts.1",)
    assert run.nonfinite_losses == 1  # named from the first loud batch, its forward run again (the probe alone: 2)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def _float32_inside(expert: nn.Module) -> None:
    """Plain torch's version of an island that keeps its caller's dtypes: float32 in, float16 out."""
    forward = expert.forward

    def in_float32(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return forward(x.float()).half()

    expert.forward = in_float32  # type: ignore[method-assign]


def test_after_healing_the_moe_trains_as_plain_torch_with_that_expert_in_float32_and_reads_as_often():
    """20 more healthy steps from the healed state: bit for bit plain torch's, with the same host reads."""
    healed = train(2 * EVERY, model=make_moe())
    assert healed.scaler.stats.fp32_islands == ("experts.1",)
    torch_model = make_moe(seed=1)
    torch_model.load_state_dict(healed.model.state_dict())
    _float32_inside(torch_model.experts[1])
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.01)
    torch_scaler = stock_scaler()
    torch_scaler.load_state_dict(copy.deepcopy(healed.scaler.state_dict()))
    more = {"steps": 2 * EVERY, "start": 2 * EVERY, "healthy": True, "check_losses": False}
    with HostReadCounter() as torch_reads:
        train(model=torch_model, optimizer=torch_optimizer, scaler=torch_scaler, **more)
    with HostReadCounter() as ours:
        train(model=healed.model, optimizer=healed.optimizer, scaler=healed.scaler, **more)
    for theirs, mine in zip(torch_model.parameters(), healed.model.parameters()):
        assert torch.equal(theirs, mine)
    assert ours.by_source == torch_reads.by_source  # the island's casts add no host read
    assert healed.scaler.get_scale() == torch_scaler.get_scale() == 1024.0


def test_the_output_dtypes_ride_in_the_checkpoint_and_come_back_with_the_island():
    healed = train(2 * EVERY, model=make_moe())
    state = healed.scaler.state_dict()
    assert state["ampguard"]["fp32_island_outputs"] == {"experts.1": ["autocast"]}
    ampguard.uninstall()  # islands are process state: as a new process would start
    ampguard.install()
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    resumed = train(2 * EVERY, model=healed.model, optimizer=healed.optimizer, scaler=scaler, start=2 * EVERY)
    assert resumed.nonfinite_losses == 0 and scaler.stats.fp32_islands == ("experts.1",)


class _Loud(nn.Module):
    """A linear layer whose output passes float16's range on loud batches, scaled down by its caller's code."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        with torch.no_grad():
            self.linear.weight.mul_(15000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 1e-3


class _LoudNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = _Loud()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(1))


def test_an_island_output_beyond_float16_is_an_overflow_of_its_caller():
    """body.linear's float32 output (2e5 on loud batches) is float16 for its caller again: inf there, so
    the probe names the caller next, and the caller's island computes the whole in float32."""
    with torch.no_grad():
        assert all(_LoudNet().body.linear(batch(step)[0]).abs().amax() > 65504 for step in (9, 19, 29, 39))
    run = train(6 * EVERY, model=_LoudNet())
    assert run.scaler.stats.fp32_islands == ("body.linear", "body")
    # body.linear: an island before any overflow (the headroom watch of step 2 saw 31,712); body: named from its
    # first overflow, its forward run again (the probe alone: the next overflow names it).
    assert run.nonfinite_losses == 1
    x, _ = batch(5 * EVERY + 9)  # loud, and now finite
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(run.model(x)).all()


def test_an_island_gives_autocasts_dtype_at_each_call_and_nothing_changes_without_autocast():
    """Recorded under float16: bfloat16 under a bfloat16 autocast; float32, as computed, without autocast."""
    linear = nn.Linear(DIM, DIM)
    applied_islands().make(linear, "linear", outputs=("autocast",))
    x = torch.randn(2, DIM).half()
    with torch.no_grad():
        reference = nn.functional.linear(x.float(), linear.weight, linear.bias)
        with torch.autocast("cpu", dtype=torch.float16):
            half = linear(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            brain = linear(x)
        plain = linear(x.float())
    assert half.dtype == torch.float16 and torch.equal(half, reference.half())
    assert brain.dtype == torch.bfloat16 and torch.equal(brain, reference.bfloat16())
    assert plain.dtype == torch.float32 and torch.equal(plain, reference)


class _Unbuildable:
    """A container registered with torch's pytree whose rebuild raises."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def _rebuild(values: Any, context: Any) -> _Unbuildable:
    raise RuntimeError("cannot rebuild")


def test_a_container_that_cannot_be_rebuilt_runs_that_call_under_autocast(ampguard_log, monkeypatch):
    """Never the reason a run dies: one WARNING, the call runs as without the island, autocast stays on after it."""
    from torch.utils import _pytree

    monkeypatch.setattr(applied_islands(), "_fallback_warned", False)
    _pytree.register_pytree_node(_Unbuildable, lambda box: ([box.hidden], None), _rebuild)
    try:
        linear = nn.Linear(DIM, DIM)
        applied_islands().make(linear.requires_grad_(False), "linear")
        call = lambda box: nn.functional.linear(box.hidden, linear.weight, linear.bias)  # noqa: E731
        linear.forward = call  # type: ignore[method-assign]
        hidden = torch.randn(2, DIM).half()
        with torch.autocast("cpu", dtype=torch.float16):
            out = linear(_Unbuildable(hidden))
            assert island_io.autocast_enabled("cpu")
            under_autocast = call(_Unbuildable(hidden))  # the same call without the island
        assert torch.equal(out, under_autocast)
        assert len(records(ampguard_log, logging.WARNING, "an fp32 island could not run in float32")) == 1
    finally:
        deregister = getattr(
            _pytree, "_deregister_pytree_node", None
        )  # a private name: absent, the test-local class stays
        if deregister is not None:
            deregister(_Unbuildable)


class _PlainBox:
    """A batch object of the user's own class: no pytree, no dataclass, no mapping; its tensor an attribute."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


@pytest.mark.parametrize("autocast", [True, False])
def test_an_island_whose_input_hides_float16_in_a_plain_object_steps_aside_for_that_call(
    ampguard_log, monkeypatch, autocast
):
    """The cast cannot reach a float16 tensor in a plain object's attributes: in float32 it would meet the island's
    float32 weights and the module's own forward would raise (``mat1 and mat2 must have the same dtype``), a crash
    plain torch does not have. The call runs as without the island (torch's dtypes), said once at INFO."""
    monkeypatch.setattr(applied_islands(), "_stepped_aside", set())
    torch.manual_seed(0)
    linear = nn.Linear(DIM, DIM)
    if not autocast:
        linear.half()  # a float16 model without autocast (DeepSpeed's fp16 mode): its weights read as float32
    applied_islands().make(linear.requires_grad_(False), "linear")
    call = lambda box: nn.functional.linear(box.hidden, linear.weight, linear.bias)  # noqa: E731
    linear.forward = call  # type: ignore[method-assign]
    hidden = torch.randn(2, DIM).half()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = linear(_PlainBox(hidden))
        as_torch = call(_PlainBox(hidden))  # the same call without the island
        out_again = linear(_PlainBox(hidden))
    assert torch.equal(out, as_torch) and torch.equal(out_again, as_torch) and out.dtype == torch.float16
    assert len(records(ampguard_log, logging.INFO, "steps aside for calls whose inputs hold a float16")) == 1
