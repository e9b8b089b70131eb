"""Drop-in ``nn.Module`` wrappers over tfuse's fused ops."""

from tfuse.nn.add import FusedAdd
from tfuse.nn.add_act import FusedAddAct, FusedBiasAct
from tfuse.nn.linear import FusedLinear

__all__ = ["FusedAdd", "FusedAddAct", "FusedBiasAct", "FusedLinear"]
