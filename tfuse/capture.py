"""A whole training step in one CUDA graph: :func:`capture_step`.

torch's whole-network recipe (``torch.cuda.graphs``: warm-up on a side stream, capture, replay) with the checks it
leaves to you, each refusal naming the layer or optimizer and what to do: host state in optimizers, batch norm with
``momentum=None`` in training, gloo collectives, host syncs or copies in the step, hyperparameters changed later.

Example (on a GPU)::

    lr = torch.tensor(0.1, device="cuda")  # change it in place: lr.fill_(0.05)
    model, optimizer = tfuse.setup(net, "momentum", example_inputs=(x,), lr=lr, capturable=True)

    def train_step(x, y):
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        tfuse.optim.clip_grad_norm_(optimizer, 1.0)
        optimizer.step()
        return loss.detach()

    step = tfuse.capture_step(train_step, x, y, optimizers=optimizer, models=model)
    for x, y in loader:
        loss = step(x, y)  # copies x, y into the graph's inputs, replays; loss is overwritten by the next call

Refused before anything runs (here on a CPU):

    >>> import torch, tfuse
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = tfuse.optim.FusedSGD(model.parameters(), lr=0.1)
    >>> tfuse.capture_step(lambda x: model(x).sum(), torch.randn(3, 4), optimizers=optimizer)
    Traceback (most recent call last):
    ...
    ValueError: capture_step: FusedSGD was built with capturable=False: ...
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from tfuse.distributed.data_parallel import FusedDataParallel
from tfuse.optim import FlatOptimizer

__all__ = ["CapturedStep", "capture_step"]

MIN_WARMUP, DDP_MIN_WARMUP = 3, 11  # step 2 still makes state (FusedAdam's tables past step 1); DDP: torch's docs


class CapturedStep:
    """A training step captured in one CUDA graph (see :func:`tfuse.capture_step`).

    ``step(*inputs)`` copies ``inputs`` (captured shapes and dtypes; ``non_blocking``) into ``static_inputs``,
    replays, and returns ``static_outputs``: the same tensors at every call, **overwritten by the next replay**
    (``.clone()`` what you keep); :meth:`replay` does not copy. A replay first checks that no optimizer hyperparameter
    changed. It keeps alive the graph, its memory pool (``pool``), the static tensors, optimizers and modules. The
    step's Python ran once: ``train()``/``eval()``, new parameters or state dicts, an LR scheduler called in the step
    are not replayed (call schedulers between steps, on a tensor lr).
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple, outputs: Any, optimizers: tuple, modules: tuple):
        self.graph, self.pool = graph, graph.pool()
        self.static_inputs, self.static_outputs = inputs, outputs
        self.optimizers, self.modules = optimizers, modules
        self._frozen = _FrozenHyperparameters(optimizers)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"CapturedStep: takes {len(self.static_inputs)} input(s), as captured; got {len(inputs)}")
        for index, (static, new) in enumerate(zip(self.static_inputs, inputs)):
            if new is static:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                got = f"{list(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
                raise ValueError(
                    f"CapturedStep: input {index} must be a {list(static.shape)} {static.dtype} tensor, as captured, "
                    f"got {got}; a graph replays fixed shapes (capture one step per shape, or drop a short last batch)"
                )
            static.copy_(new, non_blocking=True)
        return self.replay()

    def replay(self) -> Any:
        """Replays the graph on the current stream with the static inputs as they are; returns the static outputs."""
        self._frozen.check()
        self.graph.replay()
        return self.static_outputs


