"""fp32 islands with several models and checkpoints: a deepcopy'd teacher, a shared block, a GAN, a rebuilt model.

Against plain torch's loss counts; each docstring gives the failure of earlier versions.
"""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
from islands_support import (  # noqa: F401
    CLASSES,
    DIM,
    EVERY,
    Attention,
    applied_islands,
    batch,
    fresh_islands,
    make_net,
    stock_scaler,
    train,
)
from scaler_support import (  # noqa: F401  (fixtures)
    ampguard_log,
    one_thread,
    recipe_step,
)
from torch import nn

import ampguard
from ampguard.fp32_islands.islands import permanent_line

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def test_a_mean_teacher_deepcopy_and_its_student_both_keep_their_islands():
    """An EMA / mean teacher made with copy.deepcopy(student) has the same names as the student.

    Islands are keyed by name, so naming the student's block removes the teacher's island and the
    other way round: every loud batch is lost for the whole run (8 of 8 here, as plain torch), with a
    new "fp32 island:" WARNING each time. Expected: each model's block is healed once (one overflow
    arms the probe, the next names the block: at most 4 losses), none after.
    """
    student = make_net()
    teacher = copy.deepcopy(student).requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    lost = []
    for step in range(8 * EVERY):
        x, y = batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.no_grad():
                target = teacher(x)
            out = student(x)
            loss = nn.functional.cross_entropy(out, y) + nn.functional.mse_loss(out, target)
        if not torch.isfinite(loss):
            lost.append(step)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert applied_islands().holds(student.blocks[1].attn) and applied_islands().holds(teacher.blocks[1].attn)
    assert len(lost) <= 4 and not [step for step in lost if step >= 4 * EVERY], lost


def test_a_checkpoint_loaded_in_the_same_process_after_the_first_model_was_freed_re_applies_its_islands():
    """Train, save the scaler, free the model, build it again and load (a notebook, a sweep, a rollback).

    restore() skips every saved name still in the islands dict, which keeps entries whose module is dead:
    the new model is not healed and loses 2 more batches. A new process loses none
    (test_islands_io.test_the_output_dtypes_ride_in_the_checkpoint_and_come_back_with_the_island).
    """
    first = train(2 * EVERY)
    state = first.scaler.state_dict()
    assert state["ampguard"]["fp32_islands"] == ["blocks.1.attn"]
    del first
    gc.collect()
    assert applied_islands().names() == ()  # the first model is gone
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    resumed = train(2 * EVERY, model=make_net(), scaler=scaler, start=2 * EVERY)
    assert resumed.nonfinite_losses == 0


