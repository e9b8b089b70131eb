"""``tfuse.functional.relu_depthwise_conv2d``: ``act_out(conv2d(act_in(x), w, b, groups=C))`` without storing act_in(x).

The seeds' ``fuse_relu_depthwise_conv``: in a MobileNet block (BN -> ReLU ->
depthwise conv) the ReLU output exists only to be read by the convolution
and kept for its weight gradient. Here it is never kept:

* what backward saves: ``x`` and ``weight`` (plus, with an ``act_out`` whose
  derivative needs it, the output or the pre-activation); ``act_in(x)`` is
  recomputed in backward, and ``act_in'`` comes from ``x``;
* Triton backend: the activation is applied to each input value as the
  convolution loads it (kernels/depthwise.py): one launch forward, and in
  backward one launch for dx plus one for dw/db (a deterministic reduction
  whose last programs merge the partials);
* PyTorch path (CPU, and GPU shape classes where cuDNN is faster, see
  :func:`depthwise_backend`): torch's activation and ``conv2d``, the
  activation output freed after forward and recomputed in backward (one
  extra elementwise pass), so the memory saving holds on both paths.

Under ``torch.compile`` the call is traced as torch's activation + conv2d,
which Inductor compiles and schedules itself.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tfuse import kernels
from tfuse._backend import Backend, interpreter_active, log_backend_once, requested_backend, select_backend
from tfuse._kit import acc_dtype, acc_fp64, emulate_bf16_rtne, needs_int64, next_power_of_2, split_float
from tfuse._launch import launch, target_programs
from tfuse.ops._activations import Activation, GradSource, check_activation, math_mode
from tfuse.ops._arrivals import arrival_counters
from tfuse.ops._checks import check_float_dtype
from tfuse.ops._library import compiling

_log = logging.getLogger(__name__)

_OP = "relu_depthwise_conv2d"
#: Most taps (KH * KW) the Triton kernels unroll; larger kernels take the PyTorch path on a GPU.
MAX_TRITON_TAPS = 49
#: Elements of a forward/dx tile (BLOCK_P x BLOCK_C).
_TILE_ELEMENTS = 1024
#: Widest channel block of a channels_last tile (channels are contiguous there).
_MAX_BLOCK_C = 128
#: Chunk partials the last program of a dw/db group loads per merge step (in flight together, added in
#: order), channels_last and NCHW: see :func:`_merge_meta`.
_MERGE_CHUNKS = 16
_MERGE_CHUNKS_NCHW = 4

#: Shape classes (see :func:`shape_class`) where a GPU measurement showed the
#: Triton kernel slower than eager activation + cuDNN depthwise convolution
#: (forward + backward); those go to the PyTorch path on CUDA. Filled from
#: ``python -m benchmarks --only depthwise`` on a GPU; empty until one has run.
EAGER_SHAPE_CLASSES: frozenset[tuple] = frozenset()


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


def relu_depthwise_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    act_in: str = "relu",
    act_out: str | None = None,
    negative_slope: float | None = None,
) -> torch.Tensor:
    """``act_out(F.conv2d(act_in(x), weight, bias, stride, padding, dilation, groups=C))``, act_in(x) never stored.

    A depthwise convolution (depth multiplier 1: ``weight`` is ``[C, 1, kH,
    kW]`` for ``x`` of ``C`` channels) whose input activation is fused into
    its input read, the seeds' ``fuse_relu_depthwise_conv``. Backward keeps
    ``x`` and ``weight`` only and recomputes the activation, so a BN -> ReLU
    -> depthwise conv block holds one activation-sized tensor less between
    forward and backward than ``F.relu`` + ``F.conv2d``.

    Args:
        x: ``[N, C, H, W]`` or ``[C, H, W]``, NCHW or channels_last (the
            output keeps the memory format), float16/bfloat16/float32/float64.
        weight: ``[C, 1, kH, kW]``, any kernel size; the dtype of ``x``.
        bias: None or ``[C]``.
        stride, padding, dilation: as ``F.conv2d`` (ints or pairs; padding
            also ``"valid"`` or ``"same"``, zeros only).
        act_in: the activation applied to ``x`` (default relu): any of tfuse's
            activations (``identity`` for a plain depthwise convolution).
        act_out: None (default) or an activation applied to the result, as an
            epilogue; its derivative needs the output (relu, sigmoid, tanh,
            leaky_relu) or the pre-activation (the others), which backward keeps.
        negative_slope: leaky_relu's slope (default 0.01), for whichever of
            ``act_in``/``act_out`` is leaky_relu; an error when neither is.

    Computation is float32 (float64 for float64) with one rounding to the
    output dtype; under ``torch.autocast`` the call runs in the autocast
    dtype, as ``F.conv2d`` does. On a CPU it runs the PyTorch path (torch's
    activation and conv2d); on CUDA the Triton kernels, except for the shape
    classes where cuDNN measured faster (:func:`depthwise_backend`).

    Example:
        >>> import torch, tfuse
        >>> x, w = torch.randn(2, 8, 10, 10), torch.randn(8, 1, 3, 3)
        >>> y = tfuse.functional.relu_depthwise_conv2d(x, w, padding=1)
        >>> ref = torch.nn.functional.conv2d(torch.relu(x), w, padding=1, groups=8)
        >>> torch.allclose(y, ref, atol=1e-5)
        True

    Raises:
        TypeError: a non-tensor or non-floating input, mismatched dtypes, a
            non-string activation, a non-integer stride/padding/dilation.
        ValueError: a weight that is not ``[C, 1, kH, kW]`` for the channels
            of ``x`` (another groups or depth multiplier), a bias that is not
            ``[C]``, bad stride/padding/dilation, an input smaller than the
            dilated kernel, an unknown activation or a misplaced slope.
        RuntimeError: tensors on different devices.
    """
    act_in_member, act_out_member, slope = _check_activations(act_in, act_out, negative_slope)
    unbatched = _check_tensors(x, weight, bias)
    kernel = (weight.shape[2], weight.shape[3])
    stride_pair = _pair("stride", stride, minimum=1)
    dilation_pair = _pair("dilation", dilation, minimum=1)
    padding_pair = _padding(padding, kernel, stride_pair, dilation_pair)
    if unbatched:
        x = x.unsqueeze(0)
    autocast = autocast_dtype(x.device.type)
    if autocast is not None:
        # conv2d is on autocast's lower-precision list: compute in the autocast dtype, as F.conv2d does.
        x, weight = x.to(autocast), weight.to(autocast)
        bias = bias.to(autocast) if bias is not None else None
    _check_output_size(x, kernel, stride_pair, padding_pair, dilation_pair)
    if compiling():
        y = _composite(x, weight, bias, stride_pair, padding_pair, dilation_pair, act_in_member, act_out_member, slope)
        return y.squeeze(0) if unbatched else y
    backend = depthwise_backend(x, kernel, stride_pair)
    spec = ConvSpec(stride_pair, padding_pair, dilation_pair, act_in_member, act_out_member, slope, backend)
    if autocast is None:
        y = _ActDepthwiseConvFunction.apply(spec, x, weight, bias)
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = _ActDepthwiseConvFunction.apply(spec, x, weight, bias)
    return y.squeeze(0) if unbatched else y


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype torch.autocast computes conv2d in on ``device_type``; None when autocast is off there.

    Devices autocast does not know (``meta``) have no autocast: torch raises when asked about them.
    """
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def shape_class(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int]) -> tuple:
    """The key of :data:`EAGER_SHAPE_CLASSES`: (kernel, stride, channels_last, dtype, spatial size class).

    The spatial class is the input's ``H * W`` rounded up to a power of 4
    (7x7 and 14x14 maps behave alike, 56x56 and 112x112 alike), so a
    measurement at one MobileNet/EfficientNet stage covers its neighbours.
    """
    pixels = max(1, x.shape[-2] * x.shape[-1])
    spatial = 4 ** math.ceil(math.log(pixels, 4))
    return (kernel, stride, _is_channels_last(x), x.dtype, spatial)


