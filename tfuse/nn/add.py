"""``FusedAdd``: a module that sums its inputs in one fused pass."""

from __future__ import annotations

import torch
from torch import nn

from tfuse import functional as F


class FusedAdd(nn.Module):
    """Sums 2 to 8 tensors with broadcasting in one kernel launch.

    A module form of :func:`tfuse.add`, for models built from modules (for
    instance a residual block that adds the skip path, a bias and the main path).

    Example:
        >>> import torch
        >>> from tfuse.nn import FusedAdd
        >>> merge = FusedAdd()
        >>> x, skip = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
        >>> bias = torch.randn(4, 1, 1)
        >>> merge(x, skip, bias).shape
        torch.Size([2, 4, 8, 8])
    """

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return F.add(*tensors)
