"""fp32 islands under torch.compile: a model with an island, compiled (as a resumed run is).

A resumed run re-applies its islands at the first forward pass, which with ``torch.compile(model)``
is the compiled model's; any island made before ``torch.compile`` is in the same position. Dynamo
used to trace the island's hooks (the pre-hook opens a ``torch.autocast`` region without a ``with``)
and raise; they are now excluded from tracing, and on torch >= 2.4 the compiled model computes the
island's module in float16, as plain torch does, and ampguard says so once (a coverage gap:
docs/islands.md). backend="eager" keeps the tests cheap.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from islands_support import applied_islands, batch, fresh_islands, make_moe, make_net  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)

from ampguard.patch import torch_release

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


LEFT_OUT = torch_release().release >= (2, 4)  # seen on 2.14.1; torch 2.3.1's dynamo still calls the hooks


def model_and_plain_torch() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model with an island on the module a loud batch overflows, and the same weights without ampguard's hooks."""
    model = make_net()
    plain = copy.deepcopy(model)  # (before the island: no hooks)
    applied_islands().make(model.blocks[1].attn, "blocks.1.attn", outputs=("autocast",))
    return model, plain


@pytest.mark.parametrize("compile_how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_computes_its_island_as_plain_torch_does_and_says_so_once(compile_how, ampguard_log):
    """torch >= 2.4 leaves the island's hooks (torch._dynamo.disable'd) out of compiled code: the island's module
    runs in float16 there, as under plain torch, and ampguard names the island once (INFO). torch 2.3's dynamo calls
    them: the island applies, as in the eager model, and nothing is said."""
    torch._dynamo.reset()  # (dynamo would reuse the other case's code for this model: no compilation, no line)
    model, plain = model_and_plain_torch()
    x, _ = batch(9)  # a loud batch: blocks.1.attn overflows float16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        eager = model(x)
        reference = plain(x)
        if compile_how == "model.compile()":
            model.compile(backend="eager")
            compiled_model = model
        else:
            compiled_model = torch.compile(model, backend="eager")
        compiled = compiled_model(x)
        again = compiled_model(x)
    assert torch.isfinite(eager).all() and not torch.isfinite(reference).all()  # the island matters here
    said = records(ampguard_log, logging.INFO, "does not apply inside torch.compile'd code")
    if LEFT_OUT:
        torch.testing.assert_close(compiled, reference, rtol=0, atol=0, equal_nan=True)
        assert len(said) == 1 and "blocks.1.attn (Attention)" in said[0].getMessage()
    else:
        assert torch.equal(compiled, eager) and not said
    torch.testing.assert_close(again, compiled, rtol=0, atol=0, equal_nan=True)


def test_an_eager_model_with_an_island_says_nothing_about_compiled_code(ampguard_log):
    model, _ = model_and_plain_torch()
    compiled_helper = torch.compile(lambda t: t * 2, backend="eager")  # something compiles, not the model
    x, _ = batch(9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(compiled_helper(model(x))).all()
    assert not records(ampguard_log, logging.INFO, "does not apply inside torch.compile'd code")


def test_a_compiled_moe_with_an_island_runs():
    """Before: dynamo raised tracing the island's pre-hook (InternalTorchDynamoError, AutocastModeVariable)."""
    model = make_moe()
    applied_islands().make(model.experts[1], "experts.1", outputs=("autocast",))
    x, _ = batch(9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        eager = model(x)
        compiled = torch.compile(model, backend="eager")(x)  # before: InternalTorchDynamoError (AutocastModeVariable)
    assert torch.equal(compiled, eager)


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.skipif(not LEFT_OUT, reason="torch 2.3's dynamo calls the island's hooks: the island applies")
@pytest.mark.parametrize("compile_how", ["torch.compile(model)", "model.compile()"])
def test_a_second_model_whose_compiled_code_is_reused_names_its_island(compile_how, ampguard_log):
    """A first model is compiled; a second of the same structure gets an island, then is compiled the same way, and
    dynamo runs it with the first one's code (no compilation starts: no start callback). Its island is left out there
    as well (float16, as plain torch), and ampguard names it when the model is compiled (before: never)."""
    torch._dynamo.reset()

    def compiled(module: torch.nn.Module) -> torch.nn.Module:
        if compile_how == "model.compile()":
            module.compile(backend="eager")
            return module
        return torch.compile(module, backend="eager")

    x, _ = batch(9)  # a loud batch: blocks.1.attn overflows float16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        compiled(make_net(seed=1))(x)
        graphs = _unique_graphs()
        model, plain = model_and_plain_torch()
        eager = model(x)
        reference = plain(x)
        out = compiled(model)(x)
    assert _unique_graphs() == graphs  # the first model's code, reused
    assert torch.isfinite(eager).all() and not torch.isfinite(reference).all()  # the island matters here
    torch.testing.assert_close(out, reference, rtol=0, atol=0, equal_nan=True)
    said = records(ampguard_log, logging.INFO, "does not apply inside torch.compile'd code")
    assert len(said) == 1 and "blocks.1.attn (Attention)" in said[0].getMessage()


@pytest.mark.xfail(
    strict=True,
    raises=torch._dynamo.exc.Unsupported,
    reason="open (review35): fullgraph=True refuses the island's torch._dynamo.disable'd hooks; plain torch compiles",
)
@pytest.mark.parametrize("compile_how", ["torch.compile(model, fullgraph=True)", "model.compile(fullgraph=True)"])
def test_a_model_with_an_island_compiled_with_fullgraph_runs_as_plain_torch(compile_how):
    """An island made before the model is compiled with ``fullgraph=True`` (or re-applied from a checkpoint at its
    first forward): plain torch compiles and runs the model; under ampguard dynamo meets the island's pre-hook,
    excluded from tracing, and fullgraph turns that into ``Unsupported`` raised into the user's forward (torch 2.14.1
    and 2.3.1 alike). ampguard must not be the reason it fails: the compiled model runs, as plain torch computes it."""
    torch._dynamo.reset()
    model, plain = model_and_plain_torch()
    x, _ = batch(3)  # an ordinary batch: both compute it finitely; a training forward (gradients on)
    with torch.autocast("cpu", dtype=torch.float16):
        if compile_how.startswith("model.compile"):
            model.compile(backend="eager", fullgraph=True)
            out = model(x)
        else:
            out = torch.compile(model, backend="eager", fullgraph=True)(x)
        torch._dynamo.reset()  # (compiled first, dynamo would run the other model with this one's code)
        reference = torch.compile(plain, backend="eager", fullgraph=True)(x)
    out.float().sum().backward()
    if LEFT_OUT:  # the island is left out of compiled code: float16 there, as plain torch
        torch.testing.assert_close(out, reference, rtol=0, atol=0)
    else:
        assert torch.isfinite(out).all()
