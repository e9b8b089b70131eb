"""Fused optimizers over flat buffers, and gradient clipping over them.

``FusedSGD``, ``FusedMomentum``, ``FusedAdam``, ``FusedAdamW`` and
``FusedAdagrad`` are ``torch.optim.Optimizer`` subclasses with torch's
constructors (positional order, ``foreach``/``fused``/``capturable``/``differentiable`` included:
accepted where tfuse can honour them, refused with a ValueError naming them
where not), semantics, state-dict format and copy/pickle behaviour. Each flat
parameter buffer is updated by one Triton kernel launch per step, or, on CPU
without Triton's interpreter, by torch's fused kernels over whole runs of the
buffer (the PyTorch path); ``describe()``, ``repr()`` and the first step's
INFO log say which. ``FusedLion``, ``FusedLAMB`` and ``FusedLARS`` (which
torch lacks) follow their papers, with the conventions their docstrings state;
LAMB and LARS take three launches per buffer (per-parameter trust ratios).
``FusedMuon`` is torch.optim.Muon for matrices and convolution weights, its
Newton-Schulz iterations batched per matrix shape, with AdamW groups for the
other parameters.

Inside, for every caller that updates flat buffers (these optimizers, a shard
owner, an outer optimizer): :class:`~tfuse.optim.span.SpanStepper` (the span
engine) owns the state of a span of a flat buffer and steps it,
``_update.adam_update`` / ``_update.sgd_update`` run one step of the update
maths over element ranges, :mod:`tfuse.optim.load_rules` holds torch's rules
for loading a state dict, and :class:`FlatOptimizer` is the thin torch.optim
layer on top (the base of the fused optimizers, and their update rule).
"""

from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim.adagrad import FusedAdagrad
from tfuse.optim.adam import FusedAdam, FusedAdamW
from tfuse.optim.clip import clip_grad_norm_
from tfuse.optim.lamb import FusedLAMB
from tfuse.optim.lars import FusedLARS
from tfuse.optim.lion import FusedLion
from tfuse.optim.muon import FusedMuon
from tfuse.optim.sgd import FusedMomentum, FusedSGD

__all__ = [
    "FlatOptimizer",
    "FusedAdagrad",
    "FusedAdam",
    "FusedAdamW",
    "FusedLAMB",
    "FusedLARS",
    "FusedLion",
    "FusedMomentum",
    "FusedMuon",
    "FusedSGD",
    "clip_grad_norm_",
]