def depthwise_backend(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int]) -> Backend:
    """The dispatch rule: which implementation serves a call.

    tfuse's backend rules (:func:`tfuse.select_backend`) first: the PyTorch
    path on a CPU unless Triton's interpreter is on, and whatever
    ``TFUSE_BACKEND``/``use_backend`` forces. On CUDA, when nothing is forced,
    the PyTorch path (eager activation + cuDNN, activation recomputed in
    backward) serves kernels of more than :data:`MAX_TRITON_TAPS` taps and the
    shape classes of :data:`EAGER_SHAPE_CLASSES`, and says so once per class
    in the log; the Triton kernels serve the rest.
    """
    backend = select_backend(x.device, _OP, x.numel())
    if backend is Backend.TRITON and x.device.type == "cuda" and requested_backend() is None:
        key = shape_class(x, kernel, stride)
        reason = eager_reason(key)
        if reason is not None:
            if key not in _announced_classes:
                _announced_classes.add(key)
                _log.info(
                    "tfuse.%s: eager activation + cuDNN for shape class %s (%s); the activation is still "
                    "recomputed in backward rather than stored",
                    _OP,
                    key,
                    reason,
                )
            return Backend.TORCH
    log_backend_once(_log, _OP, backend, x.device)
    return backend


def eager_reason(key: tuple) -> str | None:
    """Why the shape class ``key`` (:func:`shape_class`) goes to eager activation + cuDNN on CUDA; None: Triton."""
    kernel = key[0]
    if kernel[0] * kernel[1] > MAX_TRITON_TAPS:
        return f"a {kernel[0]}x{kernel[1]} kernel has more than {MAX_TRITON_TAPS} taps"
    if key in EAGER_SHAPE_CLASSES:
        return "the depthwise benchmark measured the Triton kernel slower than cuDNN for this shape class"
    return None


