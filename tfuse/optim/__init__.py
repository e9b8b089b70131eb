"""Optimizer-side utilities over tfuse's flat buffers (the fused optimizers are next)."""

from tfuse.optim.clip import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
