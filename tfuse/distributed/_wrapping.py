"""What FusedDataParallel settles once, when it wraps a module: parameter names, the device, the FlatParams."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tfuse.flat import FlatParams, flat_params_of


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def uses_default_group(group: Any) -> bool:
    if group is None or group is dist.group.WORLD:
        return True
    try:
        return group == dist.distributed_c10d._get_default_group()
    except RuntimeError:  # no default group
        return False


def parameter_names(module: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each distinct parameter (tied ones once) with its first name, in registration order."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(param, name)
    return names


def single_device(params: list[torch.nn.Parameter], names: dict[torch.nn.Parameter, str]) -> torch.device:
    if not any(p.requires_grad for p in params):
        raise ValueError(
            "FusedDataParallel: the module has no parameter that requires a gradient; nothing to synchronize"
        )
    devices = {p.device for p in params}
    if len(devices) > 1:
        listing = ", ".join(f"{names[p]!r} on {p.device}" for p in params[:6])
        raise ValueError(
            f"FusedDataParallel: the module's parameters are on {len(devices)} devices ({listing}, ...); "
            "put the whole replica on one device (one GPU per process)"
        )
    device = devices.pop()
    if device.type == "meta":
        raise ValueError(
            "FusedDataParallel: the module's parameters are on the meta device (no data); materialize them first, "
            "e.g. module.to_empty(device=...) and initialize, then wrap"
        )
    return device


def flat_params_for(
    params: list[torch.nn.Parameter],
    names: dict[torch.nn.Parameter, str],
    bucket_mb: float | None,
    max_params: int | None,
) -> FlatParams:
    """A new FlatParams for ``params``, or the existing one that holds exactly them (re-bucketed)."""
    owners = {flat_params_of(p) for p in params}
    if owners == {None}:
        return FlatParams([(names[p], p) for p in params], bucket_mb=bucket_mb, max_params_per_bucket=max_params)
    owner = next(iter(owners)) if len(owners) == 1 else None
    if owner is None or set(owner.params) != set(params):
        taken = next(p for p in params if flat_params_of(p) is not None)
        raise ValueError(
            f"FusedDataParallel: parameter {names[taken]!r} already lives in a FlatParams that does not hold exactly "
            "this module's parameters (a fused optimizer created before wrapping, over a different set?); wrap the "
            "model first and create the optimizer from the wrapped model's parameters"
        )
    owner.set_names(names)
    # Takes back replaced storage (or raises); lays out again if requires_grad changed since it was built.
    owner.sync_grads()
    owner.set_buckets(bucket_mb, max_params)
    return owner