_announced_classes: set[tuple] = set()


# --------------------------------------------------------------------------------------------- checks


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


# --------------------------------------------------------------------------------------------- PyTorch path


def _composite(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    act_in: Activation,
    act_out: Activation,
    slope: float,
) -> torch.Tensor:
    """The computation in torch ops (traced by torch.compile; the reference of every path)."""
    z = F.conv2d(act_in.forward(x, slope), weight, bias, stride, padding, dilation, x.shape[1])
    return act_out.forward(z, slope)


def _forward_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, what act_out's backward needs); act_in(x) is a temporary freed on return."""
    a = spec.act_in.forward(x, spec.negative_slope)
    z = F.conv2d(a, weight, bias, spec.stride, spec.padding, spec.dilation, x.shape[1])
    del a
    if _is_channels_last(x) and not z.is_contiguous(memory_format=torch.channels_last):
        # The output keeps x's format; torch's CUDA conv2d returns float64 channels_last input as NCHW.
        z = z.contiguous(memory_format=torch.channels_last)
    source = spec.saved_output
    if source is GradSource.NONE:
        return z, None
    if source is GradSource.OUTPUT:
        y = spec.act_out.forward_(z, spec.negative_slope)  # z is ours: overwrite it
        return y, y
    return spec.act_out.forward(z, spec.negative_slope), z


