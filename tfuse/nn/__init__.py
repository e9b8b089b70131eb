"""Drop-in ``nn.Module`` wrappers over tfuse's fused ops."""

from tfuse.nn.add import FusedAdd
from tfuse.nn.add_act import FusedAddAct, FusedBiasAct
from tfuse.nn.batch_norm import FusedBatchNormAct1d, FusedBatchNormAct2d
from tfuse.nn.linear import FusedLinear

__all__ = ["FusedAdd", "FusedAddAct", "FusedBatchNormAct1d", "FusedBatchNormAct2d", "FusedBiasAct", "FusedLinear"]
