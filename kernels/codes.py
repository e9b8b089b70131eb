"""The integer codes shared by the kernels (as ``tl.constexpr``) and their launchers: plain Python.

Launchers read these without importing Triton, so tfuse imports, and its
PyTorch path runs, where Triton is not installed. Each kernel module wraps
the codes it uses in ``tl.constexpr`` under the same names.
"""

# Activations (kernels/activations.py ``ACT``).
IDENTITY = 0
RELU = 1
LEAKY_RELU = 2
GELU = 3  # erf form
GELU_TANH = 4  # tanh approximation
SILU = 5
SIGMOID = 6
TANH = 7
RELU6 = 8
HARDTANH = 9  # min -1, max 1 (nn.Hardtanh's defaults)
HARDSWISH = 10
HARDSIGMOID = 11
MISH = 12
ELU = 13  # alpha 1 (nn.ELU's default)

# Math modes of the activations (kernels/activations.py ``MATH``).
PORTABLE = 0
GPU = 1
GPU_TANH_APPROX = 2

# Operand modes of the elementwise tiles (kernels/tiles.py), and the add_act backward's per-channel gradient mode.
LINEAR = 0
SCALAR = 1
ROW = 2
COL = 3
STRIDED = 4
CHAN = 5

# Norm kinds of the gradient-norm kernels (kernels/norm.py).
NORM_P = 0
NORM_2 = 1
NORM_1 = 2
NORM_INF = 3

# How a batch-norm program's columns map to channels (kernels/batch_norm.py).
SEG_LANE = 0
SEG_ONE = 1
SEG_PACKED = 2

# Where the channel of an element is in the group/layer norm view [N, G, A, B] (kernels/norm_act.py).
NORM_CH_A = 0  # channel g * A + a (group norm, NCHW)
NORM_CH_B = 1  # channel g * B + b (group norm, channels_last; layer norm)
