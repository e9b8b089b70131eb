"""ShardedOptimizer's state dicts: sharded and consolidated, saving and loading.

Two formats:

* Sharded (``ShardedOptimizer.state_dict()``): this rank's shard of each
  state buffer, every parameter's step count, and the layout it belongs to
  (world size, rank, and per buffer its dtype, sizes, shard range and the
  offset and size of each parameter). It loads only into the same layout;
  anything else is a ValueError naming the difference, never a silent
  misalignment.
* Consolidated (``ShardedOptimizer.consolidated_state_dict(to)``):
  torch.optim's format (``state[i]["exp_avg"]`` with the parameter's shape),
  on one rank, gathered one state buffer at a time. It loads into the fused
  optimizer or its torch.optim class on one process, and into a
  ShardedOptimizer of any world size (each rank keeps its shard of it):
  that is how a checkpoint moves between world sizes.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tfuse.distributed._shard_comm import global_rank
from tfuse.flat import FlatGroup, Shard
from tfuse.optim import FlatOptimizer
from tfuse.optim.load_rules import check_saved_state, merge_saved_groups
from tfuse.optim.span import MASTER_KEY, SpanStepper

FORMAT = "tfuse.sharded_optimizer/1"


class _Sharded(Protocol):
    """One flat buffer of a shard owner (``ShardedBuffer``)."""

    span: SpanStepper
    shards: list[Shard]
    shard: Shard
    group: FlatGroup


class ShardOwner(Protocol):
    """What the state dicts read of a ShardedOptimizer."""

    optim: FlatOptimizer  # the update rule and the parameter groups
    param_groups: list[dict[str, Any]]
    world_size: int
    rank: int
    process_group: dist.ProcessGroup | None
    buffers: tuple[_Sharded, ...]


# ---------------------------------------------------------------------------- sharded


def _layout(opt: ShardOwner) -> dict[str, Any]:
    """What a sharded state dict must match to load: world size, rank, and each buffer's layout."""
    ids = _param_ids(opt)
    buffers = []
    for sharded in opt.buffers:
        group = sharded.group
        buffers.append(
            {
                "dtype": str(group.dtype),
                "numel": group.data.numel(),
                "trainable_numel": group.trainable_numel,
                "shard": (sharded.shard.start, sharded.shard.end),
                "params": [(ids[id(m.param)], group.offsets[m.index], m.param.numel()) for m in sharded.span.members],
            }
        )
    return {"world_size": opt.world_size, "rank": opt.rank, "buffers": buffers}


def sharded_state_dict(opt: ShardOwner) -> dict[str, Any]:
    """This rank's shard of the state (copies), the step counts and the layout."""
    buffers = []
    for sharded in opt.buffers:
        buffer = sharded.span
        buffers.append(
            {
                "state": {name: t.clone() for name, t in buffer.state.buffers.items()},
                "master": None if buffer.state.master is None else buffer.state.master.clone(),
                "steps": [float(buffer.state.steps[m.index]) for m in buffer.members],
                "started": [m.started for m in buffer.members],
            }
        )
    return {
        "format": FORMAT,
        "layout": _layout(opt),
        "param_groups": opt.optim.state_dict()["param_groups"],
        "buffers": buffers,
    }


def _check_sharded(opt: ShardOwner, state_dict: dict[str, Any]) -> None:
    saved, mine = state_dict.get("layout"), _layout(opt)
    if not isinstance(saved, dict):
        raise ValueError("ShardedOptimizer: the sharded state dict has no 'layout'")
    for key in ("world_size", "rank"):
        if saved.get(key) != mine[key]:
            raise ValueError(
                f"ShardedOptimizer: the sharded state dict was saved with {key} {saved.get(key)}, this optimizer "
                f"has {key} {mine[key]}; load a consolidated state dict (consolidated_state_dict) to reshard"
            )
    if len(saved["buffers"]) != len(mine["buffers"]):
        raise ValueError(
            f"ShardedOptimizer: the sharded state dict has {len(saved['buffers'])} flat buffers, this optimizer "
            f"{len(mine['buffers'])}"
        )
    for index, (theirs, ours) in enumerate(zip(saved["buffers"], mine["buffers"])):
        for key in ("dtype", "numel", "trainable_numel", "shard", "params"):
            if _plain(theirs[key]) != _plain(ours[key]):
                raise ValueError(
                    f"ShardedOptimizer: flat buffer {index} of the sharded state dict has another {key} than this "
                    f"optimizer's (saved {_short(theirs[key])}, here {_short(ours[key])}); load a consolidated "
                    "state dict to change the layout"
                )


