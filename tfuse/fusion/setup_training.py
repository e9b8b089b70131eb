"""tfuse.setup: a fused model and a fused optimizer over its flat buffers, data parallel when a group exists."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tfuse.fusion import fuse_model
from tfuse.fusion.report import FusionReport
from tfuse.fusion.strategy import FusionStrategy

logger = logging.getLogger(__name__)

#: Optimizer names -> (tfuse class name, torch class name or None) in tfuse.optim / torch.optim.
OPTIMIZERS = {
    "adamw": ("FusedAdamW", "AdamW"),
    "adam": ("FusedAdam", "Adam"),
    "sgd": ("FusedSGD", "SGD"),
    "momentum": ("FusedMomentum", "SGD"),
    "adagrad": ("FusedAdagrad", "Adagrad"),
    "lion": ("FusedLion", None),
    "lamb": ("FusedLAMB", None),
    "lars": ("FusedLARS", None),
    "muon": ("FusedMuon", "Muon"),
}


@dataclasses.dataclass
class Setup:
    """What :func:`setup` made. Unpacks as ``model, optimizer = tfuse.setup(...)``.

    Attributes:
        model: the fused model, wrapped for data parallelism when a process group exists.
        optimizer: the optimizer over its parameters (a ShardedOptimizer with ``sharding="optimizer"``).
        report: what fuse_model fused and skipped.
        local_sgd: the :class:`~tfuse.distributed.LocalSGD` driver with ``local_sgd_every`` (call its
            ``step()`` in place of ``optimizer.step()``), else None.
        summary: the lines :func:`setup` logged.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    report: FusionReport
    local_sgd: Any = None
    summary: list[str] = dataclasses.field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        yield self.model
        yield self.optimizer

    def step(self) -> None:
        """One optimizer step (through LocalSGD when it drives the optimizer)."""
        if self.local_sgd is not None:
            self.local_sgd.step()
        else:
            self.optimizer.step()


