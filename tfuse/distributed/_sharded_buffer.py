"""One rank's view of a sharded flat buffer, and the helpers that walk those views."""

from __future__ import annotations

from tfuse.flat import FlatGroup, FlatParams, Shard
from tfuse.optim.span import SpanStepper


class ShardedBuffer:
    """One flat buffer as a shard owner sees it: its shards, and the span engine over this rank's shard."""

    def __init__(self, span: SpanStepper, index: int, shards: list[Shard], rank: int) -> None:
        self.span = span  # steps shards[rank] (state, member ranges, step plans)
        self.index = index  # the buffer's index in its FlatParams' groups
        self.shards = shards
        self.shard = shards[rank]

    @property
    def flat(self) -> FlatParams:
        return self.span.flat

    @property
    def group(self) -> FlatGroup:
        return self.span.state.group


def one_per_buffer(buffers: list[ShardedBuffer]) -> list[ShardedBuffer]:
    """``buffers`` with one entry per flat buffer (its first span's), in order: what a buffer's collectives run
    on (FusedMuon's two kinds in one buffer are two spans of it)."""
    seen: set[tuple[int, int]] = set()
    result = []
    for sharded in buffers:
        key = (id(sharded.flat), sharded.index)
        if key not in seen:
            seen.add(key)
            result.append(sharded)
    return result


def not_ahead(span: SpanStepper, active: tuple[bool, ...]) -> tuple[bool, ...]:
    """``active`` without the members stepped ahead (whose flags are cleared: the next backward may step them)."""
    result = tuple(on and not m.ahead for on, m in zip(active, span.members))
    for member in span.members:
        member.ahead = False
    return result
