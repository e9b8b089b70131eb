"""Data-parallel training over tfuse's flat buffers, through torch.distributed.

- :class:`FusedDataParallel`: a DDP-style wrapper that all-reduces gradients
  in a few fused buckets while backward runs, with gradient merge,
  ``no_sync()``, unused-parameter handling and a cross-rank model check.
- :class:`ShardedOptimizer`: a fused optimizer whose state and update are
  split across ranks (ZeRO stage 1), with consolidated and sharded checkpoints.
- :class:`LocalSGD`: local steps with a model average (or a DiLoCo-style
  outer step, :class:`OuterSGD`) every k iterations, over the flat buffers.
- :func:`init_process_group_from_env`: process-group set-up under torchrun
  (NCCL with one GPU per process, or gloo on the CPU).
"""

# Imported here, before any process group exists, on purpose: torch.distributed.nn.functional
# binds ``group=dist.group.WORLD`` as a default argument of ten functions when it is first
# imported, and torch imports it lazily (torch._dynamo, pulled in by the first torch.optim
# optimizer or DDP). Imported after init_process_group, those defaults keep the default group
# alive through destroy_process_group: gloo's worker threads then outlive it into interpreter
# shutdown, where one that releases a finished collective's tensors takes the GIL and the
# process dies with SIGABRT ("terminate called without an active exception") after a
# successful run. Imported now, the defaults are None and destroy_process_group frees the group.
import torch.distributed.nn.functional  # noqa: F401

from tfuse.distributed.data_parallel import FusedDataParallel
from tfuse.distributed.launch import init_process_group_from_env
from tfuse.distributed.local_sgd import AdaptiveInterval, LocalSGD, OuterSGD
from tfuse.distributed.sharded import ShardedOptimizer

__all__ = [
    "AdaptiveInterval",
    "FusedDataParallel",
    "LocalSGD",
    "OuterSGD",
    "ShardedOptimizer",
    "init_process_group_from_env",
]
