"""A pair of global module hooks (forward pre-hook, forward hook) armed and disarmed again and again under one key.

The headroom watch, the underflow sampler and the probe observe module calls
only while they are armed, through torch's global module hooks. dynamo
compiles a submodule that is compiled on its own (``encoder.compile()``,
``torch.compile(encoder)`` inside an eager model) with a guard on the global
hooks' keys: hooks registered anew at each arming (new keys) made it compile
again at each watched or sampled step, until its recompile limit, after which
it ran eagerly for good. Re-inserted under the keys of their first
registration, the hooks give the same guards each time: one more graph, once.

What is registered is a plain function (:func:`eager_only`), never the bound
method given: a module called inside a compiled region calls the global hooks
inside it, so dynamo traces them. torch 2.3's dynamo can call a bound method
only of an ``nn.Module`` (``call_function UserDefinedObjectVariable``: a graph
break, with ``fullgraph=True`` an error); a function it inlines, and its first
line, ``is_compiling()``, is constant there: the hook returns before anything
of ampguard's is read, so nothing of it is traced or guarded on.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

from torch.nn.modules import module as nn_module

from ampguard.live_objects import instances
from ampguard.torch_privates import is_compiling

_Hook = TypeVar("_Hook", bound="ModuleHook")


def eager_only(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a plain function (a global module hook) that returns None at once while dynamo traces it."""

    def call(*args: Any) -> Any:
        if is_compiling():
            return None
        return hook(*args)

    return call


def ours(hook: Any) -> bool:
    """Whether a global module hook is ampguard's (the watch's, the sampler's, the probe's, the buffer guard's)."""
    return str(getattr(hook, "__module__", None) or "").startswith("ampguard.")


@contextlib.contextmanager
def global_hooks_lifted() -> Iterator[None]:
    """ampguard's global module hooks out of torch's tables while inside, put back after in their places.

    For a call that traces the model for torch alone (``torch.export.export``: torch 2.14's strict export refuses
    any global module hook, dynamo skipping the wrapper it traces through): nothing of ampguard runs or is traced
    there."""
    hooks: tuple[dict[int, Any], ...] = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks)
    lifted = [{key: hook for key, hook in table.items() if ours(hook)} for table in hooks]
    flags: dict[int, Any] = nn_module._global_forward_hooks_always_called
    lifted.append({key: flags[key] for key in lifted[1] if key in flags})
    tables = (*hooks, flags)
    orders = [list(table) for table in tables]
    for table, taken in zip(tables, lifted):
        for key in taken:
            table.pop(key, None)
    try:
        yield
    finally:
        for table, taken, order in zip(tables, lifted, orders):
            if not taken:
                continue
            current = dict(table)
            table.clear()
            for key in order:
                if key in current or key in taken:
                    table[key] = current.pop(key) if key in current else taken[key]
            table.update(current)


def without_global_hooks(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with ampguard's global module hooks lifted (:func:`global_hooks_lifted`)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with global_hooks_lifted():
            return function(*args, **kwargs)

    return call


class GlobalModuleHooks:
    """``before(module, args)`` and ``after(module, args, output)`` (always called) on every module call while armed.

    Example::

        hooks = GlobalModuleHooks(self._before, self._after)
        hooks.arm()  # the next forward passes are observed
        ...
        hooks.disarm()  # nothing runs on module calls; the next arm() uses the same keys
    """

    def __init__(self, before: Callable[..., Any], after: Callable[..., Any]) -> None:
        # Made once: the same functions under the same keys at each arming (dynamo guards on them).
        self._before = eager_only(before)
        self._after = eager_only(after)
        self._keys: tuple[int, int] | None = None
        self.armed = False

    def arm(self) -> None:
        if self.armed:
            return
        if self._keys is None:
            pre = nn_module.register_module_forward_pre_hook(self._before)
            post = nn_module.register_module_forward_hook(self._after, always_call=True)
            self._keys = (pre.id, post.id)
        else:
            pre_key, post_key = self._keys
            nn_module._global_forward_pre_hooks[pre_key] = self._before
            nn_module._global_forward_hooks[post_key] = self._after
            nn_module._global_forward_hooks_always_called[post_key] = True
        self.armed = True

    def disarm(self) -> None:
        if not self.armed or self._keys is None:
            return
        pre_key, post_key = self._keys
        nn_module._global_forward_pre_hooks.pop(pre_key, None)
        nn_module._global_forward_hooks.pop(post_key, None)
        nn_module._global_forward_hooks_always_called.pop(post_key, None)
        self.armed = False


def remove_module_hooks(module: Any, pre: type | tuple[type, ...] = (), post: type | tuple[type, ...] = ()) -> bool:
    """Take ``module``'s forward pre-hooks that are ``pre`` instances and forward hooks that are ``post`` ones off
    it, with their keyword and always-called entries (hooks a deepcopy or a pickle carried). True if it had any."""
    found = False
    tables = (
        (module._forward_pre_hooks, pre, (module._forward_pre_hooks_with_kwargs,)),
        (module._forward_hooks, post, (module._forward_hooks_with_kwargs, module._forward_hooks_always_called)),
    )
    for hooks, kinds, entries in tables:
        for key, hook in list(hooks.items()) if kinds else ():
            if isinstance(hook, kinds):
                found = True
                del hooks[key]
                for entry in entries:
                    entry.pop(key, None)
    return found


class ModuleHook:
    """Base of the stateless hooks ampguard puts on modules: every live instance of each kind is known.

    ``copy.deepcopy`` and pickle of a model holding one make new instances (an EMA's copy of an island's hooks),
    on modules ampguard never saw; they are made through ``__new__`` too (``__reduce__`` makes them so under every
    pickle protocol). Once ampguard has taken off the hooks it registered (by their handles), a kind with instances
    still alive may sit on such copies: only then does :func:`strip_copies` look for them among live objects.
    """

    _live: ClassVar[weakref.WeakSet[ModuleHook]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._live = weakref.WeakSet()

    def __new__(cls: type[_Hook], *args: Any, **kwargs: Any) -> _Hook:
        hook = super().__new__(cls)
        cls._live.add(hook)
        return hook

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(self), ()

    @classmethod
    def any_alive(cls) -> bool:
        return len(cls._live) > 0

    @classmethod
    def forget_live(cls) -> None:
        cls._live.clear()


def strip_copies(kinds: tuple[type[ModuleHook], ...], strip: Callable[[Any], object]) -> None:
    """``strip(module)`` on every live module holding a forward hook or pre-hook, if an instance of ``kinds`` lives.

    Called at uninstall after ampguard removed the hooks it registered: a hook still alive then is a copy's (or
    one held elsewhere), and only then are live objects scanned (about 0.1-0.5 s in a large process).
    """
    if not any(kind.any_alive() for kind in kinds):
        return
    for module in instances(nn_module.Module):
        if module._forward_pre_hooks or module._forward_hooks:
            strip(module)
    for kind in kinds:  # what lives on is on no module now
        kind.forget_live()
