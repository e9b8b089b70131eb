"""Checks that every rank wraps the same model with the same flat layout.

Used by FusedDataParallel, ShardedOptimizer and LocalSGD before their first
collective: a collective over buffers of different sizes hangs (NCCL) or
aborts the process (gloo) instead of naming the difference.

Every rank describes its replica as a list of (what, value) entries: the
wrapper's options, each parameter in flat-buffer order (name, shape, strides
(its memory format: rank 0's values are broadcast and gradients summed
element by element of the flat buffers, so a channels_last weight on one
rank and a contiguous one on another would mix elements), dtype, buffer and
offset), the buckets and the module buffers. One all-gather of a
32-byte digest per rank compares them; only when digests differ are the
descriptions themselves gathered, so that every rank can raise the same
error naming the first difference. All of it runs before any gradient
collective, so a mismatch never turns into a hang or a wrong sum.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from tfuse.flat import FlatParams

Entry = tuple[str, str]


def describe_replica(
    module: torch.nn.Module | None,
    flat: FlatParams,
    names: dict[torch.nn.Parameter, str],
    options: dict[str, object],
) -> list[Entry]:
    """The entries that must be equal on every rank, in a fixed order (``module``: its buffers too)."""
    entries: list[Entry] = [(f"option {key}", repr(value)) for key, value in options.items()]
    for buffer_index, group in enumerate(flat.groups):
        for position, (param, offset) in enumerate(zip(group.params, group.offsets)):
            trainable = "trainable" if position < group.n_trainable else "frozen"
            entries.append(
                (
                    f"parameter {names[param]!r}",
                    f"shape {tuple(param.shape)}, "
                    f"strides {_canonical_strides(group.shapes[position], group.strides[position])}, "
                    f"{_dtype(param.dtype)}, {trainable}, "
                    f"buffer {buffer_index} offset {offset}",
                )
            )
    for buffer_index, group in enumerate(flat.groups):
        entries.append((f"flat buffer {buffer_index}", f"{_dtype(group.dtype)}, {group.data.numel()} elements"))
    for index, bucket in enumerate(flat.buckets):
        members = ", ".join(names[p] for p in bucket.params)
        entries.append(
            (f"bucket {index}", f"buffer {bucket.buffer_index} elements [{bucket.start}, {bucket.end}): {members}")
        )
    for name, buffer in module.named_buffers() if module is not None else ():
        entries.append((f"module buffer {name!r}", f"shape {tuple(buffer.shape)}, {_dtype(buffer.dtype)}"))
    return entries


def check_replicas_match(
    entries: list[Entry], group: dist.ProcessGroup | None, device: torch.device, owner: str = "FusedDataParallel"
) -> None:
    """Raises the same RuntimeError on every rank if any rank's entries differ from rank 0's.

    Costs one all-gather of 32 bytes per rank when they match. ``owner``
    names the class in the message.
    """
    encoded = json.dumps(entries).encode()
    digest = torch.frombuffer(bytearray(hashlib.sha256(encoded).digest()), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    digests = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest, group=group)
    differing = [rank for rank in range(1, world) if not torch.equal(digests[rank], digests[0])]
    if not differing:
        return
    descriptions = _all_gather_bytes(encoded, group, device)
    reference = [tuple(entry) for entry in json.loads(descriptions[0])]
    first = differing[0]
    other = [tuple(entry) for entry in json.loads(descriptions[first])]
    raise RuntimeError(
        f"{owner}: the model on rank {first} differs from rank 0's: "
        f"{_first_difference(reference, other, first)} (ranks that differ from rank 0: {differing}). "
        "Every rank must build the same model and pass the same options."
    )


def _first_difference(reference: list[Entry], other: list[Entry], rank: int) -> str:
    for (key_0, value_0), (key_r, value_r) in zip(reference, other):
        if key_0 != key_r:
            return f"rank 0 has {key_0} ({value_0}) where rank {rank} has {key_r} ({value_r})"
        if value_0 != value_r:
            return f"{key_0}: rank 0 has {value_0}, rank {rank} has {value_r}"
    if len(reference) > len(other):
        key, value = reference[len(other)]
        return f"rank {rank} lacks {key} ({value})"
    key, value = other[len(reference)]
    return f"rank {rank} has an extra {key} ({value})"


def _all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None, device: torch.device) -> list[bytes]:
    """Every rank's payload, in rank order (two all-gathers: lengths, then padded bytes)."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(t[:size].cpu().tolist()) for t, size in zip(gathered, sizes)]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _canonical_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """``strides`` with the contiguous value for size-1 dimensions, whose stride places no element.

    Two layouts that put every element at the same place (a (C, K, 1, 1) weight
    contiguous or channels_last) then read the same.
    """
    contiguous, step = [], 1
    for size in reversed(shape):
        contiguous.append(step)
        step *= max(size, 1)
    contiguous.reverse()
    return tuple(s if n > 1 else c for n, s, c in zip(shape, strides, contiguous))