def _plain(value: Any) -> Any:
    """Tuples and lists alike (a state dict may have gone through a format that turns one into the other)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


def _load_sharded(opt: ShardOwner, state_dict: dict[str, Any]) -> None:
    _check_sharded(opt, state_dict)
    _load_groups(opt, state_dict["param_groups"])
    for sharded, saved in zip(opt.buffers, state_dict["buffers"]):
        buffer = sharded.span
        state = buffer.state
        state.buffers.clear()  # (a state shared by two spans is saved with each: loaded twice, the same)
        for name, value in saved["state"].items():
            state.ensure(name).copy_(value)
        for member, step, started in zip(buffer.members, saved["steps"], saved["started"]):
            state.steps[member.index] = step
            member.started = bool(started)
        master = saved.get("master")
        if buffer.master_weights and master is not None:
            state.ensure_master().copy_(master)
            buffer.note_versions(buffer.members)  # the masters are the saved ones, not the parameters' rounding
        elif buffer.master_weights:
            state.master = None  # saved without masters: taken from the parameters at the next step
            for member in buffer.members:
                member.version = -1


# ---------------------------------------------------------------------------- consolidated


def _param_ids(opt: ShardOwner) -> dict[int, int]:
    """id(parameter) -> its index in torch.optim's state dict (position over param_groups)."""
    params = itertools.chain.from_iterable(g["params"] for g in opt.param_groups)
    return {id(p): index for index, p in enumerate(params)}


def consolidated_state_dict(opt: ShardOwner, to: int) -> dict[str, Any] | None:
    """The whole state in torch.optim's format on rank ``to``: one state buffer gathered at a time."""
    if not isinstance(to, int) or not 0 <= to < opt.world_size:
        raise ValueError(f"ShardedOptimizer: to must be a rank in [0, {opt.world_size}), got {to!r}")
    here = opt.rank == to
    ids = _param_ids(opt)
    optim = opt.optim
    result: dict[int, dict[str, Any]] = {}
    for sharded in opt.buffers:
        buffer, group = sharded.span, sharded.group
        started = [m for m in buffer.members if m.started]  # the same on every rank (flags are agreed)
        names_of = {m.group: buffer.rule.state_names_of(optim.param_groups[m.group]) for m in started}
        for member in started:
            entry = result.setdefault(ids[id(member.param)], {}) if here else {}
            if buffer.rule.family.uses_step and names_of[member.group]:
                entry["step"] = torch.tensor(float(buffer.state.steps[member.index]))
        for name in sorted(set(itertools.chain.from_iterable(names_of.values()))):
            mine = buffer.state.ensure(name)
            whole = torch.empty(sharded.shards[-1].end, dtype=mine.dtype, device=mine.device) if here else None
            pieces = [whole[s.start : s.end] for s in sharded.shards] if here else None
            dist.gather(mine, pieces, dst=global_rank(opt.process_group, to), group=opt.process_group)
            if here:
                for member in started:
                    if name in names_of[member.group]:
                        view = group.slot(whole, member.index)
                        result[ids[id(member.param)]][name] = view.clone(memory_format=torch.preserve_format)
            del whole, pieces  # one buffer's worth at a time
        if buffer.master_weights and started:
            buffer.refresh_masters(started)  # (the same on every rank: every rank takes part in the gather)
            mine = buffer.state.master
            whole = torch.empty(sharded.shards[-1].end, dtype=mine.dtype, device=mine.device) if here else None
            pieces = [whole[s.start : s.end] for s in sharded.shards] if here else None
            dist.gather(mine, pieces, dst=global_rank(opt.process_group, to), group=opt.process_group)
            if here:
                for member in started:
                    view = group.slot(whole, member.index)
                    result[ids[id(member.param)]][MASTER_KEY] = view.clone(memory_format=torch.preserve_format)
            del whole, pieces
    if not here:
        return None
    return {"state": result, "param_groups": optim.state_dict()["param_groups"]}


def _load_groups(opt: ShardOwner, saved_groups: list[dict[str, Any]]) -> None:
    """Takes the hyperparameters of ``saved_groups`` (checked as the optimizer checks them), as torch does."""
    groups = opt.param_groups
    merged = merge_saved_groups(opt.optim, groups, saved_groups, opt.optim.defaults)
    for group, saved in zip(groups, merged):  # in place: the optimizer and its inner optimizer share these dicts
        group.clear()
        group.update(saved)


def _load_consolidated(opt: ShardOwner, state_dict: dict[str, Any]) -> None:
    saved_state = state_dict["state"]
    params = check_saved_state(opt.optim, opt.param_groups, state_dict, owner="ShardedOptimizer")
    _load_groups(opt, state_dict["param_groups"])
    saved_id = {id(param): key for key, param in params.items()}
    for sharded in opt.buffers:  # all first: FusedMuon's two spans over one buffer share its state
        sharded.span.reset()
    for sharded in opt.buffers:
        span = sharded.span
        for member in span.members:
            entry = saved_state.get(saved_id[id(member.param)])
            if entry:
                span.load_member(member, entry, opt.param_groups)


def load_state_dict(opt: ShardOwner, state_dict: dict[str, Any]) -> None:
    """Loads a sharded (same layout) or consolidated (torch.optim format) state dict."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"ShardedOptimizer: state_dict must be a dict, got {type(state_dict).__name__}")
    if state_dict.get("format") == FORMAT:
        _load_sharded(opt, state_dict)
    elif "state" in state_dict and "param_groups" in state_dict:
        _load_consolidated(opt, state_dict)
    else:
        raise ValueError(
            "ShardedOptimizer: not a state dict of ShardedOptimizer.state_dict() or of torch.optim format "
            f"(keys {sorted(state_dict)})"
        )