def setup(
    model: nn.Module,
    optimizer: str | type = "adamw",
    strategy: FusionStrategy | None = None,
    *,
    example_inputs: Any = None,
    process_group: dist.ProcessGroup | None = None,
    **optimizer_kwargs: Any,
) -> Setup:
    """Fuses ``model``, wraps it for data parallelism when torch.distributed is initialised, and builds the
    optimizer over its flat buffers; logs what it did.

    Steps, each steered by ``strategy`` (default :class:`FusionStrategy`):
    :func:`fuse_model` (with ``example_inputs`` for the residual and add
    patterns); under an initialised process group, ``FusedDataParallel``
    (``fuse_all_reduce_ops``; torch's DDP otherwise) with the strategy's
    bucket size, count cap and gradient merge; the optimizer, a tfuse fused
    one (``fuse_all_optimizer_ops``; torch.optim's otherwise) over the same
    flat buffers, a ShardedOptimizer (``sharding="optimizer"``) or driven by
    LocalSGD (``local_sgd_every``). The log (logger ``tfuse.fusion.setup``,
    INFO) and ``Setup.summary`` say what was fused, how many parameters were
    coalesced into how many buffers, and the gradient all-reduce calls per
    step before (one per gradient tensor) and after fusion.

    Args:
        model: the model, on its device.
        optimizer: a name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"momentum"``, ``"adagrad"``, ``"lion"``,
            ``"lamb"``, ``"lars"``, ``"muon"``) or a tfuse fused optimizer class.
        strategy: what to fuse and how to train.
        example_inputs: a tensor or tuple of the forward's inputs (see :func:`fuse_model`).
        process_group: the data-parallel group (None: the default group, when initialised).
        **optimizer_kwargs: the optimizer's arguments (``lr=...``, ``weight_decay=...``).

    Example:
        >>> import torch, tfuse
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
        >>> model, optimizer = tfuse.setup(net, "adamw", lr=1e-3)
        >>> type(model.get_submodule("0")).__name__, type(optimizer).__name__
        ('FusedLinear', 'FusedAdamW')
    """
    from tfuse import optim as tfuse_optim
    from tfuse.distributed import FusedDataParallel, LocalSGD, ShardedOptimizer
    from tfuse.flat import register_compact_state_dict
    from tfuse.optim import FlatOptimizer

    strategy = FusionStrategy() if strategy is None else strategy
    if not isinstance(strategy, FusionStrategy):
        raise TypeError(f"tfuse.setup: strategy must be a tfuse.FusionStrategy, got {type(strategy).__name__}")
    optimizer_class = _optimizer_class(optimizer, strategy, tfuse_optim, FlatOptimizer)
    if optimizer == "momentum" and not strategy.fuse_all_optimizer_ops:
        optimizer_kwargs.setdefault("momentum", 0.9)  # FusedMomentum's default, for torch.optim.SGD
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        if strategy.sharding != "none" or strategy.local_sgd_every is not None:
            raise RuntimeError(
                "tfuse.setup: sharding and LocalSGD need torch.distributed initialised (init_process_group, or "
                "tfuse.distributed.init_process_group_from_env under torchrun)"
            )
        if strategy.gradient_merge_steps != 1:
            raise RuntimeError(
                "tfuse.setup: gradient_merge_steps > 1 merges gradients before their all-reduce, which needs "
                "torch.distributed initialised; in one process, accumulate gradients by calling backward several "
                "times before the step"
            )
    if strategy.sharding == "optimizer" and not (strategy.fuse_all_optimizer_ops and strategy.fuse_all_reduce_ops):
        raise ValueError("tfuse.setup: sharding='optimizer' needs the fused optimizer and the fused all-reduce")

    fused, report = fuse_model(model, strategy, example_inputs)
    summary = [f"fusion: {report}"]
    params = [p for p in fused.parameters() if p.requires_grad]
    summary.append(f"gradient tensors: {len(params)} ({sum(p.numel() for p in params):,} elements)")

    wrapped: nn.Module = fused
    if distributed:
        world = dist.get_world_size(process_group)
        if strategy.fuse_all_reduce_ops:
            wrapped = FusedDataParallel(
                fused,
                bucket_mb=strategy.fuse_grad_size_in_mb,
                max_params_per_bucket=strategy.max_params_per_bucket,
                process_group=process_group,
                gradient_merge_steps=strategy.gradient_merge_steps,
                gradient_merge_avg=strategy.gradient_merge_avg,
            )
            summary.append(
                f"all-reduce: {len(params)} gradient tensors -> {wrapped.num_allreduce_calls} all-reduce call(s) per "
                f"step over {world} ranks ({wrapped.flat.describe()})"
            )
        else:
            if strategy.gradient_merge_steps != 1:
                raise ValueError(
                    "tfuse.setup: gradient_merge_steps > 1 needs the fused all-reduce (fuse_all_reduce_ops=True); "
                    "with torch's DDP use its no_sync() context"
                )
            wrapped = nn.parallel.DistributedDataParallel(
                fused, process_group=process_group, bucket_cap_mb=strategy.fuse_grad_size_in_mb
            )
            summary.append(f"all-reduce: torch DistributedDataParallel over {world} ranks (not fused by tfuse)")

    local_sgd = None
    if strategy.sharding == "optimizer":
        built = ShardedOptimizer(wrapped, optimizer_class, process_group, **optimizer_kwargs)
        summary.append(f"optimizer: ShardedOptimizer({optimizer_class.__name__}) over the flat buffers' shards")
        summary[-2] = summary[-2].replace("all-reduce call(s)", "reduce-to-owner call set(s)")
    else:
        built = optimizer_class(wrapped.parameters(), **optimizer_kwargs)
        if isinstance(built, FlatOptimizer):
            summary.append(f"optimizer: {built.describe()}")
        else:
            summary.append(f"optimizer: {type(built).__module__}.{type(built).__name__} (not fused by tfuse)")
        if strategy.local_sgd_every is not None:
            local_sgd = LocalSGD(
                wrapped, built, strategy.local_sgd_every, strategy.local_sgd_warmup, process_group=process_group
            )
            summary.append(
                f"LocalSGD: parameters averaged every {strategy.local_sgd_every} iterations after "
                f"{strategy.local_sgd_warmup} warm-up iterations; call setup.step() (or its local_sgd.step())"
            )
    register_compact_state_dict(fused)  # a part's state dict, deep-copied, holds only its own elements
    for line in summary:
        logger.info("tfuse.setup: %s", line)
    return Setup(wrapped, built, report, local_sgd, summary)


def _optimizer_class(optimizer: str | type, strategy: FusionStrategy, tfuse_optim: Any, flat_base: type) -> type:
    if isinstance(optimizer, str):
        names = OPTIMIZERS.get(optimizer.lower())
        if names is None:
            raise ValueError(f"tfuse.setup: unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
        if strategy.fuse_all_optimizer_ops:
            return getattr(tfuse_optim, names[0])
        if names[1] is None:
            raise ValueError(
                f"tfuse.setup: optimizer {optimizer!r} with fuse_all_optimizer_ops=False asks for torch.optim's "
                f"implementation, and torch.optim has none; use fuse_all_optimizer_ops=True (tfuse.optim.{names[0]})"
            )
        return getattr(torch.optim, names[1])
    if isinstance(optimizer, type) and issubclass(optimizer, flat_base):
        return optimizer
    raise TypeError(
        f"tfuse.setup: optimizer must be one of {', '.join(repr(n) for n in OPTIMIZERS)} or a tfuse fused optimizer "
        f"class, got {optimizer!r}"
    )
