"""fp32 island names are qualified from the module the script holds (the one whose parameters it trains).

The outermost module a forward pass calls is often not that object: coqui's XTTS
recipe calls ``GPTTrainer.xtts.gpt`` (the script holds the ``GPTTrainer``), timm's
train.py calls its task in training and the model itself elsewhere. The name in
the WARNING, the line that makes the island permanent, and the checkpoint are all
the top-level module's, and a checkpoint's island re-attaches by that full name only.
"""

from __future__ import annotations

import logging

import pytest
import torch
from islands_support import EVERY, applied_islands, batch, fresh_islands, make_net, probe_only, stock_scaler, train  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


class Holder(torch.nn.Module):
    """coqui's Xtts: holds the GPT the recipe's loop calls."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = make_net()


class Recipe(torch.nn.Module):
    """coqui's GPTTrainer: the object the script holds (its forward is never called)."""

    def __init__(self) -> None:
        super().__init__()
        self.xtts = Holder()


class Task(torch.nn.Module):
    """timm's ClassificationTask: holds the model as ``trainable_module`` and calls it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.trainable_module = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trainable_module(x)


def test_the_island_is_named_from_the_module_the_script_holds_and_its_printed_line_works(ampguard_log):
    """The loop calls recipe.xtts.gpt; the name and the printed line are the recipe's (the optimizer trains it)."""
    recipe = Recipe()
    run = train(3 * EVERY, model=recipe.xtts.gpt, optimizer=torch.optim.SGD(recipe.parameters(), lr=0.01))
    assert run.scaler.stats.fp32_islands == ("xtts.gpt.blocks.1.attn",)
    message = records(ampguard_log, logging.WARNING, "fp32 island:")[0].getMessage()
    assert message.startswith("fp32 island: xtts.gpt.blocks.1.attn (Attention)")
    line = message.split("To make this permanent without ampguard (model: your Recipe): ")[1]
    fresh = Recipe()  # the same weights (make_net's seed), in plain torch with the printed line only
    exec(line, {"model": fresh, "torch": torch})
    assert train(3 * EVERY, model=fresh.xtts.gpt, scaler=stock_scaler()).nonfinite_losses == 0
    assert train(3 * EVERY, model=Recipe().xtts.gpt, scaler=stock_scaler()).nonfinite_losses == 3  # without it
    saved = run.scaler.state_dict()["ampguard"]
    assert saved["fp32_islands"] == ["xtts.gpt.blocks.1.attn"]
    assert saved["fp32_islands_named_from"] == "top-level module"


@pytest.mark.parametrize("called", ["task", "model"])
def test_the_island_has_one_name_whichever_module_the_loop_calls(reinstall, called):
    """timm's train.py calls its task in training and the model itself elsewhere: one name, the task's."""
    model = make_net()
    task = Task(model)
    train(2 * EVERY, model=task if called == "task" else model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    assert applied_islands().names() == ("trainable_module.blocks.1.attn",)
    assert applied_islands().holds(task.get_submodule(applied_islands().names()[0]))


def trained_recipe(saved_names: list[str], full_names: bool):
    """A recipe trained until its block is an island; its scaler's state naming ``saved_names``."""
    recipe = Recipe()
    optimizer = torch.optim.SGD(recipe.parameters(), lr=0.01)
    state = train(3 * EVERY, model=recipe.xtts.gpt, optimizer=optimizer).scaler.state_dict()
    state["ampguard"]["fp32_islands"] = saved_names
    state["ampguard"].pop("fp32_islands_named_from", None)  # earlier versions: names relative to the module called
    if full_names:
        state["ampguard"]["fp32_islands_named_from"] = "top-level module"
    return recipe, optimizer, state


def resume(reinstall, recipe, optimizer, state, steps: int = 3 * EVERY):
    """A fresh process state, the scaler loaded, and first of all a call to a teacher of the same architecture."""
    reinstall()
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    teacher = make_net()  # no optimizer trains it: the model being trained is the recipe
    with torch.no_grad():
        teacher(batch(0)[0])
    run = train(steps, model=recipe.xtts.gpt, optimizer=optimizer, scaler=scaler, start=3 * EVERY)
    assert not any(m._forward_pre_hooks for m in teacher.modules())
    return run


def test_a_checkpointed_island_re_attaches_by_its_full_name_not_to_a_module_sharing_its_short_name(reinstall):
    recipe, optimizer, state = trained_recipe(["xtts.gpt.blocks.1.attn"], full_names=True)
    run = resume(reinstall, recipe, optimizer, state)
    assert applied_islands().names() == ("xtts.gpt.blocks.1.attn",)
    assert applied_islands().holds(recipe.xtts.gpt.blocks[1].attn)
    assert run.nonfinite_losses == 0


def test_an_earlier_checkpoint_s_short_name_still_loads_where_it_names_one_module(reinstall, ampguard_log):
    recipe, optimizer, state = trained_recipe(["blocks.1.attn"], full_names=False)  # relative to xtts.gpt
    run = resume(reinstall, recipe, optimizer, state)
    assert applied_islands().names() == ("xtts.gpt.blocks.1.attn",)  # and from now on saved by its full name
    assert run.nonfinite_losses == 0
    assert len(records(ampguard_log, logging.INFO, "fp32 island xtts.gpt.blocks.1.attn (Attention) re-applied")) == 1


@pytest.mark.usefixtures("probe_only")  # (the headroom watch would blame the block at its first overflow)
def test_an_earlier_checkpoint_s_short_name_that_fits_several_modules_is_not_re_applied(reinstall, ampguard_log):
    recipe, optimizer, state = trained_recipe(["1"], full_names=False)
    run = resume(reinstall, recipe, optimizer, state, steps=EVERY)
    assert applied_islands().names() == ()
    ambiguous = records(ampguard_log, logging.WARNING, "the checkpoint names fp32 island 1, which could be any of")
    assert len(ambiguous) == 1 and "xtts.gpt.blocks.1" in ambiguous[0].getMessage()
    assert run.nonfinite_losses == 1  # not healed yet: the probe finds it again
