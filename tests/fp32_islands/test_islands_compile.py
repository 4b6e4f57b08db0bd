"""fp32 islands under torch.compile: a model with an island, compiled (as a resumed run is).

A resumed run re-applies its islands at the first forward pass, which with ``torch.compile(model)``
is the compiled model's; any island made before ``torch.compile`` is in the same position. Dynamo
used to trace the island's hooks (the pre-hook opens a ``torch.autocast`` region without a ``with``)
and raise, then met them excluded from tracing (``fullgraph=True`` refused that); they now return at
once while dynamo traces them, so the compiled model computes the island's module in float16, as plain
torch does, on every torch and with ``fullgraph=True``, and ampguard says so once (a coverage gap:
docs/islands.md). backend="eager" keeps the tests cheap.
"""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from islands_support import EVERY, applied_islands, batch, fresh_islands, make_moe, make_net, train  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)

import ampguard
from ampguard.patch import torch_release

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def model_and_plain_torch() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model with an island on the module a loud batch overflows, and the same weights without ampguard's hooks."""
    model = make_net()
    plain = copy.deepcopy(model)  # (before the island: no hooks)
    applied_islands().make(model.blocks[1].attn, "blocks.1.attn", outputs=("autocast",))
    return model, plain


@pytest.mark.parametrize("compile_how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_computes_its_island_as_plain_torch_does_and_says_so_once(compile_how, ampguard_log):
    """The island's hooks are left out of compiled code: the island's module runs in float16 there, as under plain
    torch, and ampguard names the island once (INFO)."""
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
    torch.testing.assert_close(compiled, reference, rtol=0, atol=0, equal_nan=True)
    assert len(said) == 1 and "blocks.1.attn (Attention)" in said[0].getMessage()
    torch.testing.assert_close(again, compiled, rtol=0, atol=0, equal_nan=True)


def test_an_eager_model_with_an_island_says_nothing_about_compiled_code(ampguard_log):
    model, _ = model_and_plain_torch()
    compiled_helper = torch.compile(lambda t: t * 2, backend="eager")  # something compiles, not the model
    x, _ = batch(9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(compiled_helper(model(x))).all()
    assert not records(ampguard_log, logging.INFO, "does not apply inside torch.compile'd code")


def test_a_compiled_moe_with_an_island_runs_as_plain_torch():
    """Before: dynamo raised tracing the island's pre-hook (InternalTorchDynamoError, AutocastModeVariable); then,
    excluded from tracing, the hooks ran at graph breaks in some models (this MoE's) and not in others: now the
    island is left out of compiled code in every model, as the docs say, and the result is plain torch's."""
    torch._dynamo.reset()
    model = make_moe()
    plain = copy.deepcopy(model)  # (before the island: no hooks)
    applied_islands().make(model.experts[1], "experts.1", outputs=("autocast",))
    x, _ = batch(9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        eager = model(x)
        compiled = torch.compile(model, backend="eager")(x)  # before: InternalTorchDynamoError (AutocastModeVariable)
        torch._dynamo.reset()
        reference = torch.compile(plain, backend="eager")(x)
    assert torch.isfinite(eager).all()  # the island heals the eager model
    torch.testing.assert_close(compiled, reference, rtol=0, atol=0, equal_nan=True)


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


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
    if torch_release().release >= (2, 4):  # (torch 2.3.1's dynamo guards on the module's hooks: it compiles again)
        assert _unique_graphs() == graphs  # the first model's code, reused
    assert torch.isfinite(eager).all() and not torch.isfinite(reference).all()  # the island matters here
    torch.testing.assert_close(out, reference, rtol=0, atol=0, equal_nan=True)
    said = records(ampguard_log, logging.INFO, "does not apply inside torch.compile'd code")
    assert len(said) == 1 and "blocks.1.attn (Attention)" in said[0].getMessage()


@pytest.mark.parametrize("compile_how", ["torch.compile(model, fullgraph=True)", "model.compile(fullgraph=True)"])
def test_a_model_with_an_island_compiled_with_fullgraph_runs_as_plain_torch(compile_how):
    """An island made before the model is compiled with ``fullgraph=True`` (or re-applied from a checkpoint at its
    first forward): plain torch compiles and runs the model, and so does ampguard, as plain torch computes it. Before,
    dynamo met the island's pre-hook excluded from tracing and fullgraph raised ``Unsupported`` into the user's
    forward (torch 2.14.1 and 2.3.1 alike; found by review)."""
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
    torch.testing.assert_close(out, reference, rtol=0, atol=0)  # left out of compiled code: float16, as plain torch


@pytest.mark.parametrize("compile_how", ["torch.compile(model, fullgraph=True)", "model.compile(fullgraph=True)"])
def test_islands_of_a_checkpoint_loaded_into_a_model_compiled_with_fullgraph_train_as_plain_torch(
    compile_how, reinstall, ampguard_log
):
    """A resumed run whose model is compiled with ``fullgraph=True``: the checkpoint's islands are looked up at the
    first module call outside compiled code (the OptimizedModule's own call), never while dynamo traces the model;
    with ``model.compile()`` every call is compiled code, and the names are said not looked up. Before, the
    restore hook was traced and fullgraph raised into the user's forward (found by review)."""
    torch._dynamo.reset()
    first = train(2 * EVERY)  # an island on blocks.1.attn
    assert applied_islands().names() == ("blocks.1.attn",)
    state, weights = first.scaler.state_dict(), copy.deepcopy(first.model.state_dict())
    del first  # a new process: the first model is gone
    gc.collect()
    reinstall()
    model, plain = make_net(), make_net()
    model.load_state_dict(weights)
    plain.load_state_dict(weights)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    if compile_how.startswith("model.compile"):
        model.compile(backend="eager", fullgraph=True)
        called = model
    else:
        called = torch.compile(model, backend="eager", fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    resumed = train(3, model=called, optimizer=optimizer, scaler=scaler, start=2 * EVERY, healthy=True)
    assert resumed.nonfinite_losses == 0
    not_looked_up = records(ampguard_log, logging.WARNING, "no module was called outside compiled code")
    if compile_how.startswith("model.compile") and not applied_islands().names():
        # every module call was compiled code (torch 2.14.1; torch 2.3.1 calls the model's hooks outside it)
        assert len(not_looked_up) == 1 and "blocks.1.attn" in not_looked_up[0].getMessage()
    else:  # looked up at the first call outside compiled code (the OptimizedModule's own)
        assert not not_looked_up and applied_islands().names() == ("blocks.1.attn",)
    # plain torch, the same steps with torch's scaler: the same weights (the islands are left out of compiled code)
    ampguard.uninstall()
    try:
        torch._dynamo.reset()
        reference_scaler = torch.amp.GradScaler("cpu", init_scale=scaler.get_scale(), growth_interval=100)
        plain_called = torch.compile(plain, backend="eager", fullgraph=True)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)
        train(3, model=plain_called, optimizer=plain_optimizer, scaler=reference_scaler, start=2 * EVERY, healthy=True)
    finally:
        ampguard.install()
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
