"""fp32 islands: a model with an island, saved whole or copied, against plain torch."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from islands_support import EVERY, batch, fresh_islands, train  # noqa: F401
from scaler_support import one_thread  # noqa: F401  (fixture)

import ampguard
from ampguard.fp32_islands import islands

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def test_a_model_with_an_island_can_be_saved_whole_with_torch_save():
    """``torch.save(model, path)`` pickles the module with its hooks: the island's forward hook is
    ``partial(_exit, Island)`` and the Island holds a weakref: TypeError: cannot pickle
    'weakref.ReferenceType' object. Plain torch saves the same model (an ordinary checkpoint call).
    """
    run = train(2 * EVERY)
    assert islands.names() == ("blocks.1.attn",)
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
    assert islands.names() == ("blocks.1.attn",)
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