def capture_step(
    step_fn: Callable[..., Any],
    *example_args: torch.Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    models: nn.Module | Sequence[nn.Module] = (),
    warmup: int = MIN_WARMUP,
    pool: Any = None,
) -> CapturedStep:
    """Captures ``step_fn(*example_args)``, a whole training step, in one CUDA graph; returns it as a callable.

    ``step_fn`` runs ``zero_grad`` (``set_to_none=False`` keeps gradients where the graph writes them), the forward
    under autocast (entered inside ``step_fn``), loss, backward, clipping and ``optimizer.step()`` (a ``GradScaler``
    works when its optimizers take ``found_inf`` on the device: tfuse's fused ones, torch's ``fused=True`` ones; bf16
    needs none), and returns tensors (or tuples, lists, dicts of them, or None), which are detached.

    The inputs are copied into static tensors; ``step_fn`` runs ``warmup`` times on a side stream, the last time
    under ``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises there, with its traceback), then is
    captured under the same check, copies from host memory refused (a replay would re-read that memory). **The
    warm-up steps are real steps** on the example inputs; the replays go on from there.

    Args:
        step_fn: the step, called with the static input tensors.
        example_args: the step's inputs (CUDA tensors: a batch and its targets, say); constants go in a closure.
        optimizers: checked before anything runs: tfuse's fused or torch's optimizers with ``capturable=True`` (or
            ``torch.optim.SGD(fused=True)``). A tensor lr on the parameters' device is read at every replay (change
            it in place); a float lr is fixed at capture (a replay after it changed raises).
        models: checked before anything runs: batch norm ``momentum=None`` in training, FusedDataParallel's, DDP's
            and SyncBatchNorm's backend and options. Modules and optimizers met in the warm-up are checked too,
            before the checked step: one left out here cannot slip into the graph.
        warmup: warm-up steps, at least 3 (11 with torch's DistributedDataParallel).
        pool: a memory pool to share with another graph (``other.pool``), as ``torch.cuda.graph`` takes it.
    """
    _check_arguments(step_fn, example_args, warmup)
    optimizers = _as_tuple(optimizers, torch.optim.Optimizer, "optimizers", "torch.optim.Optimizer")
    models = _as_tuple(models, nn.Module, "models", "torch.nn.Module")
    _check_setup(optimizers, models, warmup)
    device = _check_device(example_args, optimizers, models)
    static_inputs = tuple(arg.detach().clone().requires_grad_(arg.requires_grad) for arg in example_args)

    met: dict[int, Any] = {id(x): x for x in (*optimizers, *models)}  # what the warm-up runs joins them, in order
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.device(device), torch.cuda.stream(side):
        _warm_up(step_fn, static_inputs, warmup - 1, met)
        optimizers = tuple(x for x in met.values() if isinstance(x, torch.optim.Optimizer))
        modules = tuple(x for x in met.values() if isinstance(x, nn.Module))
        _check_setup(optimizers, modules, warmup)
        with _no_host_sync("the last warm-up step"):
            _detached(step_fn(*static_inputs))
    torch.cuda.current_stream(device).wait_stream(side)

    graph, where = torch.cuda.CUDAGraph(), "the captured step"
    with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool), _no_host_sync(where), _NoHostCopies("cuda"):
        static_outputs = _detached(step_fn(*static_inputs))
    return CapturedStep(graph, static_inputs, static_outputs, optimizers, modules)


def _check_setup(optimizers: Sequence[torch.optim.Optimizer], models: Sequence[nn.Module], warmup: int) -> None:
    """Raises if an optimizer or module cannot be captured; modules are named within the first model holding them."""
    for optimizer in optimizers:
        _check_optimizer(optimizer)
    names: dict[int, str] = {}
    for root in models:
        if id(root) not in names:
            for name, module in root.named_modules():
                names.setdefault(id(module), repr(name) if name else f"({type(module).__name__})")
                _check_module(module, names[id(module)], warmup)


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    name, groups = type(optimizer).__name__, optimizer.param_groups
    if isinstance(optimizer, FlatOptimizer):
        if not optimizer.capturable:
            raise ValueError(
                f"capture_step: {name} was built with capturable=False: its step counts live on the host and its "
                "coefficient table is copied from host memory, which a graph would replay unchanged. Build it with "
                "capturable=True (tfuse.setup passes it on) and give lr as a tensor on the GPU"
            )
    elif not all(group.get("capturable") is True for group in groups) and not (
        isinstance(optimizer, torch.optim.SGD) and all(group.get("fused") for group in groups)
    ):
        raise ValueError(
            f"capture_step: {name} lacks capturable=True in some parameter group: its step keeps or reads step "
            "counts on the host, which a graph would replay unchanged. Build it with capturable=True "
            "(torch.optim.SGD: fused=True), or use tfuse's fused optimizer with capturable=True"
        )


