"""Broadcasts of parameters and module buffers from the group's first rank.

Parameters already live in flat buffers, so each buffer goes out as one
broadcast with no copy. Module buffers (batch-norm statistics and the like)
are scattered tensors: they are packed into one staging tensor per
(device, dtype), broadcast, and unpacked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tfuse.flat import FlatParams


def source_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's rank 0 (what ``dist.broadcast`` takes as ``src``)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


@torch.no_grad()
def broadcast_parameters(flat: FlatParams, group: dist.ProcessGroup | None) -> None:
    """Overwrites every parameter (trainable or frozen) with the group's rank 0 values: one call per flat buffer."""
    src = source_rank(group)
    for buffer in flat.param_buffers:
        dist.broadcast(buffer, src=src, group=group)


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrites ``tensors`` in place with rank 0's: one broadcast per (device, dtype)."""
    src = source_rank(group)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for members in by_kind.values():
        if len(members) == 1 and members[0].is_contiguous():
            staging = members[0]
        else:
            staging = torch.cat([t.reshape(-1) for t in members])
        # gloo has no bool type; the bytes are the same.
        wire = staging.view(torch.uint8) if staging.dtype == torch.bool else staging
        dist.broadcast(wire, src=src, group=group)
        if staging is members[0] and len(members) == 1:
            continue
        offset = 0
        for tensor in members:
            count = tensor.numel()
            tensor.copy_(staging[offset : offset + count].view(tensor.shape))
            offset += count
