"""What tfuse's ``torch.library`` operators share: which backend a traced call takes, dtype codes.

tfuse's ops are registered with ``torch.library.triton_op`` (namespace
``tfuse``: ``torch.ops.tfuse.add``, ``torch.ops.tfuse.add_act``, ...), each
with its fake implementation and its autograd formula, when ``torch._dynamo``
is first imported (see :func:`register_library`: registering imports Inductor). An op's body is the
same code on every path:

* eager, real tensors: the backend chosen by tfuse's rules (Triton kernels on
  CUDA and under the interpreter, the PyTorch path otherwise);
* traced (``torch.compile``, ``make_fx``, ``torch.library.opcheck``), fake
  tensors: the PyTorch path, on every device, which Inductor compiles into
  its own fused code. Not the Triton kernels, yet: Triton's interpreter
  cannot run on fake tensors (CPU), and on CUDA several kernels write
  through tuple arguments (the add_act backward's partial sums, for one),
  whose writes ``torch.library.wrap_triton``'s functionalization does not
  track (it follows top-level tensor arguments only), so Inductor could
  reorder or reuse those buffers. Handing the kernels to Inductor needs
  those arguments flattened and a GPU to verify it.

Each op is written once, as an :class:`OpDef` (body, setup_context,
backward), which builds both its ``torch.library`` registration and its eager
autograd Function. The public functions (``tfuse.add_act``, the nn modules)
call the registered op when ``torch.compile`` traces them and the eager
Function otherwise: the same body and backward either way, without the
dispatcher's host overhead (about 0.1 ms per call measured on a 2-core CPU)
on the eager path.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Iterable

import torch

from tfuse._backend import Backend, select_backend, triton_available

#: dtypes by the small integer codes op schemas carry them as (schemas have no list of dtypes).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_code(dtype: torch.dtype) -> int:
    """The code of ``dtype`` in :data:`DTYPES`."""
    return DTYPES.index(dtype)


def is_traced(tensor: torch.Tensor | None) -> bool:
    """True for a fake tensor (or a functional wrapper of one): the op is being traced, not run."""
    if tensor is None:
        return False
    return torch._subclasses.fake_tensor.is_fake(tensor)


def op_backend(device: torch.device, op: str, probe: torch.Tensor, elements: int | None = None) -> Backend:
    """The backend an op body takes for tensors like ``probe`` on ``device`` (``elements``: the op's size).

    tfuse's rules (:func:`tfuse.select_backend`, with the size rule on
    ``elements``, ``probe``'s by default) for real tensors; the PyTorch path
    for a traced call (see the module docstring).
    """
    backend = select_backend(device, op, probe.numel() if elements is None else elements)
    if backend is Backend.TRITON and is_traced(probe):
        return Backend.TORCH
    return backend


def compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) traces the caller: public functions then call the ops."""
    return torch.compiler.is_compiling()


class OpDef:
    """One op written once: its body, what it keeps for backward, and its backward.

    From these three functions tfuse builds both ways the op runs:

    * the eager autograd Function (:meth:`apply`), which calls the body and
      the backward as plain Python, without the dispatcher's host overhead;
    * the ``torch.library`` op (``torch.ops.tfuse.<name>``), registered by
      :func:`register_library` with the same body, ``setup_context`` and
      ``backward``, which ``torch.compile`` traces.

    The body's positional parameters are the op's schema (tensors, one list of
    tensors at most, ints, floats, bools). Its keyword-only parameters are
    eager extras: what the eager caller has already worked out (the backend,
    a launch plan) or eager-only behaviour (writing running statistics in
    place); they default to the registered op's behaviour, and
    ``setup_context`` receives them too. ``backward(ctx, *grads)`` sees
    ``ctx.needs_input_grad`` shaped like the schema (a list for the list of
    tensors) and returns gradients shaped the same way, on both paths.

    Example:
        >>> import torch
        >>> from tfuse.ops._library import tfuse_op
        >>> def twice_setup(ctx, inputs, output):
        ...     pass
        >>> def twice_backward(ctx, grad):
        ...     return 2 * grad
        >>> @tfuse_op("tfuse::doc_twice", setup_context=twice_setup, backward=twice_backward)
        ... def twice(x: torch.Tensor) -> torch.Tensor:
        ...     return 2 * x
        >>> x = torch.ones(3, requires_grad=True)
        >>> twice.apply(x).sum().backward()
        >>> x.grad
        tensor([2., 2., 2.])
    """

    def __init__(
        self,
        name: str,
        body: Callable,
        *,
        mutates_args: Iterable[str] = (),
        setup_context: Callable | None = None,
        backward: Callable | None = None,
    ) -> None:
        if (setup_context is None) != (backward is None):
            raise TypeError(f"{name}: give both setup_context and backward, or neither")
        self.name, self.body, self.mutates_args = name, body, tuple(mutates_args)
        self.setup_context, self.backward = setup_context, backward
        signature = inspect.signature(body)
        schema = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        self._schema_signature = signature.replace(parameters=schema)
        lists = [i for i, p in enumerate(schema) if "list[torch.Tensor]" in str(p.annotation)]
        if len(lists) > 1:
            raise TypeError(f"{name}: at most one list of tensors per op (the eager Function flattens it)")
        self._list_at: int | None = lists[0] if lists else None
        self.function: type[torch.autograd.Function] | None = None
        if backward is not None:
            self.function = _eager_function(self)
        self.op: torch.library.CustomOpDef | None = None
        _PENDING.append(self)

    def apply(self, *args, **eager):  # type: ignore[no-untyped-def]
        """Runs the op through its eager autograd Function (``eager``: the body's keyword-only extras)."""
        at = self._list_at
        if at is None:
            return self.function.apply(0, eager, *args)  # type: ignore[union-attr]
        tensors = args[at]
        return self.function.apply(len(tensors), eager, *args[:at], *tensors, *args[at + 1 :])  # type: ignore[union-attr]

    def call(self, *args):  # type: ignore[no-untyped-def]
        """The op without autograd: the registered op while tracing (so the graph holds it), else the body."""
        if compiling() or any(isinstance(a, torch.Tensor) and is_traced(a) for a in args):
            register_library()
            return getattr(torch.ops.tfuse, self.name.split("::")[1])(*args)
        return self.body(*args)

    def __call__(self, *args, **eager):  # type: ignore[no-untyped-def]
        return self.body(*args, **eager)

    def register(self) -> None:
        """Registers the op with torch.library (once): the body as its implementation (and fake, without
        Triton), ``setup_context`` and ``backward`` as its autograd formula."""
        if self.op is not None:
            return
        registered = _schema_function(self.body, self._schema_signature)
        if triton_available():
            op = torch.library.triton_op(self.name, mutates_args=self.mutates_args)(registered)
        else:
            op = torch.library.custom_op(self.name, mutates_args=self.mutates_args)(registered)
            op.register_fake(registered)
        if self.backward is not None:
            op.register_autograd(self.backward, setup_context=self.setup_context)
        self.op = op


def _schema_function(body: Callable, signature: inspect.Signature) -> Callable:
    """``body`` seen through its schema ``signature`` (its positional parameters: the eager extras left
    out), for torch.library to infer the op's schema from. The function lives in ``body``'s module, so
    that string annotations (``from __future__ import annotations``) evaluate there."""

    def registered(*args):  # type: ignore[no-untyped-def]
        return body(*args)

    fn = types.FunctionType(registered.__code__, body.__globals__, body.__name__, None, registered.__closure__)
    fn.__signature__ = signature  # type: ignore[attr-defined]
    fn.__doc__, fn.__module__, fn.__qualname__ = body.__doc__, body.__module__, body.__qualname__
    return fn


def _nest(at: int | None, length: int, flat: tuple) -> tuple:
    """The schema's arguments from the eager Function's flat ones (the list of tensors rebuilt)."""
    if at is None:
        return flat
    return (*flat[:at], list(flat[at : at + length]), *flat[at + length :])


def _eager_function(op: OpDef) -> type[torch.autograd.Function]:
    """The autograd Function of ``op``'s eager path: ``apply(list_length, eager_extras, *flat_args)``.

    Its backward shapes ``ctx.needs_input_grad`` as the schema (as torch.library does for
    the registered op) and flattens the gradient list back, so ``op.backward`` is the same
    function on both paths.
    """
    at, body, setup, backward = op._list_at, op.body, op.setup_context, op.backward

    # forward takes ctx and calls setup itself: a Function with a separate setup_context staticmethod has
    # torch bind every call's arguments through inspect.signature (~10 us a call on a small CPU).
    def forward(ctx, length, eager, *flat):  # type: ignore[no-untyped-def]
        inputs = _nest(at, length, flat)
        output = body(*inputs, **eager)
        ctx.tfuse_list_length = length
        setup(ctx, inputs, output, **eager)
        return output

    def run_backward(ctx, *grads):  # type: ignore[no-untyped-def]
        length = ctx.tfuse_list_length
        flags = ctx.needs_input_grad
        ctx.needs_input_grad = _nest(at, length, flags[2:])
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = flags
        if not isinstance(result, tuple):
            result = (result,)
        if at is not None:
            listed = result[at] if result[at] is not None else [None] * length
            result = (*result[:at], *listed, *result[at + 1 :])
        return (None, None, *result)

    name = "".join(part.title() for part in op.name.split("::")[1].split("_"))
    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "backward": staticmethod(run_backward),
            "__doc__": f"The eager autograd Function of ``torch.ops.{op.name.replace('::', '.')}``.",
            "__module__": op.body.__module__,
        },
    )