def _check_module(module: nn.Module, name: str, warmup: int) -> None:
    kind = type(module).__name__
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        if module.momentum is None and module.track_running_stats:
            raise ValueError(
                f"capture_step: batch norm layer {name} ({kind}) has momentum=None in training: its cumulative "
                "average reads num_batches_tracked on the host at every step (a sync; a graph would keep the "
                "captured factor). Give it a float momentum (layer.momentum = 0.1), or capture it in eval mode"
            )
        if isinstance(module, nn.SyncBatchNorm):
            _check_backend(f"SyncBatchNorm layer {name} ({kind}) all-gathers statistics", module.process_group)
    elif isinstance(module, FusedDataParallel):
        what = f"capture_step: FusedDataParallel {name}"
        if module.find_unused_parameters:
            raise ValueError(
                f"{what} has find_unused_parameters=True: at the end of every backward its reducer copies a host "
                "tensor of which parameters got a gradient to the GPU, all-reduces it and reads it back (.tolist(), "
                "a sync). Make every parameter take part in the loss and wrap with find_unused_parameters=False"
            )
        if module.gradient_merge_steps != 1:
            raise ValueError(
                f"{what} has gradient_merge_steps={module.gradient_merge_steps}: which backward all-reduces is "
                "counted on the host, and a graph would replay the captured pass's choice at every step. Use 1, and "
                "run the micro-batches inside step_fn, all but the last under model.no_sync()"
            )
        if module.communication != "all_reduce":
            raise ValueError(
                f"{what} is in no_sync(), driven by LocalSGD or sharded, or it overlaps its optimizer's step "
                f"(communication {module.communication!r}): host-driven phases, not captured"
            )
        # Even with one rank: its reducer issues an all-reduce per bucket in every backward.
        _check_backend(f"FusedDataParallel {name} all-reduces gradients (one rank too)", module.process_group, True)
    elif isinstance(module, nn.parallel.DistributedDataParallel):
        _check_backend(f"DistributedDataParallel {name} all-reduces gradients", module.process_group)
        if warmup < DDP_MIN_WARMUP:
            raise ValueError(
                f"capture_step: torch's DistributedDataParallel needs warmup={DDP_MIN_WARMUP} (torch.cuda.graphs "
                f"docs; build it on a side stream too), got {warmup}; or use tfuse.distributed.FusedDataParallel"
            )


def _check_backend(what: str, group: Any, any_size: bool = False) -> None:
    """Raises unless the collectives of ``what`` on GPU tensors go through NCCL (gloo's go through host memory)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD if group is None else group
    if not any_size and dist.get_world_size(group) == 1:
        return  # nothing is synchronised: no collective runs
    backend = str(dist.get_backend(group))
    if ":" in backend:  # a backend per device, e.g. "cpu:gloo,cuda:nccl"
        backend = dict(part.split(":", 1) for part in backend.split(",")).get("cuda", backend)
    if backend.lower() != "nccl":
        raise ValueError(
            f"capture_step: {what} with the {backend} backend, whose collectives on GPU tensors go through host "
            "memory and cannot be captured in a CUDA graph; initialise the process group with the NCCL backend "
            "(NCCL collectives can be captured)"
        )


def _check_arguments(step_fn: Any, example_args: tuple, warmup: Any) -> None:
    if not callable(step_fn):
        raise TypeError(f"capture_step: step_fn must be callable, got {type(step_fn).__name__}")
    for index, arg in enumerate(example_args):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(
                f"capture_step: example input {index} is a {type(arg).__name__}, not a tensor; inputs are copied into "
                "static tensors at every call, so each must be a tensor (pass constants in a closure)"
            )
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < MIN_WARMUP:
        raise ValueError(
            f"capture_step: warmup must be an int >= {MIN_WARMUP}, got {warmup!r}: the first steps make "
            "lazy state (optimizer state, compiled kernels, tables), the last is checked for syncs"
        )


def _as_tuple(value: Any, kind: type, what: str, kind_name: str) -> tuple:
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"capture_step: {what} must be a {kind_name} or a list of them, got {type(item).__name__}")
    return items


def _check_device(
    example_args: tuple[torch.Tensor, ...], optimizers: Sequence[torch.optim.Optimizer], models: Sequence[nn.Module]
) -> torch.device:
    """The one CUDA device of the inputs, models and optimizers; raises naming the first tensor elsewhere."""
    tensors = [(f"example input {i}", arg) for i, arg in enumerate(example_args)]
    for i, model in enumerate(models):
        tensors += [(f"parameter {n!r} of models[{i}]", p) for n, p in model.named_parameters()]
        tensors += [(f"buffer {n!r} of models[{i}]", b) for n, b in model.named_buffers()]
    for i, optimizer in enumerate(optimizers):  # a tensor lr elsewhere would be copied at every step
        tensors += [(f"a parameter of optimizers[{i}]", p) for g in optimizer.param_groups for p in g["params"]]
        tensors += [(f"lr of optimizers[{i}]", g["lr"]) for g in optimizer.param_groups if torch.is_tensor(g.get("lr"))]
    device = None
    for what, tensor in tensors:
        if tensor.device.type != "cuda" or (device is not None and tensor.device != device):
            raise RuntimeError(
                f"capture_step: {what} is on {tensor.device}; a CUDA graph captures the work of one GPU: put the "
                f"inputs, the model and the optimizer on {device or 'a GPU'}"
            )
        device = tensor.device
    if not torch.cuda.is_available():
        raise RuntimeError("capture_step: CUDA is not available; a CUDA graph needs a GPU")
    if torch.is_autocast_enabled("cuda"):
        raise RuntimeError(
            "capture_step: called inside torch.autocast (its weight cache would feed the capture "
            "the warm-up's casts of the weights); enter autocast inside step_fn, around the forward"
        )
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("capture_step: called while the current stream is capturing a CUDA graph")
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


def _warm_up(step_fn: Callable[..., Any], inputs: tuple, steps: int, met: dict[int, Any]) -> None:
    """Runs ``steps`` steps; every module called and optimizer stepped joins ``met`` (by id, in order)."""

    def meet(thing: Any, *args: Any) -> None:  # a pre-hook returning None changes nothing
        met.setdefault(id(thing), thing)

    hooks = [register_module_forward_pre_hook(meet), register_optimizer_step_pre_hook(meet)]
    try:
        for _ in range(steps):
            _detached(step_fn(*inputs))
    finally:
        for hook in hooks:
            hook.remove()


def _detached(value: Any, where: str = "step_fn's result") -> Any:
    """``value`` with its tensors detached (no autograd graph kept alive across steps); raises on anything else."""
    if value is None or isinstance(value, torch.Tensor):
        return value if value is None else value.detach()
    if isinstance(value, (tuple, list)):
        items = [_detached(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _detached(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(
        f"capture_step: {where} is a {type(value).__name__}; a replay runs only the captured GPU work: "
        "return tensors (loss.detach(), not loss.item()), tuples, lists or dicts of them, or None"
    )


@contextlib.contextmanager
def _no_host_sync(where: str) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` in the block; a sync raises, naming ``where``."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as error:
        if "synchroniz" not in str(error):
            raise
        raise RuntimeError(
            f"capture_step: step_fn synchronizes the host with the GPU in {where} ({error}), which a CUDA graph cannot "
            "contain (the traceback shows where): .item(), float() or print of a GPU tensor, GradScaler.step with an "
            "optimizer that does not take found_inf on the device (tfuse's fused and torch's fused=True ones do), "
            "clip_grad_norm_(error_if_nonfinite=True), torch.tensor(..., device='cuda')?"
        ) from error
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class _NoHostCopies(TorchDispatchMode):
    """Refuses copies from host memory to ``device_type``: captured, they would re-read that memory at every replay."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        source = None
        if func is torch.ops.aten.copy_.default and args[0].device.type == self.device_type:
            source = args[1]
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            source = args[0] if torch.device(kwargs["device"]).type == self.device_type else None
        if isinstance(source, torch.Tensor) and source.device.type == "cpu":
            raise RuntimeError(
                f"capture_step: step_fn copies a {list(source.shape)} {source.dtype} tensor from host memory to the "
                f"{self.device_type} device ({func}); a replay would re-read that host memory, not your new values. "
                "Make the tensor on the device once, outside the step, or make it an input of the step"
            )
        return func(*args, **kwargs)