def _backward_torch(
    gy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved_out: torch.Tensor | None,
    spec: ConvSpec,
    needed: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dx, dw, db with torch ops: differentiable, so it also serves ``create_graph=True`` on every backend."""
    slope = spec.negative_slope
    gz = gy
    if spec.saved_output is not GradSource.NONE:
        if torch.is_grad_enabled() and spec.saved_output is GradSource.INPUT:
            # Double backward: z must lead back to x and weight, so it is recomputed on the graph.
            a = spec.act_in.forward(x, slope)
            saved_out = F.conv2d(a, weight, bias, spec.stride, spec.padding, spec.dilation, x.shape[1])
        gz = spec.act_out.backward(gy, saved_out, slope)
    in_source = spec.act_in.grad_source(slope)
    needs_a = needed[1] or (needed[0] and in_source is GradSource.OUTPUT and spec.act_in not in _SIGN_ACTIVATIONS)
    a = spec.act_in.forward(x, slope) if needs_a else x
    da, dw, db = torch.ops.aten.convolution_backward(
        gz,
        a,
        weight,
        [weight.shape[0]] if bias is not None else None,
        spec.stride,
        spec.padding,
        spec.dilation,
        False,
        [0, 0],
        x.shape[1],
        [needed[0], needed[1], needed[2] and bias is not None],
    )
    dx = None
    if needed[0]:
        if in_source is GradSource.NONE:
            dx = da
        else:
            # relu and leaky_relu (slope >= 0) read their derivative off the sign, which x has as act(x) has.
            keep = x if in_source is GradSource.INPUT or spec.act_in in _SIGN_ACTIVATIONS else a
            dx = spec.act_in.backward(da, keep, slope)
    return dx, dw if needed[1] else None, db if needed[2] and bias is not None else None


#: Activations whose derivative follows from the sign of their input as well as from their output.
_SIGN_ACTIVATIONS = (Activation.RELU, Activation.LEAKY_RELU)


# --------------------------------------------------------------------------------------------- autograd


class _ActDepthwiseConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: ConvSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):  # type: ignore[override]
        if spec.backend is Backend.TRITON:
            y, saved_out = _forward_triton(x, weight, bias, spec)
        else:
            y, saved_out = _forward_torch(x, weight, bias, spec)
        ctx.spec = spec
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, bias, saved_out)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, weight, bias, saved_out = ctx.saved_tensors
        needed = tuple(ctx.needs_input_grad[1:4])
        spec: ConvSpec = ctx.spec
        if spec.backend is Backend.TRITON and not torch.is_grad_enabled():
            dx, dw, db = _backward_triton(gy, x, weight, bias, saved_out, spec, needed)
        else:
            dx, dw, db = _backward_torch(gy, x, weight, bias, saved_out, spec, needed)
        return None, dx, dw, db


# --------------------------------------------------------------------------------------------- Triton path


def _is_channels_last(x: torch.Tensor) -> bool:
    """Channels are x's innermost axis (stride 1) and more than one: the tiles go wide in channels."""
    return x.shape[1] > 1 and x.stride(1) == 1 and x.stride(3) != 1


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """How the forward and dx kernels cut ``rows x cols`` pixels by ``channels`` into programs."""

    block_h: int
    block_w: int
    block_c: int
    tiles_w: int
    tiles_per_image: int
    c_tiles: int

    def grid(self, images: int) -> tuple[int, int]:
        return (images * self.tiles_per_image, self.c_tiles)

    channels_fastest: bool

    def meta(self) -> dict[str, int]:
        return dict(
            BLOCK_H=self.block_h, BLOCK_W=self.block_w, BLOCK_C=self.block_c, CHANNELS_FASTEST=self.channels_fastest
        )


def _tile_elements(kernel: tuple[int, int], dtype: torch.dtype) -> int:
    """Elements of a program's tile: smaller for wide kernels and float64, whose taps hold more registers
    (the sm_90 compile spilled 5x5 at 1024: benchmarks/results/sm90-kernels.md)."""
    elements = _TILE_ELEMENTS if kernel[1] <= 5 else _TILE_ELEMENTS // 2
    return elements // 2 if dtype == torch.float64 else elements


def _spatial_tiles(channels: int, rows: int, cols: int, channels_last: bool, elements: int) -> _Tiles:
    """Tiles wide in channels for channels_last (channels contiguous), wide in columns for NCHW (columns are)."""
    if channels_last:
        block_c = min(next_power_of_2(channels), _MAX_BLOCK_C, elements)
        pixels = max(1, elements // block_c)
        block_w = min(next_power_of_2(cols), pixels)
        block_h = max(1, min(next_power_of_2(rows), pixels // block_w))
    else:
        block_w = min(next_power_of_2(cols), elements)
        block_h = max(1, min(next_power_of_2(rows), elements // block_w))
        block_c = max(1, min(next_power_of_2(channels), elements // (block_h * block_w)))
    tiles_w = math.ceil(cols / block_w)
    tiles_per_image = tiles_w * math.ceil(rows / block_h)
    return _Tiles(block_h, block_w, block_c, tiles_w, tiles_per_image, math.ceil(channels / block_c), channels_last)


def _flat_blocks(channels: int, pixels: int, channels_last: bool, elements: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the dw kernel, whose programs walk flattened (n, oh, ow) outputs."""
    if channels_last:
        block_c = min(next_power_of_2(channels), _MAX_BLOCK_C, elements)
        return max(1, min(next_power_of_2(pixels), elements // block_c)), block_c
    block_p = min(next_power_of_2(pixels), elements)
    return block_p, max(1, min(next_power_of_2(channels), elements // block_p))


def _empty_like_layout(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return torch.empty(tuple(shape), dtype=x.dtype, device=x.device, memory_format=fmt)


def _largest_offset(tensors: Sequence[torch.Tensor], block: int, block_c: int, spec: ConvSpec, kernel) -> int:
    """A bound on any lane's element offset (masked lanes of edge tiles and of padding included); ``block``
    bounds a tile's extent in pixels along either axis."""
    reach = max(spec.padding) + max(spec.dilation) * max(kernel) + max(spec.stride) * (block + 1) + block
    bound = 0
    for t in tensors:
        n, c, h, w = t.shape
        extents = (n + 1, c + block_c, h + reach, w + reach)
        bound = max(bound, sum(e * abs(s) for e, s in zip(extents, t.stride())))
    return bound


def _scalars(spec: ConvSpec) -> tuple:
    """The runtime geometry and slopes every kernel takes (strides are compile-time: STRIDE_H/W)."""
    return (*spec.padding, *spec.dilation, *split_float(spec.negative_slope))


def _static_meta(spec: ConvSpec, kernel: tuple[int, int], dtype: torch.dtype) -> dict:
    return dict(
        KH=kernel[0],
        KW=kernel[1],
        STRIDE_H=spec.stride[0],
        STRIDE_W=spec.stride[1],
        ACT_IN=spec.act_in.code,
        ACT_OUT=spec.act_out.code,
        MATH=math_mode(dtype, interpreter_active()),
        ACC_FP64=acc_fp64(dtype),
    )


def _forward_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, c, h, w = x.shape
    kernel = (weight.shape[2], weight.shape[3])
    oh, ow = (_output_size((h, w)[i], kernel[i], spec.stride[i], spec.padding[i], spec.dilation[i]) for i in range(2))
    y = _empty_like_layout(x, (n, c, oh, ow))
    source = spec.saved_output
    z = _empty_like_layout(x, (n, c, oh, ow)) if source is GradSource.INPUT else None
    if y.numel() == 0:
        return y, (y if source is GradSource.OUTPUT else z)
    tiles = _spatial_tiles(c, oh, ow, _is_channels_last(x), _tile_elements(kernel, x.dtype))
    block = max(tiles.block_h, tiles.block_w)
    launch(
        kernels._dw_fwd_kernel,
        tiles.grid(n),
        (
            x,
            weight,
            bias if bias is not None else weight,
            y,
            z if z is not None else y,
            c,
            h,
            w,
            oh,
            ow,
            tiles.tiles_w,
            tiles.tiles_per_image,
            *x.stride(),
            *y.stride(),
            weight.stride(0),
            weight.stride(2),
            weight.stride(3),
            *_scalars(spec),
        ),
        dict(
            _static_meta(spec, kernel, x.dtype),
            HAS_BIAS=bias is not None,
            STORE_Z=z is not None,
            INDEX_64=needs_int64(_largest_offset((x, y), block, tiles.block_c, spec, kernel)),
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            **tiles.meta(),
        ),
        x.device,
    )
    return y, (y if source is GradSource.OUTPUT else z)


def _backward_triton(
    gy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved_out: torch.Tensor | None,
    spec: ConvSpec,
    needed: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    n, c, h, w = x.shape
    _, _, oh, ow = gy.shape
    kernel = (weight.shape[2], weight.shape[3])
    saved = saved_out if saved_out is not None else gy  # an unread placeholder when act_out is identity
    meta = dict(_static_meta(spec, kernel, x.dtype), SAVED_IS_OUTPUT=spec.saved_output is GradSource.OUTPUT)
    channels_last = _is_channels_last(x)
    dx = dw = db = None
    if needed[0]:
        dx = _empty_like_layout(x, x.shape)
        if dx.numel():
            tiles = _spatial_tiles(c, h, w, channels_last, _tile_elements(kernel, x.dtype))
            block = max(tiles.block_h, tiles.block_w)
            launch(
                kernels._dw_bwd_dx_kernel,
                tiles.grid(n),
                (
                    gy,
                    saved,
                    x,
                    weight,
                    dx,
                    c,
                    h,
                    w,
                    oh,
                    ow,
                    tiles.tiles_w,
                    tiles.tiles_per_image,
                    *gy.stride(),
                    *saved.stride(),
                    *x.stride(),
                    *dx.stride(),
                    weight.stride(0),
                    weight.stride(2),
                    weight.stride(3),
                    *_scalars(spec),
                ),
                dict(
                    meta,
                    INDEX_64=needs_int64(_largest_offset((gy, saved, x, dx), block, tiles.block_c, spec, kernel)),
                    EMULATE_BF16_RTNE=emulate_bf16_rtne(),
                    **tiles.meta(),
                ),
                x.device,
            )
    want_bias = needed[2] and bias is not None
    if needed[1] or want_bias:
        dw = torch.empty_like(weight)
        db = torch.empty_like(bias) if bias is not None else None
        _weight_grads(gy, saved, x, dw, db, kernel, spec, meta, channels_last)
    return dx, dw if needed[1] else None, db if want_bias else None


def _weight_grads(gy, saved, x, dw, db, kernel, spec: ConvSpec, meta, channels_last: bool) -> None:  # type: ignore[no-untyped-def]
    """dw (and db) in one launch: partial rows per chunk of outputs, summed in chunk order by the last program
    of each (tap, channel block) to finish (kernels/depthwise.py)."""
    n, c, h, w = x.shape
    _, _, oh, ow = gy.shape
    taps = kernel[0] * kernel[1]
    n_outputs = n * oh * ow
    if n_outputs == 0 or c == 0:
        dw.zero_()
        if db is not None:
            db.zero_()
        return
    block_p, block_c = _flat_blocks(c, n_outputs, channels_last, _tile_elements(kernel, x.dtype))
    c_tiles = math.ceil(c / block_c)
    rows = taps + (db is not None)  # partial rows per chunk: the taps, and the bias
    n_chunks, tiles_per_chunk = _chunks(math.ceil(n_outputs / block_p), rows * c_tiles, x.device)
    partial = torch.empty((n_chunks, rows, c), dtype=acc_dtype(x.dtype), device=x.device)
    largest = max(_largest_offset((gy, saved, x), 1, block_c, spec, kernel), n_outputs + 2 * block_p)
    launch(
        kernels._dw_bwd_dw_partial_kernel,
        (rows, n_chunks, c_tiles),
        (
            gy,
            saved,
            x,
            partial,
            dw,
            db if db is not None else dw,
            arrival_counters(rows * c_tiles, x.device),
            c,
            h,
            w,
            oh,
            ow,
            n_outputs,
            tiles_per_chunk,
            *gy.stride(),
            *saved.stride(),
            *x.stride(),
            dw.stride(0),
            dw.stride(2),
            dw.stride(3),
            *_scalars(spec),
        ),
        dict(
            meta,
            INDEX_64=needs_int64(largest),
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            BLOCK_P=block_p,
            BLOCK_C=block_c,
            **_merge_meta(n_chunks, channels_last),
        ),
        x.device,
    )


def _merge_meta(n_chunks: int, channels_last: bool) -> dict:
    """The merge step of the dw/db reduction's last programs: MK chunk partials loaded at once (in flight
    together, then added in chunk order), and MERGE_LOOP only where one step does not cover every chunk.

    A step holds about MK loads per thread. The NCHW specialisations, whose
    reduction loop needs 53-62 registers (a quotient and a remainder per
    output), went past their bound of 64 (up to 75, sm_90 compile) with steps
    of 8 or 16 or a merge loop of 8, not with steps of 4; the channels_last
    ones (about 32) take steps of 16 at no cost. channels_last is where wide
    steps count: wide channel blocks, and many chunks (58 in the roofline's cases).
    """
    step = min(_MERGE_CHUNKS if channels_last else _MERGE_CHUNKS_NCHW, next_power_of_2(n_chunks))
    return dict(MK=step, MERGE_LOOP=n_chunks > step)


def _chunks(tiles: int, programs_per_chunk: int, device: torch.device) -> tuple[int, int]:
    """(chunks, tiles per chunk) of the dw/db reduction: about two programs per target program (target_programs),
    at most 65535 chunks (a grid axis), and no empty chunk."""
    n_chunks = max(1, min(tiles, 65535, 2 * target_programs(device) // programs_per_chunk))
    tiles_per_chunk = math.ceil(tiles / n_chunks)
    return math.ceil(tiles / tiles_per_chunk), tiles_per_chunk
