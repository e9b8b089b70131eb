"""ShardedOptimizer's state: first-step creation, sharded and consolidated state dicts, loading.

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

import copy
import itertools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tfuse.distributed._shard_comm import global_rank
from tfuse.optim._checks import IMPLEMENTATION_FLAGS
from tfuse.optim._flat_optimizer import MASTER_KEY

if TYPE_CHECKING:
    from tfuse.distributed.sharded import ShardedOptimizer
    from tfuse.optim._flat_optimizer import FlatOptimizer, _Buffer, _Member

FORMAT = "tfuse.sharded_optimizer/1"


def start_state(optim: FlatOptimizer, buffer: _Buffer, members: list[_Member]) -> None:
    """torch's lazy state creation for members at their first step: their part of the shard starts at zero."""
    state = buffer.state
    for member in members:
        for name in optim._state_names(optim.param_groups[member.group]):
            state.ensure(name)[member.start : member.end].zero_()


def refresh_masters(buffer: _Buffer, members: list[_Member]) -> None:
    """Float32 masters of this rank's shard, taken from the parameters where they are new or were written.

    A member whose parameter changed since the optimizer last wrote it (its first step, or the user loaded
    the model's state dict) gets its part of the masters from the parameter's values, as the unsharded
    optimizer does for its whole range.
    """
    state = buffer.state
    state.ensure_master()
    data = state.group.data
    for member in members:
        if member.param._version != member.version and member.end > member.start:
            state.master[member.start : member.end].copy_(data[state.start + member.start : state.start + member.end])
        member.version = member.param._version


def current_members(buffer: _Buffer) -> list[_Member]:
    """With master weights: the members whose masters agree with their parameters now (before a gather)."""
    if not buffer.master_weights:
        return []
    return [m for m in buffer.members if m.version == m.param._version]


def note_versions(members: list[_Member]) -> None:
    """The optimizer wrote these members' parameters (update, all-gather): their masters still agree."""
    for member in members:
        member.version = member.param._version


# ---------------------------------------------------------------------------- sharded


def _layout(opt: ShardedOptimizer) -> dict[str, Any]:
    """What a sharded state dict must match to load: world size, rank, and each buffer's layout."""
    ids = _param_ids(opt)
    buffers = []
    for sharded in opt._buffers:
        group = sharded.group
        buffers.append(
            {
                "dtype": str(group.dtype),
                "numel": group.data.numel(),
                "trainable_numel": group.trainable_numel,
                "shard": (sharded.shard.start, sharded.shard.end),
                "params": [(ids[id(m.param)], group.offsets[m.index], m.param.numel()) for m in sharded.buffer.members],
            }
        )
    return {"world_size": opt.world_size, "rank": opt.rank, "buffers": buffers}


def sharded_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """This rank's shard of the state (copies), the step counts and the layout."""
    buffers = []
    for sharded in opt._buffers:
        buffer = sharded.buffer
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


