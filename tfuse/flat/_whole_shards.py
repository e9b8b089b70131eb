"""Offsets for shards of whole parameters: each parameter inside one rank's shard, ranks balanced by size.

Sharded Muon orthogonalises each parameter's whole matrix, so no parameter may straddle two shards. The
trainable parameters keep their order in the buffer (backward order: gradient buckets still fill in the order
backward produces them) and are cut into ``world_size`` consecutive runs whose sizes are as even as the
parameters allow; each run is then padded to the largest run's size, so that the shards stay equal (one
all-gather, one reduce-scatter per buffer) and every parameter sits whole inside its rank's shard.
"""

from __future__ import annotations


def whole_parameter_offsets(sizes: list[int], world_size: int, align: int) -> tuple[list[int], int]:
    """Offsets of parameters of ``sizes`` elements (each rounded up to ``align``) for whole-parameter shards.

    Returns (offsets, shard size); shard ``r`` is ``[r * shard, (r + 1) * shard)``. The cut before parameter
    ``i`` goes where the running total is nearest to an even share, so the largest shard exceeds an even
    share by at most the largest parameter.

    Example:
        >>> from tfuse.flat._whole_shards import whole_parameter_offsets
        >>> whole_parameter_offsets([40, 8, 8, 40], world_size=2, align=8)
        ([0, 40, 48, 56], 48)
    """
    aligned = [-(-size // align) * align for size in sizes]
    total = sum(aligned)
    owners, cursor, rank = [], 0, 0
    for size in aligned:
        # Move on to the next rank when this parameter's midpoint lies past that rank's even share.
        while rank < world_size - 1 and (cursor + size / 2) * world_size > total * (rank + 1):
            rank += 1
        owners.append(rank)
        cursor += size
    loads = [0] * world_size
    for owner, size in zip(owners, aligned):
        loads[owner] += size
    shard = max(max(loads), align)
    offsets, filled = [], [0] * world_size
    for owner, size in zip(owners, aligned):
        offsets.append(owner * shard + filled[owner])
        filled[owner] += size
    return offsets, shard
