"""Float arguments reach the kernels with float64 precision: Triton passes Python floats as float32.

Launchers split a slope, eps or momentum into two float32 numbers
(``tfuse._kit.split_float``) and float64 kernels add them back
(``kernels.kit._float_arg``); without the split, leaky_relu's slope 0.01 acted
as 0.0099999998 in float64 (2e-8 relative).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tfuse
from tfuse._kit import split_float
from tfuse.functional import batch_norm_act, relu_depthwise_conv2d

SLOPE = 0.01  # not a float32 number: rounded to float32 it is 2.2e-8 off (relative)
TIGHT = dict(rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("value", [0.01, 0.1, 1e-5, -0.3, 1.0, 0.0, 1e-300, 3e38, 1e39, float("inf"), float("nan")])
def test_split_float_keeps_48_bits(value):
    hi, lo = split_float(value)
    if value != value:
        assert hi != hi
    elif abs(value) > float(np.finfo(np.float32).max):  # beyond float32: the kernel sees inf either way
        assert hi == value and lo == 0.0
    else:
        assert float(np.float32(hi)) == hi and float(np.float32(lo)) == lo
        assert abs((hi + lo) - value) <= 2**-47 * abs(value) + 1e-45


def test_the_kernels_see_the_float64_slope(device):
    assert abs(float(np.float32(SLOPE)) - SLOPE) > 1e-10  # the premise: float32 would round it
    z = torch.randn(8, 40, dtype=torch.float64, device=device).requires_grad_()
    with tfuse.use_backend("triton"):
        y = tfuse.add_act(z, act="leaky_relu", negative_slope=SLOPE)
        (dz,) = torch.autograd.grad(y, z, torch.ones_like(y))
    ref = F.leaky_relu(z, SLOPE)
    (ref_dz,) = torch.autograd.grad(ref, z, torch.ones_like(ref))
    torch.testing.assert_close(y, ref, **TIGHT)
    torch.testing.assert_close(dz, ref_dz, **TIGHT)


def test_batch_norm_eps_momentum_and_slope_in_float64(device):
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64, device=device).requires_grad_()
    mean, var = torch.zeros(3, dtype=torch.float64, device=device), torch.ones(3, dtype=torch.float64, device=device)
    ref_mean, ref_var = mean.clone(), var.clone()
    with tfuse.use_backend("triton"):
        y = batch_norm_act(x, mean, var, training=True, momentum=0.1, eps=1e-3, act="leaky_relu",
                           negative_slope=SLOPE)
    ref = F.leaky_relu(F.batch_norm(x, ref_mean, ref_var, training=True, momentum=0.1, eps=1e-3), SLOPE)
    torch.testing.assert_close(y, ref, **TIGHT)
    torch.testing.assert_close(mean, ref_mean, **TIGHT)
    torch.testing.assert_close(var, ref_var, **TIGHT)


def test_depthwise_slope_in_float64(device):
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, device=device)
    w = torch.randn(3, 1, 3, 3, dtype=torch.float64, device=device)
    with tfuse.use_backend("triton"):
        y = relu_depthwise_conv2d(x, w, padding=1, act_in="leaky_relu", negative_slope=SLOPE)
    torch.testing.assert_close(y, F.conv2d(F.leaky_relu(x, SLOPE), w, padding=1, groups=3), **TIGHT)
