"""The dispatch mode of a watched forward pass: which op outputs hold values worth measuring, handed to the watch.

Every aten op's output reaches :meth:`Observer.__torch_dispatch__`; views are
skipped (their values are their base's), and so is memory no op wrote:

* the outputs of ``empty``, ``empty_like``, ``new_empty``, ``empty_strided``
  (and ``resize_``) hold whatever the allocator had there: an MoE layer's
  dispatch buffer (``out = torch.empty_like(x); out[sel] = expert(x[sel])``)
  or a Dropout mask on the CPU (``empty_like`` + ``bernoulli_``);
* an in-place write into such a buffer (``index_put_``, ``copy_`` into a slice,
  ``bernoulli_``) returns the whole buffer, written or not: not measured either.
  The values written were measured where they were made; an out-of-place op
  reading the buffer later is measured as any other (by then a model has filled
  it). A kernel writing into the buffer outside aten (Triton, bitsandbytes) is
  seen the same way: not until an aten op makes something of it.

Where the watch cannot look, it steps aside and says so once (INFO):

* a higher-order operator (``flex_attention``, ``torch.cond``, ``torch.while_loop``)
  runs as without the mode, unobserved inside; its outputs are measured;
* compiled code runs compiled (:meth:`Observer.ignore_compile_internals`: dynamo
  turns the mode off while it compiles and does not fall back to eager for it,
  so ``fullgraph=True`` works); a compiled submodule is not watched inside
  (:mod:`ampguard.headroom_watch.watch`), a compiled helper function inside a
  watched module is seen by its outputs.

On a torch whose dispatch modes cannot do either (torch 2.3 in CI), the
observer registers itself with each higher-order operator (the same pass-through,
taken off when the watch stops), and a model holding a compiled submodule is not
watched (dynamo would trace the mode into its graph); a compiled helper function
runs compiled when dynamo compiled it before the watched step (at its first call,
usually step 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # a torch that moved it: the watch reports itself unavailable
    TorchDispatchMode = None  # type: ignore[assignment, misc]

try:
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - every supported torch has it
    StorageWeakRef = None  # type: ignore[assignment, misc]

# Ops whose output holds memory nobody wrote.
UNWRITTEN = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::new_empty",
        "aten::empty_strided",
        "aten::new_empty_strided",
        "aten::empty_permuted",
        "aten::resize_",
        "aten::resize_as_",
    }
)

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _compile_aware() -> bool:
    """Whether this torch's dispatch modes can let compiled code and higher-order operators through."""
    return TorchDispatchMode is not None and all(
        hasattr(TorchDispatchMode, name) for name in ("ignore_compile_internals", "supports_higher_order_operators")
    )


COMPILE_AWARE = _compile_aware()


def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument ``func`` writes into, ``out=`` arguments excepted (fully written)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is not None and alias.is_write and not (argument.kwarg_only and argument.name.startswith("out")):
            written.append((index, argument.name))
    return tuple(written)


class UnwrittenMemory:
    """The storages of one watched pass that hold memory no op wrote (weakly: a freed one is forgotten)."""

    def __init__(self) -> None:
        self._storages: dict[int, Any] = {}
        self._written: dict[Any, tuple[tuple[int, str], ...]] = {}

    def clear(self) -> None:
        self._storages = {}

    def note(self, output: Any) -> None:
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and StorageWeakRef is not None:
                storage = tensor.untyped_storage()
                self._storages[storage._cdata] = StorageWeakRef(storage)

    def holds(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor) or not self._storages:
            return False
        ref = self._storages.get(tensor.untyped_storage()._cdata)
        return ref is not None and not ref.expired()

    def writes_into(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``func`` writes into memory no op wrote before (its output then shows unwritten parts too)."""
        if not self._storages:
            return False
        written = self._written.get(func)
        if written is None:
            written = self._written[func] = _written_arguments(func)
        for index, name in written:
            value = args[index] if index < len(args) else kwargs.get(name)
            if self.holds(value):
                return True
        return False


def measurable(tensor: Any) -> bool:
    """A dense float16 tensor with values, of torch's own class (a subclass's aminmax may not exist)."""
    return (
        type(tensor) in _PLAIN_TENSORS
        and tensor.dtype == torch.float16
        and tensor.layout == torch.strided
        and not tensor.is_nested  # (nn.TransformerEncoder's fast path: no aminmax for them)
        and bool(tensor.numel())
    )


def _higher_order_operators() -> list[Any]:
    return list(getattr(torch._ops, "_higher_order_ops", {}).values())


def let_higher_order_operators_through() -> None:
    """On a torch without ``supports_higher_order_operators``: each one runs as without the mode, said once."""
    for operator in _higher_order_operators():
        table = getattr(operator, "python_key_mode_table", None)
        if table is not None and Observer not in table:
            operator.py_impl(Observer)(_pass_through(operator))


def forget_higher_order_operators() -> None:
    """Take the registrations of :func:`let_higher_order_operators_through` off again."""
    if COMPILE_AWARE:
        return
    for operator in _higher_order_operators():
        table = getattr(operator, "python_key_mode_table", None)
        if table is not None and Observer in table:
            del table[Observer]
            getattr(operator, "_dispatch_cache", {}).clear()


def _pass_through(operator: Any) -> Callable[..., Any]:
    def run(mode: Any, *args: Any, **kwargs: Any) -> Any:  # called with the mode off
        output = operator(*args, **kwargs)
        mode._observe(lambda: mode._higher_order(operator, output))
        return output

    return run


if TorchDispatchMode is not None:

    class Observer(TorchDispatchMode):
        """Each aten op's output during a watched forward pass, handed to ``measure`` when it holds written values.

        ``measure(output)`` records the output; ``fail(error)`` stops the watch;
        ``step_aside(what)`` is told once per kind of region not observed inside.
        """

        supports_higher_order_operators = True

        def __init__(
            self,
            measure: Callable[[Any], None],
            fail: Callable[[Exception], None],
            step_aside: Callable[[str], None],
            unwritten: UnwrittenMemory,
        ) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            if not COMPILE_AWARE:
                let_higher_order_operators_through()
            self.measure = measure
            self.fail = fail
            self.step_aside = step_aside
            self.unwritten = unwritten

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # Off while dynamo compiles, on while the compiled code runs: dynamo does not skip frames for it.
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):  # the mode is off inside: torch's own result
                output = func(*args, **kwargs)
                self._observe(lambda: self._higher_order(func, output))
                return output
            output = func(*args, **kwargs)
            if not func.is_view:
                self._observe(lambda: self._op(func, args, kwargs, output))
            return output

        def _observe(self, observe: Callable[[], None]) -> None:
            try:
                observe()
            except Exception as error:  # a measurement must never break the forward pass
                self.fail(error)

        def _higher_order(self, func: Any, output: Any) -> None:
            self.step_aside(str(getattr(func, "_name", None) or func))
            self.measure(output)

        def _op(self, func: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if func._schema.name in UNWRITTEN:
                self.unwritten.note(output)
            elif not self.unwritten.writes_into(func, args, kwargs):
                self.measure(output)

else:  # pragma: no cover
    Observer = None  # type: ignore[assignment, misc]
