"""The functional API of tfuse, in the manner of ``torch.nn.functional``."""

from tfuse.ops.add import add
from tfuse.ops.add_act import add_act
from tfuse.ops.batch_norm import batch_norm_act
from tfuse.ops.bn_depthwise import batch_norm_act_depthwise_conv2d
from tfuse.ops.depthwise import relu_depthwise_conv2d
from tfuse.ops.norm_act import group_norm_act, layer_norm_act

__all__ = [
    "add",
    "add_act",
    "batch_norm_act",
    "batch_norm_act_depthwise_conv2d",
    "group_norm_act",
    "layer_norm_act",
    "relu_depthwise_conv2d",
]
