"""Fused optimizers over flat buffers, and gradient clipping over them.

``FusedSGD``, ``FusedMomentum``, ``FusedAdam`` and ``FusedAdamW`` are
``torch.optim.Optimizer`` subclasses with torch's constructors, semantics
and state-dict format; each flat parameter buffer is updated by one kernel
launch per step.
"""

from tfuse.optim.adam import FusedAdam, FusedAdamW
from tfuse.optim.clip import clip_grad_norm_
from tfuse.optim.sgd import FusedMomentum, FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedMomentum", "FusedSGD", "clip_grad_norm_"]
