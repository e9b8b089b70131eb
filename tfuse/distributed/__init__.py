"""Data-parallel training over tfuse's flat buffers, through torch.distributed.

- :class:`FusedDataParallel`: a DDP-style wrapper that all-reduces gradients
  in a few fused buckets while backward runs, with gradient merge,
  ``no_sync()``, unused-parameter handling and a cross-rank model check.
- :class:`ShardedOptimizer`: a fused optimizer whose state and update are
  split across ranks (ZeRO stage 1), with consolidated and sharded checkpoints.
- :func:`init_process_group_from_env`: process-group set-up under torchrun
  (NCCL with one GPU per process, or gloo on the CPU).
"""

from tfuse.distributed.data_parallel import FusedDataParallel
from tfuse.distributed.launch import init_process_group_from_env
from tfuse.distributed.sharded import ShardedOptimizer

__all__ = ["FusedDataParallel", "ShardedOptimizer", "init_process_group_from_env"]