class _FrozenHyperparameters:
    """The optimizers' parameter groups as captured; :meth:`check` raises if one changed (host only, no GPU work)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.groups = [(optimizer, list(optimizer.param_groups)) for optimizer in optimizers]
        self.entries = [  # (name, group, its keys but params, their values as captured)
            (f"{type(optimizer).__name__} param group {index}", group, keys, tuple(map(group.get, keys)))
            for optimizer, groups in self.groups
            for index, group in enumerate(groups)
            for keys in [tuple(key for key in group if key != "params")]
        ]

    def check(self) -> None:
        for optimizer, groups in self.groups:
            if len(optimizer.param_groups) != len(groups) or not all(map(operator.is_, optimizer.param_groups, groups)):
                raise RuntimeError(
                    f"CapturedStep: {type(optimizer).__name__}'s param groups changed (load_state_dict?): capture again"
                )
        for where, group, keys, values in self.entries:
            now = tuple(map(group.get, keys))
            if all(map(operator.is_, now, values)):
                continue
            for key, new, old in zip(keys, now, values):
                tensor = torch.is_tensor(new) or torch.is_tensor(old)
                if new is not old and (tensor or new != old):
                    raise RuntimeError(
                        f"CapturedStep: {where}: {key!r} {'is another tensor' if tensor else f'is {new!r}'} since "
                        f"capture{'' if tensor else f' (captured: {old!r})'}, but a graph keeps the values and tensors "
                        "it was captured with. Give lr as a tensor on the GPU and change it in place (group['lr']"
                        ".fill_(value); torch's LR schedulers do so for a tensor lr), or capture the step again"
                    )
