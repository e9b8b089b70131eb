"""Fused optimizers over flat buffers, and gradient clipping over them.

``FusedSGD``, ``FusedMomentum``, ``FusedAdam`` and ``FusedAdamW`` are
``torch.optim.Optimizer`` subclasses with torch's constructors (positional
order, ``foreach``/``fused``/``capturable``/``differentiable`` included:
accepted where tfuse can honour them, refused with a ValueError naming them
where not), semantics, state-dict format and copy/pickle behaviour. Each flat
parameter buffer is updated by one Triton kernel launch per step, or, on CPU
without Triton's interpreter, by torch's fused kernels over whole runs of the
buffer (the PyTorch path); ``describe()``, ``repr()`` and the first step's
INFO log say which.

Inside, for every caller that updates flat buffers (these optimizers, a shard
owner, an outer optimizer): ``_state.FlatState`` keeps the state of a flat
buffer or of a range of it, ``_update.adam_update`` / ``_update.sgd_update``
run one step of the update maths over element ranges, and
``_flat_optimizer.FlatOptimizer`` is the thin torch.optim layer on top.
"""

from tfuse.optim.adam import FusedAdam, FusedAdamW
from tfuse.optim.clip import clip_grad_norm_
from tfuse.optim.sgd import FusedMomentum, FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedMomentum", "FusedSGD", "clip_grad_norm_"]
