"""``FusedAdd``: a module that sums its inputs in one fused pass."""

from __future__ import annotations

import torch
from torch import nn

from tfuse import functional as F
from tfuse.nn._common import fx_leaf_call


class FusedAdd(nn.Module):
    """Sums 2 to 8 tensors with broadcasting in one kernel launch.

    A module form of :func:`tfuse.add`, for models built from modules (for
    instance a residual block that adds the skip path, a bias and the main
    path). It replaces ``a + b + c`` (or ``torch.add``), which has no module
    class in torch, so it takes no constructor arguments; it holds no state,
    and under ``torch.fx`` it is traced as a leaf (one ``call_module`` node).

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedAdd
        >>> merge = FusedAdd()
        >>> x, skip = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
        >>> bias = torch.randn(4, 1, 1)
        >>> merge(x, skip, bias).shape
        torch.Size([2, 4, 8, 8])
    """

    def __init__(self) -> None:
        super().__init__()

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        traced = fx_leaf_call(self, *tensors)
        if traced is not None:
            return traced
        return F.add(*tensors)
