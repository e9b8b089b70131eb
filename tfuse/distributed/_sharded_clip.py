"""Gradient clipping under ShardedOptimizer, and the check that catches per-rank clipping of sharded gradients.

After a sharded backward (FusedDataParallel + ShardedOptimizer) each rank
holds the averaged gradient in its own shards and zeros elsewhere. A norm
taken on one rank, as ``torch.nn.utils.clip_grad_norm_(model.parameters())``
takes it, is then the norm of that rank's shard only, and each rank scales
its shard by a different factor: the update is silently not the one DDP +
clipping would make. :func:`clip_sharded` is the right norm (each owner's
shard, one scalar all-reduce); :func:`check_grad_edits` runs at step and
raises when the shards were rescaled by factors that differ between ranks.

How the check sees an edit without a host sync on the fast path: when the
backward's reduction settles, the reducer records the version counter of
each gradient buffer and the norm of this rank's shards (on the device). At
step, an unchanged version means nobody wrote the gradients: nothing more
is done. A changed version (a clip, ``GradScaler.unscale_``, a user's
``grad.div_``) on every rank costs one scalar all-reduce of the ratio
``norm now / norm then``: a uniform rescaling (unscale, accumulation
division, :meth:`ShardedOptimizer.clip_grad_norm_`) gives the same ratio
everywhere; a per-rank clip gives different ones.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tfuse.distributed.sharded import ShardedOptimizer

_PER_RANK_CLIP = (
    "ShardedOptimizer: the sharded gradients were rescaled by a different factor on each rank between backward and "
    "step (ratios {low:.6g} to {high:.6g}). After a sharded backward each rank holds only its own shard of the "
    "averaged gradient, so a norm taken on one rank, as torch.nn.utils.clip_grad_norm_(model.parameters(), ...) "
    "takes it, is that shard's norm. Clip with optimizer.clip_grad_norm_(max_norm) (or "
    "tfuse.optim.clip_grad_norm_(optimizer, max_norm)), which takes the norm of all shards; nothing was stepped."
)


@torch.no_grad()
def clip_sharded(
    optimizer: ShardedOptimizer,
    pending: list[tuple[bool, ...]],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """Clips the averaged gradients held in the owners' shards by their total norm (torch's formula).

    ``pending`` says, per buffer, which members have a gradient (agreed on every rank).
    """
    pieces = []
    for sharded, on in zip(optimizer.buffers, pending):
        grad = sharded.group.grad[sharded.shard.start : sharded.shard.end]
        # Only the members with a gradient: slots of the others may hold stale values (they are not stepped).
        pieces += [grad[m.start : m.end] for m, active in zip(sharded.span.members, on) if active and m.end > m.start]
    dtype = optimizer.buffers[0].group.dtype if optimizer.buffers else torch.float32
    if norm_type == 2.0:
        local = sum(
            (torch.linalg.vector_norm(p, dtype=torch.float64) ** 2 for p in pieces),
            torch.zeros((), dtype=torch.float64),
        )
        dist.all_reduce(local, group=optimizer.process_group)
        total = local.sqrt()
    else:
        local = max((p.abs().max().double() for p in pieces if p.numel()), default=torch.zeros((), dtype=torch.float64))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=optimizer.process_group)
        total = local
    total = total.to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula, in the gradients' dtype
    if pieces:
        torch._foreach_mul_(pieces, coefficient)
    return total


def check_grad_edits(optimizer: ShardedOptimizer) -> None:
    """Raises RuntimeError when the sharded gradients were rescaled differently on different ranks since backward.

    Free when nobody wrote the gradients since the reduction settled; else one
    two-float all-reduce and a host read. Every rank that edited its gradients
    takes part, which is every rank when all run the same training code.
    """
    owners = [r.owners for r in optimizer._reducers if r.sharded_by is optimizer and r.reduces_to_owners]
    edited = [o for o in owners if o.edited()]
    if not edited:
        return
    ratios = [o.scale_since_settle() for o in edited]
    known = [r for r in ratios if r is not None]
    # (largest ratio, -smallest ratio) in one MAX all-reduce; a rank without a shard norm adds nothing (-inf).
    if known:
        stacked = torch.stack(known)
        pair = torch.stack([stacked.max(), -stacked.min()]).double().cpu()
    else:
        pair = torch.full((2,), -math.inf, dtype=torch.float64)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=optimizer.process_group)
    high, low = float(pair[0]), -float(pair[1])
    if not (math.isfinite(high) and math.isfinite(low)):
        return  # no rank had a nonzero finite shard norm to compare (or the gradients are not finite)
    tolerance = max(1e-4, 2 * max(o.eps for o in edited))  # a uniform scale rounds each element once
    if high - low > tolerance * max(abs(high), abs(low)):
        raise RuntimeError(_PER_RANK_CLIP.format(low=low, high=high))
