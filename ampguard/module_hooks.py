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

from collections.abc import Callable
from typing import Any

from torch.nn.modules import module as nn_module

from ampguard.torch_privates import is_compiling


def eager_only(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a plain function (a global module hook) that returns None at once while dynamo traces it."""

    def call(*args: Any) -> Any:
        if is_compiling():
            return None
        return hook(*args)

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