def _check_sharded(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
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


def _load_sharded(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    _check_sharded(opt, state_dict)
    _load_groups(opt, state_dict["param_groups"])
    for sharded, saved in zip(opt._buffers, state_dict["buffers"]):
        buffer = sharded.buffer
        state = buffer.state
        state.buffers.clear()
        for name, value in saved["state"].items():
            state.ensure(name).copy_(value)
        for member, step, started in zip(buffer.members, saved["steps"], saved["started"]):
            state.steps[member.index] = step
            member.started = bool(started)
        master = saved.get("master")
        if buffer.master_weights and master is not None:
            state.ensure_master().copy_(master)
            note_versions(buffer.members)  # the masters are the saved ones, not the parameters' rounding
        elif buffer.master_weights:
            state.master = None  # saved without masters: taken from the parameters at the next step
            for member in buffer.members:
                member.version = -1


# ---------------------------------------------------------------------------- consolidated


def _param_ids(opt: ShardedOptimizer) -> dict[int, int]:
    """id(parameter) -> its index in torch.optim's state dict (position over param_groups)."""
    params = itertools.chain.from_iterable(g["params"] for g in opt.param_groups)
    return {id(p): index for index, p in enumerate(params)}


def consolidated_state_dict(opt: ShardedOptimizer, to: int) -> dict[str, Any] | None:
    """The whole state in torch.optim's format on rank ``to``: one state buffer gathered at a time."""
    if not isinstance(to, int) or not 0 <= to < opt.world_size:
        raise ValueError(f"ShardedOptimizer: to must be a rank in [0, {opt.world_size}), got {to!r}")
    here = opt.rank == to
    ids = _param_ids(opt)
    optim = opt.optim
    result: dict[int, dict[str, Any]] = {}
    for sharded in opt._buffers:
        buffer, group = sharded.buffer, sharded.group
        started = [m for m in buffer.members if m.started]  # the same on every rank (flags are agreed)
        names_of = {m.group: optim._state_names(optim.param_groups[m.group]) for m in started}
        for member in started:
            entry = result.setdefault(ids[id(member.param)], {}) if here else {}
            if optim.family.uses_step and names_of[member.group]:
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
            refresh_masters(buffer, started)  # (the same on every rank: every rank takes part in the gather)
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


def _load_groups(opt: ShardedOptimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Takes the hyperparameters of ``saved_groups`` (checked as the optimizer checks them), as torch does."""
    groups = opt.param_groups
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    new = []
    for group, saved in zip(groups, copy.deepcopy(saved_groups)):
        saved["params"] = group["params"]
        for flag in IMPLEMENTATION_FLAGS:  # how this optimizer runs is its own, not the saver's
            if flag in group:
                saved[flag] = group[flag]
            else:
                saved.pop(flag, None)
        for name, default in opt.optim.defaults.items():
            saved.setdefault(name, default)
        opt.optim._check_group(saved)
        new.append(saved)
    for group, saved in zip(groups, new):  # in place: the optimizer and its inner optimizer share these dicts
        group.clear()
        group.update(saved)


def _load_consolidated(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    saved_state = state_dict["state"]
    ids = _param_ids(opt)
    # Check every tensor's shape before changing anything.
    params = {ids[id(p)]: p for p in itertools.chain.from_iterable(g["params"] for g in opt.param_groups)}
    names = {*opt.optim.state_names}
    required = opt.optim._required_state(state_dict["param_groups"])
    for key, entry in saved_state.items():
        param = params.get(key)
        if param is None:
            continue
        opt.optim._check_state_entry(key, entry, required.get(key, set()), owner="ShardedOptimizer")
        for name, value in entry.items():
            if name in names and isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise ValueError(
                    f"loaded state dict has '{name}' of shape {tuple(value.shape)} for a parameter of shape "
                    f"{tuple(param.shape)} (parameter {key})"
                )
    _load_groups(opt, state_dict["param_groups"])
    for sharded in opt._buffers:
        buffer, group = sharded.buffer, sharded.group
        state = buffer.state
        state.buffers.clear()
        state.steps.zero_()
        for member in buffer.members:
            entry = saved_state.get(ids[id(member.param)]) or {}
            member.started = bool(entry)
            member.version = -1  # masters: from the parameters at the next step, unless the entry has them
            if "step" in entry:
                state.steps[member.index] = float(entry["step"])
            for name, value in entry.items():
                if name == MASTER_KEY and buffer.master_weights and isinstance(value, torch.Tensor):
                    target = state.ensure_master()
                elif name not in names or not isinstance(value, torch.Tensor):
                    continue
                else:
                    target = state.ensure(name)  # every rank creates the same names (all load the same dict)
                if member.end <= member.start:
                    continue
                # The value in slot order (element k = element k of the parameter's slot), then our part of it.
                offset = group.offsets[member.index] - state.start
                slot = torch.empty(member.param.numel(), dtype=target.dtype, device=target.device)
                slot.as_strided(group.shapes[member.index], group.strides[member.index]).copy_(value)
                target[member.start : member.end].copy_(slot[member.start - offset : member.end - offset])
                if name == MASTER_KEY:
                    member.version = member.param._version
            if member.started:  # its state buffers exist on every rank, loaded or not (the next step updates them)
                for name in opt.optim._state_names(opt.param_groups[member.group]):
                    state.ensure(name)


def load_state_dict(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
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