class KeywordBlock(nn.Module):
    """Calls its attention with keyword arguments only, as transformers' LlamaDecoderLayer calls self_attn."""

    def __init__(self, sharpness: float) -> None:
        super().__init__()
        self.attn = Attention(DIM, sharpness)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x=x)


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([KeywordBlock(0.3), KeywordBlock(36.0), KeywordBlock(0.3)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def test_the_printed_permanent_line_works_for_a_module_called_with_keyword_arguments(ampguard_log, stock_torch):
    """The island heals under ampguard; the line it prints raises IndexError in plain torch.

    torch.amp.custom_fwd sets ``args[0]._dtype``: a module called with keyword arguments only has no
    args[0] (and a namedtuple / int first argument takes no attribute). The printed line must work as printed.
    """
    line = permanent_line("blocks.1.attn", "cpu")
    model = KeywordNet()
    exec(line, {"model": model, "torch": torch})
    run = train(3 * EVERY, model=model, scaler=stock_scaler())  # before: IndexError: tuple index out of range
    assert run.nonfinite_losses == 0


class SharingTeacher(nn.Module):
    """A teacher that shares the student's blocks (a shared encoder); no optimizer trains its own head."""

    def __init__(self, encoder: nn.ModuleList) -> None:
        super().__init__()
        self.encoder = encoder
        self.proj = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            x = block(x)
        return self.proj(x.mean(1))


def test_a_block_shared_with_a_teacher_is_named_from_the_student_the_loop_calls_and_the_optimizer_trains(reinstall):
    """The loop calls the student, the optimizer trains all of the student's parameters; a teacher that is never
    called holds the student's blocks. The island is named from the teacher (encoder.1.attn, "model: your
    SharingTeacher"), and so its checkpoint does not re-attach when the run resumes: "the models being trained
    have no such module: not re-applied", and 2 more batches are lost.
    """
    student = make_net()
    teacher = SharingTeacher(student.blocks)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.01)
    state = train(2 * EVERY, model=student, optimizer=optimizer).scaler.state_dict()
    assert applied_islands().names() == ("blocks.1.attn",)
    reinstall()  # a new process
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    resumed = train(2 * EVERY, model=student, optimizer=optimizer, scaler=scaler, start=2 * EVERY)
    assert resumed.nonfinite_losses == 0
    assert teacher.encoder is student.blocks


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = make_net(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)


def test_a_gan_resumed_from_its_checkpoint_gets_the_islands_of_both_models_back(reinstall, ampguard_log):
    """Two models trained in turn with optimizers and scalers of their own (a GAN), each with an island.

    On resume the names are looked up only in the top-level module of the first module called (the
    generator): the discriminator's island is "not re-applied" ("the models being trained have no such
    module", although it is being trained) and it loses 2 more batches.
    """
    models = {"G": Generator(), "D": make_net(2)}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01) for name, model in models.items()}

    def loop(scalers: dict, start: int) -> dict[str, int]:
        lost = dict.fromkeys(models, 0)
        for step in range(start, start + 3 * EVERY):
            for name, model in models.items():
                x, y = batch(step)
                loss = recipe_step(optimizers[name], scalers[name], lambda: nn.functional.cross_entropy(model(x), y))  # noqa: B023
                lost[name] += int(not torch.isfinite(loss))
        return lost

    scalers = {name: torch.amp.GradScaler("cpu", init_scale=1024.0) for name in models}
    loop(scalers, 0)
    assert set(applied_islands().names()) == {"gpt.blocks.1.attn", "blocks.1.attn"}
    states = {name: scaler.state_dict() for name, scaler in scalers.items()}
    reinstall()  # a new process
    scalers = {name: torch.amp.GradScaler("cpu") for name in models}
    for name, scaler in scalers.items():
        scaler.load_state_dict(states[name])
    assert loop(scalers, 3 * EVERY) == {"G": 0, "D": 0}  # before: {"G": 0, "D": 2}


# -- fp32 islands: a model with an island, saved whole or copied, against plain torch. ---------------------------------


def test_a_model_with_an_island_can_be_saved_whole_with_torch_save():
    """``torch.save(model, path)`` pickles the module with its hooks: the island's forward hook is
    ``partial(_exit, Island)`` and the Island holds a weakref: TypeError: cannot pickle
    'weakref.ReferenceType' object. Plain torch saves the same model (an ordinary checkpoint call).
    """
    run = train(2 * EVERY)
    assert applied_islands().names() == ("blocks.1.attn",)
    saved = io.BytesIO()
    torch.save(run.model, saved)  # before: TypeError
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    x, _ = batch(0)
    with torch.no_grad():
        assert torch.equal(loaded(x), run.model(x))


def test_uninstall_leaves_no_island_hook_on_a_deepcopy_of_the_model():
    """ "Reverting removes every hook the probe, the islands and the buffer guard hold": an EMA made with
    copy.deepcopy(model) after the island carries a copy of its hooks, which uninstall() does not remove
    (the copy keeps computing the block in float32 with ampguard gone)."""
    run = train(2 * EVERY)
    ema = copy.deepcopy(run.model)
    ampguard.uninstall()
    try:
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in run.model.modules())
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in ema.modules())  # before: 1 and 1
    finally:
        ampguard.install()


def test_uninstall_scans_live_objects_only_while_a_copy_of_a_hook_lives(monkeypatch):
    """Uninstall removes the islands' and the input keeper's hooks by their handles; the live objects are scanned
    (for hooks a deepcopy carried) only while such a copy lives (before: one scan of the heap at every uninstall,
    about 0.45 s in the suite's process)."""
    import gc

    scans = []
    get_objects = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *args: scans.append(1) or get_objects(*args))
    run = train(2 * EVERY)
    assert applied_islands().names() == ("blocks.1.attn",)
    scans.clear()  # (naming the island scanned the live models: the failure path)
    ampguard.uninstall()
    try:
        assert scans == []  # no copy: nothing scanned
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in run.model.modules())
    finally:
        ampguard.install()
    run = train(2 * EVERY)
    ema = copy.deepcopy(run.model)
    scans.clear()
    ampguard.uninstall()
    try:
        assert scans  # the copy's hooks (the island's, the input keeper's) were looked for, and taken off
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in ema.modules())
    finally:
        ampguard.install()
