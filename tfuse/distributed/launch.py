"""Process-group set-up for scripts started by ``torchrun``."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_process_group_from_env(backend: str | None = None, timeout: datetime.timedelta | None = None) -> torch.device:
    """Joins the process group that ``torchrun`` describes and returns this process's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``LOCAL_RANK`` (env:// initialisation). With ``backend=None`` the choice
    is NCCL with one GPU per process (``cuda:LOCAL_RANK``, made the current
    device) when every process on this node can have a GPU of its own
    (``LOCAL_WORLD_SIZE`` <= visible GPUs), and gloo on the CPU otherwise —
    e.g. two ranks started on a one-GPU machine — with a log line that says
    why. Pass ``backend="gloo"`` to train on the CPU on a GPU machine.

    Args:
        backend: "nccl" (one GPU per process; an error if this node has too
            few), "gloo" (the CPU) or None (choose as above).
        timeout: how long a collective may wait for the other ranks before it
            fails with an error (None: torch's default for the backend).

    Example (run with ``torchrun --nproc_per_node=2 train.py``)::

        device = tfuse.distributed.init_process_group_from_env()
        model = tfuse.distributed.FusedDataParallel(build_model().to(device))
    """
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_process_group_from_env: environment variable{'' if len(missing) == 1 else 's'} {', '.join(missing)} "
            "not set; start the script "
            "with torchrun (e.g. torchrun --nproc_per_node=2 train.py), which sets them"
        )
    if dist.is_initialized():
        raise RuntimeError("init_process_group_from_env: the default process group is already initialized")
    if backend is None:
        backend = _default_backend()
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_process_group_from_env: backend must be 'nccl', 'gloo' or None, got {backend!r}")
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("init_process_group_from_env: the NCCL backend needs CUDA, and CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"init_process_group_from_env: LOCAL_RANK={local_rank} but only {_gpus(torch.cuda.device_count())} "
                "visible; start at most one process per GPU"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    rank = dist.get_rank()
    # Like FusedDataParallel's own lines: INFO from rank 0, DEBUG from the others (which say the same).
    logger.log(
        logging.INFO if rank == 0 else logging.DEBUG,
        "rank %d of %d joined the %s process group on %s",
        rank,
        dist.get_world_size(),
        backend,
        device,
    )
    return device


def _default_backend() -> str:
    """NCCL when each local process can have a GPU of its own, else gloo (with the reason logged)."""
    if not torch.cuda.is_available():
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local_world > gpus:
        logger.warning(
            "init_process_group_from_env: %s on this node but %s visible; using gloo on the CPU "
            "(start at most one process per GPU to use NCCL, or pass backend='gloo' to silence this)",
            f"{local_world} process{'' if local_world == 1 else 'es'}",
            _gpus(gpus),
        )
        return "gloo"
    return "nccl"


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'} {'is' if n == 1 else 'are'}"
