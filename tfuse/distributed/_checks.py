"""Argument checks the distributed classes share."""

from __future__ import annotations

import torch.distributed as dist


def require_process_group(owner: str, process_group: object) -> None:
    """Raises unless ``process_group`` is None or a ProcessGroup and torch.distributed is initialized.

    ``owner`` names the class in the message (``"LocalSGD"``, ``"ShardedOptimizer"``).
    """
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(process_group).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{owner}: torch.distributed is not initialized (call init_process_group first)")
