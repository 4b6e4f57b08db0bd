"""How a clip function of torch is wrapped: wrapt, made to behave under torch.compile, copy and pickle,
with ampguard's failures contained (torch's function runs instead) and warnings attributed to the caller."""

from __future__ import annotations

import copy
import functools
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import wrapt
from torch import Tensor

import ampguard.containment as containment
from ampguard.clip_grad.state import ClipOwner, ClipState

_WRAPT_DIR = os.path.dirname(wrapt.__file__)
_PACKAGE_DIR = os.path.dirname(__file__)


def safe_function_wrapper(
    original: Callable[..., Any],
    wrapper: Callable[..., Any],
    owner: ClipOwner,
    *,
    idle: Callable[[ClipState], bool] | None = None,
) -> wrapt.FunctionWrapper[Any, Any]:
    """``wrapt.FunctionWrapper`` of ``original``, made to behave under torch.compile, copy and pickle.

    Each call asks ``owner`` for its current :class:`ClipState`: None (the
    patch reverted: the name was kept somewhere) or ``idle(state)`` true
    (``wrapper`` would only call ``original``) and the call goes to
    ``original`` directly (the idle path costs one Python frame); else to
    ``wrapper(state, original, instance, args, kwargs)``.

    * A plain FunctionWrapper passes ``isinstance(w, types.FunctionType)`` (it
      proxies ``__class__``), so dynamo takes it for torch's function, inlines
      that code and then fails building a closure guard on the proxy ("Guard
      failed on the same frame it was created"). This one reports its own
      class; dynamo traces its ``__call__``, which, while compiling, is torch's
      function itself: compiled code (fullgraph included) clips as torch does.
    * ``copy``/``deepcopy`` return the wrapper itself and pickling stores a
      reference to the module attribute, as for a function (wrapt refuses both);
      a wrapper that is no longer that attribute pickles as torch's function.
    """

    def bound(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = owner.clip  # (wrapt calls this for the function bound as a method)
        return wrapped(*args, **kwargs) if state is None else wrapper(state, wrapped, instance, args, kwargs)

    class SafeFunctionWrapper(wrapt.FunctionWrapper[Any, Any]):
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            return type(self)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return original(*args, **kwargs)
            state = owner.clip
            if state is None or (idle is not None and idle(state)):
                return original(*args, **kwargs)
            return wrapper(state, original, None, args, kwargs)  # what wrapt calls for a function

        def __copy__(self) -> SafeFunctionWrapper:
            return self

        def __deepcopy__(self, memo: dict[int, Any]) -> SafeFunctionWrapper:
            return self

        def __reduce_ex__(self, protocol: Any) -> str | tuple[Any, ...]:
            name = original.__qualname__
            if getattr(sys.modules.get(original.__module__), name, None) is self:
                return name  # a reference to the module attribute: loads with or without ampguard
            # Not the module attribute (held across an uninstall): pickled as torch's function (copy.copy gives a
            # function back as it is), which it behaves as now.
            return copy.copy, (original,)

    SafeFunctionWrapper.__name__ = SafeFunctionWrapper.__qualname__ = "SafeFunctionWrapper"
    return SafeFunctionWrapper(original, bound)


_Wrapper = TypeVar("_Wrapper", bound=Callable[..., Any])


def contained(where: str) -> Callable[[_Wrapper], _Wrapper]:
    """For a wrapt wrapper of a clip function: a failure of ampguard's code falls back to torch's function.

    The wrapper is handed torch's function through :func:`containment.torch_call`,
    so torch's own errors reach the caller unchanged; parameters given as a
    generator are read once here, so that the fallback gets them all again.
    Where torch's function refuses the call with the same error
    (``max_norm=None``, a ``norm_type`` that is no number) the error is the
    caller's, raised as torch raises it, and no failure of ampguard's is
    reported.
    """

    def decorate(inner: _Wrapper) -> _Wrapper:
        @functools.wraps(inner)
        def wrapper(
            state: ClipState, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            args, kwargs, again = _generator_read_once(args, kwargs)
            try:
                return inner(state, functools.partial(containment.torch_call, wrapped), instance, args, kwargs)
            except Exception as error:
                passing = containment.passes_through(error)
                if passing is not None:
                    raise passing from None
                args, kwargs = again()
                try:
                    result = wrapped(*args, **kwargs)
                except Exception as refused:
                    # The same error from torch's own function: the caller's arguments, not ampguard's failure.
                    if type(refused) is not type(error) or str(refused) != str(error):
                        containment.report(where, error)
                    raise refused from None
                containment.report(where, error)
                return result

        return cast(_Wrapper, wrapper)

    return decorate


def _generator_read_once(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """``args``/``kwargs`` with a generator of parameters replaced by a fresh one, and a way to get another."""
    positional = bool(args) and isinstance(args[0], types.GeneratorType)
    key = None
    if not positional:
        for name, value in kwargs.items():  # (a loop: no generator frame per argument at every clip)
            if isinstance(value, types.GeneratorType):
                key = name
                break
    if not positional and key is None:
        return args, kwargs, lambda: (args, kwargs)
    items = list(args[0] if key is None else kwargs[key])

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        # The list itself when it has parameters (torch's functions list them first; no generator frame per
        # parameter at every clip); a generator when empty, for torch's "empty generator" warning.
        given = items if items else (p for p in items)
        if key is None:
            return (given, *args[1:]), kwargs
        return args, {**kwargs, key: given}

    new_args, new_kwargs = fresh()
    return new_args, new_kwargs, fresh


def record_deprecation(deprecated: Callable[..., Tensor]) -> tuple[type[Warning], str] | None:
    """The warning torch's deprecated ``clip_grad_norm`` issues (its category and message differ by release)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            deprecated([], 1.0)  # no parameters: nothing is computed or changed
        except Exception:
            return None
    for warning in caught:
        if "deprecated" in str(warning.message):
            return warning.category, str(warning.message)
    return None


def caller_stacklevel() -> int:
    """``stacklevel`` that makes a warning issued by a wrapper here point at the wrapper's caller."""
    level = 1
    frame: types.FrameType | None = sys._getframe(1)
    # Skip this package's frames and wrapt's (when it runs without its C extension).
    while frame is not None and (
        os.path.dirname(frame.f_code.co_filename) == _PACKAGE_DIR or frame.f_code.co_filename.startswith(_WRAPT_DIR)
    ):
        frame = frame.f_back
        level += 1
    return level
