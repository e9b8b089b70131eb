"""Drop-in ``nn.Module`` wrappers over tfuse's fused ops.

Every layer that subclasses a torch layer (``FusedLinear``,
``FusedBatchNormAct1d/2d``, ``FusedSyncBatchNormAct``, ``FusedActDepthwiseConv2d``,
``FusedGroupNormAct``, ``FusedLayerNormAct``) takes that layer's
positional and keyword arguments and, by default, computes what it computes;
tfuse's own options (``act``, ``negative_slope``) are keyword-only, and the
activation is identity until you name one. Under ``torch.fx`` every tfuse
module is traced as a leaf (one ``call_module`` node).

Importing this package also makes ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
turn tfuse's fused batch-norm layers into :class:`FusedSyncBatchNormAct` (see
:func:`convert_sync_batchnorm`) instead of plain ``nn.SyncBatchNorm`` layers
that would drop their activation.
"""

from tfuse.nn.add import FusedAdd
from tfuse.nn.add_act import FusedAddAct, FusedBiasAct
from tfuse.nn.batch_norm import (
    FusedBatchNormAct1d,
    FusedBatchNormAct2d,
    FusedSyncBatchNormAct,
    convert_sync_batchnorm,
)
from tfuse.nn.bn_depthwise import BatchNormBoundDepthwiseConv2d, FusedBatchNormActDepthwiseConv2d
from tfuse.nn.depthwise import FusedActDepthwiseConv2d
from tfuse.nn.linear import FusedLinear
from tfuse.nn.norm_act import FusedGroupNormAct, FusedLayerNormAct

__all__ = [
    "BatchNormBoundDepthwiseConv2d",
    "FusedActDepthwiseConv2d",
    "FusedAdd",
    "FusedAddAct",
    "FusedBatchNormAct1d",
    "FusedBatchNormAct2d",
    "FusedBatchNormActDepthwiseConv2d",
    "FusedBiasAct",
    "FusedGroupNormAct",
    "FusedLayerNormAct",
    "FusedLinear",
    "FusedSyncBatchNormAct",
    "convert_sync_batchnorm",
]
