"""A ``relu_depthwise_conv2d`` call's arguments: checked, normalized, and described by a :class:`ConvSpec`.

The checks raise the errors ``F.conv2d`` would (and those of a depthwise
convolution's shapes), stride/padding/dilation become pairs of ints, and
the geometry every path shares is here: the output size and whether ``x`` is
channels_last.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import torch

from tfuse._backend import Backend
from tfuse.ops._activations import Activation, GradSource, check_activation
from tfuse.ops._checks import check_float_dtype

_OP = "relu_depthwise_conv2d"


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """Everything about one call but its tensors."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    act_in: Activation
    act_out: Activation
    negative_slope: float
    backend: Backend

    @property
    def saved_output(self) -> GradSource:
        """What backward needs of act_out: nothing, its output, or its input z."""
        return self.act_out.grad_source(self.negative_slope)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype torch.autocast computes conv2d in on ``device_type``; None when autocast is off there.

    Devices autocast does not know (``meta``) have no autocast: torch raises when asked about them.
    """
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def _is_channels_last(x: torch.Tensor) -> bool:
    """Channels are x's innermost axis (stride 1) and more than one: the tiles go wide in channels."""
    return x.shape[1] > 1 and x.stride(1) == 1 and x.stride(3) != 1


def _check_activations(act_in: object, act_out: object, negative_slope: object) -> tuple[Activation, Activation, float]:
    act_out_name = "identity" if act_out is None else act_out
    first, slope_in = check_activation(_OP, act_in, None)
    second, _ = check_activation(_OP, act_out_name, None)
    if negative_slope is None:
        return first, second, slope_in
    if not (first.takes_slope or second.takes_slope):
        raise ValueError(
            f"tfuse.{_OP}: negative_slope={negative_slope!r} has no effect with act_in={first.label!r} and "
            f"act_out={act_out!r}; it is the slope of leaky_relu only"
        )
    _, slope = check_activation(_OP, "leaky_relu", negative_slope)
    return first, second, slope


def _check_tensors(x: object, weight: object, bias: object) -> bool:
    """Checks x, weight, bias; returns True for an unbatched ``[C, H, W]`` x."""
    for name, value in (("x", x), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tfuse.{_OP}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"tfuse.{_OP}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    tensors = {"x": x, "weight": weight, **({"bias": bias} if bias is not None else {})}
    for name, t in tensors.items():
        if t.layout != torch.strided:
            raise TypeError(f"tfuse.{_OP}: {name} has layout {t.layout}; only dense (strided) tensors are supported")
        check_float_dtype(_OP, name, t.dtype)
    if x.dim() not in (3, 4):
        raise ValueError(f"tfuse.{_OP}: x must be [N, C, H, W] or [C, H, W], got shape {tuple(x.shape)}")
    channels = x.shape[-3]
    if weight.dim() != 4 or weight.shape[0] != channels or weight.shape[1] != 1:
        raise ValueError(
            f"tfuse.{_OP}: weight must be [C, 1, kH, kW] with C = {channels} (the channels of x): a depthwise "
            f"convolution, groups = in_channels = out_channels (depth multiplier 1); got weight of shape "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[2] < 1 or weight.shape[3] < 1:
        raise ValueError(f"tfuse.{_OP}: weight has an empty kernel, shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"tfuse.{_OP}: bias must be [C] = [{channels}], got shape {tuple(bias.shape)}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        names = sorted(str(d) for d in devices)
        raise RuntimeError(
            f"tfuse.{_OP}: Expected all tensors to be on the same device, but found at least two devices, "
            f"{names[0]} and {names[1]}!"
        )
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1 and autocast_dtype(x.device.type) is None:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"tfuse.{_OP}: x, weight and bias must have one dtype (as F.conv2d), got {listed}")
    return x.dim() == 3


def _pair(name: str, value: object, minimum: int) -> tuple[int, int]:
    # Fast path for what nn.Conv2d passes (a tuple of two ints) and plain ints: the ABC checks below cost
    # microseconds per call, on every forward.
    if type(value) is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        if value[0] >= minimum and value[1] >= minimum:
            return value
    elif type(value) is int and value >= minimum:
        return (value, value)
    items = (value, value) if isinstance(value, numbers.Integral) else value
    if (
        not isinstance(items, Sequence)
        or isinstance(items, str)
        or len(items) != 2
        or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in items)
    ):
        raise TypeError(f"tfuse.{_OP}: {name} must be an int or a pair of ints, got {value!r}")
    pair = (int(items[0]), int(items[1]))
    if min(pair) < minimum:
        raise ValueError(f"tfuse.{_OP}: {name} must be >= {minimum}, got {value!r}")
    return pair


def _padding(
    padding: object, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
) -> tuple[int, int]:
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        if stride != (1, 1):
            raise ValueError(f"tfuse.{_OP}: padding='same' is not supported for strided convolutions (as F.conv2d)")
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        if any(t % 2 for t in total):
            raise ValueError(
                f"tfuse.{_OP}: padding='same' needs an even total padding (dilation * (kernel - 1)) on both axes; "
                f"got {total} for kernel {kernel}, dilation {dilation}: pad x yourself"
            )
        return (total[0] // 2, total[1] // 2)
    if isinstance(padding, str):
        raise ValueError(f"tfuse.{_OP}: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    return _pair("padding", padding, minimum=0)


def _output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _check_output_size(
    x: torch.Tensor,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> None:
    sizes = [_output_size(x.shape[2 + i], kernel[i], stride[i], padding[i], dilation[i]) for i in range(2)]
    if min(sizes) < 1:
        padded = (x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1])
        dilated = tuple(dilation[i] * (kernel[i] - 1) + 1 for i in range(2))
        raise ValueError(
            f"tfuse.{_OP}: the padded input ({padded[0]} x {padded[1]}) is smaller than the dilated kernel "
            f"({dilated[0]} x {dilated[1]})"
        )