_PENDING: list[OpDef] = []


def tfuse_op(
    name: str,
    mutates_args: Iterable[str] = (),
    *,
    setup_context: Callable | None = None,
    backward: Callable | None = None,
) -> Callable[[Callable], OpDef]:
    """Declares a function as the body of the op ``name`` (``tfuse::...``): an :class:`OpDef`, registered
    by :func:`register_library` as ``torch.library.triton_op`` where Triton is installed; without Triton,
    ``torch.library.custom_op`` with the body as its fake implementation too (the body then only ever
    takes the PyTorch path, and triton_op would warn that Triton is missing)."""

    def declare(fn: Callable) -> OpDef:
        return OpDef(name, fn, mutates_args=mutates_args, setup_context=setup_context, backward=backward)

    return declare


def register_library() -> None:
    """Registers tfuse's ops with torch.library (``torch.ops.tfuse.*``), once.

    Registering a ``triton_op`` imports Inductor (seconds on a small CPU), which
    a program that never compiles should not pay at ``import tfuse``. So tfuse
    registers its ops when ``torch._dynamo`` is first imported, which
    ``torch.compile`` (and torch.optim's first step) does anyway; this function
    registers them at once, for code that calls ``torch.ops.tfuse.*`` first.

    Example:
        >>> import torch, tfuse
        >>> tfuse.ops.register_library()
        >>> torch.ops.tfuse.add([torch.ones(2), torch.ones(2)])
        tensor([2., 2.])
    """
    # Registering imports torch._dynamo, whose import hook (below) registers every op: import it first, so
    # that the hook's registration is the one that happens (not a second one nested inside this loop's).
    import torch._dynamo  # noqa: F401

    for pending in _PENDING:
        pending.register()


class _RegisterAfterDynamo(importlib.abc.MetaPathFinder):
    """Registers tfuse's ops right after ``torch._dynamo`` is imported (by torch.compile, or anyone)."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # once; the spec is found by the finders after this one
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            register_library()

        loader.exec_module = exec_module
        return spec


def register_when_dynamo_loads() -> None:
    """Registers the ops now if ``torch._dynamo`` is loaded, else right after it is (see :func:`register_library`)."""
    if "torch._dynamo" in sys.modules:
        register_library()
    else:
        sys.meta_path.insert(0, _RegisterAfterDynamo())
