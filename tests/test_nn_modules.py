"""Every tfuse module is a drop-in for the torch class it subclasses or replaces.

Signatures (names, order, defaults, positional constructions) against
torch's; defaults and converters that compute what the torch layer computes;
SyncBatchNorm conversion and torch.fx tracing that keep the model's function;
deepcopy / pickle / torch.save; reprs and arguments that would have no effect.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import tfuse
from tfuse.nn import (
    FusedAdd,
    FusedAddAct,
    FusedBatchNormAct1d,
    FusedBatchNormAct2d,
    FusedBiasAct,
    FusedLinear,
    FusedSyncBatchNormAct,
    convert_sync_batchnorm,
)

from dist_helpers import run_world
from helpers import assert_batch_norm_input_grad_accurate, make_input

TORCH_ACT = {
    "identity": lambda y: y,
    "relu": F.relu,
    "leaky_relu": lambda y: F.leaky_relu(y, 0.2),
    "gelu": F.gelu,
    "silu": F.silu,
    "tanh": torch.tanh,
}
BATCHNORM_PAIRS = [
    (FusedBatchNormAct2d, nn.BatchNorm2d),
    (FusedBatchNormAct1d, nn.BatchNorm1d),
    (FusedSyncBatchNormAct, nn.SyncBatchNorm),
]
TORCH_BATCHNORM_HAS_BIAS = "bias" in inspect.signature(nn.BatchNorm2d).parameters


@pytest.fixture(params=["triton", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on each path: Triton kernels (the interpreter on CPU) and the PyTorch path."""
    monkeypatch.setenv(tfuse.BACKEND_ENV_VAR, request.param)
    return request.param


def batchnorm_input(cls: type, channels: int, device: torch.device) -> torch.Tensor:
    shape = (6, channels) if cls is FusedBatchNormAct1d else (3, channels, 4, 5)
    return make_input(shape, torch.float32, device) * 2 + 0.5


# ------------------------------------------------------------------ item 8: signatures


@pytest.mark.parametrize("ours, theirs", [(FusedLinear, nn.Linear), *BATCHNORM_PAIRS])
def test_signature_is_torchs_plus_keyword_only_options(ours, theirs):
    mine = list(inspect.signature(ours).parameters.values())
    torchs = list(inspect.signature(theirs).parameters.values())
    positional = [p for p in torchs if p.kind is not p.KEYWORD_ONLY]
    # torch's positional parameters, in torch's order, with torch's names, kinds and defaults.
    assert [(p.name, p.kind, p.default) for p in mine[: len(positional)]] == [
        (p.name, p.kind, p.default) for p in positional
    ]
    extra = mine[len(positional):]
    assert all(p.kind is p.KEYWORD_ONLY for p in extra), f"{ours.__name__}: {extra} must be keyword-only"
    # torch's keyword-only parameters (BatchNorm's bias=True in torch 2.13) with their defaults.
    by_name = {p.name: p for p in extra}
    for p in torchs:
        if p.kind is p.KEYWORD_ONLY:
            assert by_name[p.name].default == p.default
    tfuse_own = set(by_name) - {p.name for p in torchs}
    assert tfuse_own == ({"act", "negative_slope", "bias"} - {p.name for p in torchs})
    assert by_name["act"].default == "identity" and by_name["negative_slope"].default is None


def test_signatures_of_modules_without_a_torch_class():
    # FusedAdd replaces ``a + b`` (no arguments), FusedAddAct ``act(x + y)``, FusedBiasAct a bias + act:
    # the primary arguments positional, every other option keyword-only.
    def shape_of(cls):
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(cls).parameters.values()]

    empty = inspect.Parameter.empty
    assert shape_of(FusedAdd) == []
    assert shape_of(FusedAddAct) == [("act", "POSITIONAL_OR_KEYWORD", "relu"), ("negative_slope", "KEYWORD_ONLY", None)]
    assert shape_of(FusedBiasAct) == [
        ("num_features", "POSITIONAL_OR_KEYWORD", empty), ("act", "POSITIONAL_OR_KEYWORD", "relu"),
        ("dim", "KEYWORD_ONLY", -1), ("negative_slope", "KEYWORD_ONLY", None),
        ("device", "KEYWORD_ONLY", None), ("dtype", "KEYWORD_ONLY", None),
    ]
    assert FusedBiasAct(5, "silu").act == "silu" and FusedAddAct("tanh").act == "tanh"
    with pytest.raises(TypeError):
        FusedBiasAct(5, "silu", 1)  # dim is keyword-only
    with pytest.raises(TypeError):
        FusedAddAct("leaky_relu", 0.2)  # negative_slope is keyword-only


@pytest.mark.parametrize("ours, theirs", BATCHNORM_PAIRS)
def test_batchnorm_positional_construction_matches_torch(ours, theirs):
    # nn.BatchNorm2d(64, 1e-3, 0.01) used to put 1e-3 into act: every positional slot is torch's now.
    args = [(64, 1e-3, 0.01), (64, 1e-3, None, False, False), (8, 1e-4, 0.3, True, True)]
    tail = (None, "cpu", torch.float64) if theirs is nn.SyncBatchNorm else ("cpu", torch.float64)
    args.append((8, 1e-4, 0.3, True, False, *tail))
    for positional in args:
        mine, reference = ours(*positional), theirs(*positional)
        for name in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(mine, name) == getattr(reference, name), (positional, name)
        assert mine.act == "identity"
        assert list(mine.state_dict()) == list(reference.state_dict())
        for (name, a), b in zip(reference.state_dict().items(), mine.state_dict().values()):
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), name
    assert FusedSyncBatchNormAct(4, 1e-5, 0.1, True, True, "group-sentinel").process_group == "group-sentinel"


def test_linear_positional_construction_matches_torch():
    for positional in [(5, 7), (5, 7, False), (5, 7, True, "cpu", torch.float64)]:
        mine, reference = FusedLinear(*positional), nn.Linear(*positional)
        assert (mine.in_features, mine.out_features) == (reference.in_features, reference.out_features)
        assert mine.act == "identity"
        assert [(n, t.shape, t.dtype) for n, t in mine.state_dict().items()] == [
            (n, t.shape, t.dtype) for n, t in reference.state_dict().items()
        ]


@pytest.mark.parametrize("cls", [FusedBatchNormAct2d, FusedBatchNormAct1d])
@pytest.mark.parametrize("act", ["identity", "relu"])
def test_batchnorm_without_bias_matches_torch(cls, act, backend, device):
    channels = 5
    fused = cls(channels, bias=False, act=act).to(device)
    assert fused.weight is not None and fused.bias is None
    assert list(fused.state_dict()) == ["weight", "running_mean", "running_var", "num_batches_tracked"]
    assert "bias=False" in repr(fused)
    base = nn.BatchNorm2d if cls is FusedBatchNormAct2d else nn.BatchNorm1d
    reference = base(channels).to(device)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 2.0)
        reference.weight.copy_(fused.weight)
        reference.bias.zero_()  # a BatchNorm without shift is one whose shift stays zero
    reference.bias.requires_grad_(False)
    if TORCH_BATCHNORM_HAS_BIAS:
        assert list(base(channels, bias=False).state_dict()) == list(fused.state_dict())
    for training in (True, False):
        fused.train(training), reference.train(training)
        x = batchnorm_input(cls, channels, device).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        y, expected = fused(x), TORCH_ACT[act](reference(x_ref))
        torch.testing.assert_close(y, expected)
        dy = torch.randn_like(y)
        y.backward(dy), expected.backward(dy)
        if training:  # d(x) against float64 within the bound of its terms (they cancel for some data)
            z = F.batch_norm(x.detach().double(), None, None, fused.weight.detach().double(), None, training=True,
                             eps=reference.eps).requires_grad_()
            (grad_out,) = torch.autograd.grad(TORCH_ACT[act](z), z, dy.double())
            assert_batch_norm_input_grad_accurate(x.grad, x, fused.weight, grad_out, reference.eps)
        else:
            torch.testing.assert_close(x.grad, x_ref.grad)
        torch.testing.assert_close(fused.weight.grad, reference.weight.grad)
        fused.weight.grad = reference.weight.grad = None
        torch.testing.assert_close(fused.running_mean, reference.running_mean)
        torch.testing.assert_close(fused.running_var, reference.running_var)
    # Converted from a torch layer without shift, and reset like torch's.
    if TORCH_BATCHNORM_HAS_BIAS:
        converted = cls.from_batchnorm(base(channels, bias=False))
        assert converted.bias is None and "bias" not in converted.state_dict()
    fused.reset_parameters()
    assert (fused.weight == 1).all() and fused.bias is None


@pytest.mark.parametrize("cls", [FusedBatchNormAct2d, FusedSyncBatchNormAct])
def test_bias_false_where_torch_batchnorm_lacks_it(cls, monkeypatch, device):
    # torch 2.11 (the GPU machines) has no BatchNorm(bias=); tfuse takes it there too.
    import tfuse.nn.batch_norm as module

    monkeypatch.setattr(module, "_TORCH_BATCHNORM_HAS_BIAS", False)
    monkeypatch.setattr(nn.modules.batchnorm._NormBase, "extra_repr", lambda self: f"{self.num_features}")
    layer = cls(4, bias=False, act="relu").to(device)
    assert layer.bias is None and "bias" not in layer.state_dict() and repr(layer).endswith("4, bias=False, act='relu')")
    layer.reset_parameters()
    x = make_input((2, 4, 3, 3), torch.float32, device)
    torch.testing.assert_close(layer(x), F.relu(F.batch_norm(x, None, None, layer.weight, None, True)))


# ------------------------------------------------------------------ item 9: defaults and converters


def test_default_fused_linear_is_nn_linear(device):
    reference = nn.Linear(12, 7, device=device)
    fused = FusedLinear(12, 7, device=device)
    fused.load_state_dict(reference.state_dict())
    x = make_input((4, 3, 12), torch.float32, device)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    y, expected = fused(x), reference(x_ref)
    assert torch.equal(y, expected)  # exactly nn.Linear's computation (negative logits survive)
    assert (y < 0).any()
    y.sum().backward(), expected.sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(fused.weight.grad, reference.weight.grad)
    assert torch.equal(fused.bias.grad, reference.bias.grad)


@pytest.mark.parametrize("cls", [FusedBatchNormAct2d, FusedBatchNormAct1d])
def test_default_fused_batchnorm_is_torch_batchnorm(cls, backend, device):
    base = nn.BatchNorm2d if cls is FusedBatchNormAct2d else nn.BatchNorm1d
    reference, fused = base(6).to(device), cls(6).to(device)
    assert fused.act == "identity"
    for training in (True, True, False):
        reference.train(training), fused.train(training)
        x = batchnorm_input(cls, 6, device)
        expected = reference(x)
        assert (expected < 0).any()
        torch.testing.assert_close(fused(x), expected)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[name], value)


def test_norm_layer_swap_keeps_the_model(device):
    # A model factory taking norm_layer (as torchvision's) builds the same model with FusedBatchNormAct2d.
    def model(norm_layer):
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), norm_layer(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), norm_layer(8, 1e-3, 0.01),
        ).to(device)

    reference, fused = model(nn.BatchNorm2d), model(FusedBatchNormAct2d)
    fused.load_state_dict(reference.state_dict())
    assert fused[4].eps == 1e-3 and fused[4].momentum == 0.01
    x = make_input((2, 3, 6, 6), torch.float32, device)
    torch.testing.assert_close(fused(x), reference(x))
    fused.eval(), reference.eval()
    torch.testing.assert_close(fused(x), reference(x))


def test_converters_add_no_activation_unasked(device):
    linear = nn.Linear(6, 4, device=device)
    x = make_input((3, 6), torch.float32, device)
    converted = FusedLinear.from_linear(linear)
    assert converted.act == "identity" and torch.equal(converted(x), linear(x))
    gelu = FusedLinear.from_linear(linear, act="gelu")
    assert FusedLinear.from_linear(gelu).act == "gelu"  # a fused layer keeps its activation
    leaky = FusedLinear.from_linear(linear, act="leaky_relu", negative_slope=0.3)
    again = FusedLinear.from_linear(leaky)
    assert (again.act, again.negative_slope) == ("leaky_relu", 0.3)
    torch.testing.assert_close(again(x), F.leaky_relu(linear(x), 0.3))

    bn = nn.BatchNorm2d(4).to(device).eval()
    xb = make_input((2, 4, 3, 3), torch.float32, device)
    converted_bn = FusedBatchNormAct2d.from_batchnorm(bn)
    assert converted_bn.act == "identity"
    torch.testing.assert_close(converted_bn(xb), bn(xb))
    silu = FusedBatchNormAct2d.from_batchnorm(bn, act="silu")
    assert FusedBatchNormAct2d.from_batchnorm(silu).act == "silu"
    assert FusedSyncBatchNormAct.from_batchnorm(silu).act == "silu"
    assert FusedSyncBatchNormAct.from_batchnorm(bn).act == "identity"

    bias = nn.Parameter(torch.randn(4, device=device))
    assert FusedBiasAct.from_bias(bias).act == "identity"
    torch.testing.assert_close(FusedBiasAct.from_bias(bias)(x[:, :4]), x[:, :4] + bias)
    for convert in (lambda: FusedLinear.from_linear(linear, "relu"), lambda: FusedBatchNormAct2d.from_batchnorm(bn, "relu")):
        with pytest.raises(TypeError):
            convert()  # act is keyword-only in converters too


# ------------------------------------------------------------------ item 11: SyncBatchNorm conversion


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = FusedBatchNormAct2d(channels, act="relu")
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = FusedBatchNormAct2d(channels, act="leaky_relu", negative_slope=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn1(self.conv1(x))
        return self.bn2(self.conv2(out), residual=x)  # leaky_relu(bn2(conv2(out)) + x)


def small_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), ResidualBlock(4), FusedAddAct("relu"),
        nn.Flatten(), FusedBatchNormAct1d(4 * 9, act="tanh"), FusedLinear(4 * 9, 5, act="gelu"),
    )


def run_small(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model[2](model[1](model[0](x)))
    h = model[3](h, h)
    return model[6](model[5](model[4](h)))


@pytest.mark.parametrize("convert", ["torch", "tfuse"])
def test_convert_sync_batchnorm_keeps_the_function(convert, backend, device):
    model = small_model().to(device)
    reference = copy.deepcopy(model)
    original_bn1d = model[5]
    converter = nn.SyncBatchNorm.convert_sync_batchnorm if convert == "torch" else convert_sync_batchnorm
    converted = converter(model)
    assert type(converted[1]) is nn.SyncBatchNorm  # torch's own layers: torch's conversion, unchanged
    block = converted[2]
    assert type(block.bn1) is FusedSyncBatchNormAct and block.bn1.act == "relu"
    assert (block.bn2.act, block.bn2.negative_slope) == ("leaky_relu", 0.2)
    assert type(converted[5]) is FusedSyncBatchNormAct and converted[5].act == "tanh"
    assert converted[5].weight is original_bn1d.weight and converted[5].running_mean is original_bn1d.running_mean
    # Outside a process group nothing is synchronised: the converted model computes what the model did,
    # residual form included (torch's conversion turned it into a TypeError).
    for training in (True, False):
        reference.train(training), converted.train(training)
        x = make_input((6, 3, 3, 3), torch.float32, device)
        torch.testing.assert_close(run_small(converted, x), run_small(reference, x))
    torch.testing.assert_close(converted[5].running_var, reference[5].running_var)
    # A fused layer alone comes back as a new layer, as torch returns a new SyncBatchNorm.
    lone = FusedBatchNormAct2d(3, act="gelu")
    assert type(converter(lone)) is FusedSyncBatchNormAct and converter(lone).act == "gelu"
    # Converting again keeps the activation (a FusedSyncBatchNormAct is a BatchNorm for torch too).
    twice = converter(converted)
    assert type(twice[5]) is FusedSyncBatchNormAct and twice[5].act == "tanh"


def test_sync_path_is_syncbatchnorm_then_residual_and_act(monkeypatch, device):
    # A real all-gather needs CUDA and NCCL; here nn.SyncBatchNorm.forward is stood in for by what it
    # returns for a single rank, to check what FusedSyncBatchNormAct builds on it when it synchronises.
    calls = []

    def one_rank_sync_forward(self, x):
        calls.append(x.shape)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, self.momentum, self.eps)

    layer = FusedSyncBatchNormAct(4, act="leaky_relu", negative_slope=0.2).to(device)
    reference = nn.BatchNorm2d(4).to(device)
    monkeypatch.setattr(FusedSyncBatchNormAct, "_synchronises", lambda self: True)
    monkeypatch.setattr(nn.SyncBatchNorm, "forward", one_rank_sync_forward)
    x = make_input((2, 4, 3, 3), torch.float32, device).requires_grad_()
    skip = make_input((2, 4, 3, 3), torch.float32, device).requires_grad_()
    y = layer(x, residual=skip)
    assert calls == [x.shape]
    x_ref, skip_ref = x.detach().clone().requires_grad_(), skip.detach().clone().requires_grad_()
    expected = F.leaky_relu(reference(x_ref) + skip_ref, 0.2)
    torch.testing.assert_close(y, expected)
    dy = torch.randn_like(y)
    y.backward(dy), expected.backward(dy)
    z = F.batch_norm(x.detach().double(), None, None, layer.weight.detach().double(), layer.bias.detach().double(),
                     training=True, eps=layer.eps).requires_grad_()
    (grad_out,) = torch.autograd.grad(F.leaky_relu(z + skip.detach().double(), 0.2), z, dy.double())
    assert_batch_norm_input_grad_accurate(x.grad, x, layer.weight, grad_out, layer.eps)  # float64, within its bound
    torch.testing.assert_close(skip.grad, skip_ref.grad)
    with pytest.raises(ValueError, match=r"residual must have x's shape \[2, 4, 3, 3\]"):
        layer(x, residual=skip[:1])


def _sync_layer_in_a_group(rank: int, world_size: int) -> dict:
    """On each gloo rank: converted layers in eval (no sync: fused) and in training (torch's sync path)."""
    torch.manual_seed(0)
    fused = FusedBatchNormAct2d(4, act="relu")
    with torch.no_grad():
        fused.running_mean.uniform_(-1, 1), fused.running_var.uniform_(0.5, 2)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(fused)).eval()
    x = torch.randn(2, 4, 3, 3)
    eval_close = torch.allclose(converted(x), F.relu(F.batch_norm(x, fused.running_mean, fused.running_var,
                                                                   fused.weight, fused.bias, False, 0.1, 1e-5)),
                                atol=1e-6)
    errors = []
    for layer in (converted.train(), nn.SyncBatchNorm(4).train()):
        try:
            layer(x)
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - compared across the two layers
            errors.append(f"{type(error).__name__}: {error}")
    return {"type": type(converted).__name__, "eval_close": eval_close, "errors": errors,
            "synchronises": converted.train()._synchronises() and not converted.eval()._synchronises()}


def test_sync_layer_in_a_real_process_group():
    # Two gloo ranks: eval needs no synchronisation (fused kernels); training synchronises through
    # nn.SyncBatchNorm's forward, which on CPU tensors raises torch's own error, as nn.SyncBatchNorm does.
    for result in run_world(_sync_layer_in_a_group, 2, timeout=180):
        value = result.unwrap()
        assert value["type"] == "FusedSyncBatchNormAct" and value["eval_close"] and value["synchronises"]
        ours, torchs = value["errors"]
        assert ours is not None and ours == torchs


# ------------------------------------------------------------------ item 11: torch.fx


class TracedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn_relu = FusedBatchNormAct2d(4, act="relu")
        self.bn_res = FusedBatchNormAct2d(4, act="silu")
        self.add = FusedAdd()
        self.add_act = FusedAddAct("tanh")
        self.bias_act = FusedBiasAct(4, act="gelu", dim=1)
        self.flatten = nn.Flatten()
        self.bn1d = FusedBatchNormAct1d(36, act="leaky_relu", negative_slope=0.1)
        self.head = FusedLinear(36, 5)
        self.hidden = FusedLinear(36, 36, act="relu")

    def forward(self, x):  # unannotated: fx cannot pickle the string annotations of ``from __future__ import annotations``
        h = self.bn_relu(self.conv(x))
        h = self.bn_res(h, residual=h * 0.5)  # the residual form, as a keyword
        h = self.bn_res(h, h)                 # and positionally
        h = self.add_act(self.add(h, x[:, :1], h), h)
        h = self.bias_act(h)
        h = self.bn1d(self.flatten(h))
        return self.head(self.hidden(h))


def test_symbolic_trace_computes_the_same(backend, device):
    model = TracedNet().to(device)
    traced = fx.symbolic_trace(model)
    leaves = {node.target for node in traced.graph.nodes if node.op == "call_module"}
    assert {"bn_relu", "bn_res", "add", "add_act", "bias_act", "bn1d", "head", "hidden"} <= leaves
    assert sum(node.target == "bn_res" for node in traced.graph.nodes) == 2
    twin = copy.deepcopy(model)
    for training in (True, False):
        twin.train(training), traced.train(training)  # the graph calls the modules: the mode stays live
        x = make_input((3, 3, 3, 3), torch.float32, device)
        torch.testing.assert_close(traced(x), twin(x))
    torch.testing.assert_close(traced.bn_res.running_mean, twin.bn_res.running_mean)
    assert traced.bn_res.num_batches_tracked.item() == 2  # one training call of traced: two bn_res calls
    x = make_input((3, 3, 3, 3), torch.float32, device).requires_grad_()
    traced.train()(x).sum().backward()
    assert x.grad is not None and traced.hidden.weight.grad is not None


def test_fx_graph_module_round_trips(device):
    traced = fx.symbolic_trace(TracedNet().to(device).eval())
    x = make_input((2, 3, 3, 3), torch.float32, device)
    buffer = io.BytesIO()
    torch.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), traced(x))
    assert "FusedBatchNormAct2d" in type(loaded.bn_relu).__name__


@pytest.mark.parametrize("module, args", [
    (FusedBatchNormAct2d(3, act="relu"), ((2, 3, 2, 2),)),
    (FusedLinear(3, 4, act="relu"), ((2, 3),)),
    (FusedBiasAct(3, act="relu"), ((2, 3),)),
])  # (FusedAdd and FusedAddAct take *tensors, which fx cannot trace at the root of any module)
def test_tracing_a_tfuse_module_alone_is_a_clear_error(module, args):
    with pytest.raises(TypeError, match=r"traced as a leaf module .* trace a model that contains it"):
        fx.symbolic_trace(module)
    traced = fx.symbolic_trace(nn.Sequential(module))
    x = torch.randn(args[0])
    torch.testing.assert_close(traced(x), module(x))


# ------------------------------------------------------------------ item 12: copies and saving


def all_modules(device: torch.device) -> list[tuple[nn.Module, tuple]]:
    x4 = make_input((3, 4, 2, 3), torch.float32, device)
    return [
        (FusedAdd(), (x4, x4)),
        (FusedAddAct("leaky_relu", negative_slope=0.3), (x4, x4)),
        (FusedBiasAct(4, act="silu", dim=1, device=device), (x4,)),
        (FusedLinear(3, 5, act="gelu", device=device), (x4[:, 0],)),
        (FusedBatchNormAct2d(4, act="relu", momentum=None).to(device), (x4, x4)),
        (FusedBatchNormAct1d(4, act="tanh", bias=False).to(device), (x4[:, :, 0],)),
        (FusedSyncBatchNormAct(4, act="sigmoid").to(device), (x4,)),
    ]


def test_deepcopy_pickle_and_torch_save_give_independent_equal_copies(device):
    for module, args in all_modules(device):
        module.train()
        module(*args)  # some training state (running statistics) first
        module.eval()
        expected = module(*args)
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        copies = {
            "deepcopy": copy.deepcopy(module),
            "pickle": pickle.loads(pickle.dumps(module)),
            "torch.save": torch.load(buffer, weights_only=False),
        }
        for how, other in copies.items():
            name = f"{type(module).__name__} via {how}"
            assert type(other) is type(module) and repr(other) == repr(module), name
            torch.testing.assert_close(other(*args), expected, msg=name)
            for (key, a), b in zip(module.state_dict().items(), other.state_dict().values()):
                assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), f"{name}: {key} shared or differs"
            with torch.no_grad():
                for tensor in other.state_dict().values():
                    if tensor.is_floating_point():
                        tensor.add_(1.0)
            if other.state_dict():
                torch.testing.assert_close(module(*args), expected, msg=f"{name}: the copy is not independent")


# ------------------------------------------------------------------ item 13: reprs and no-effect arguments


def test_reprs_name_the_activation():
    assert repr(FusedAddAct("gelu")) == "FusedAddAct(act='gelu')"
    assert repr(FusedAddAct("leaky_relu", negative_slope=0.2)) == "FusedAddAct(act='leaky_relu', negative_slope=0.2)"
    assert repr(FusedBiasAct(3, "silu", dim=1)) == "FusedBiasAct(3, act='silu', dim=1)"
    assert repr(FusedLinear(2, 3, act="tanh")) == "FusedLinear(in_features=2, out_features=3, bias=True, act='tanh')"
    assert repr(FusedLinear(2, 3)).endswith("act='identity')")
    assert repr(FusedBatchNormAct2d(4, act="leaky_relu")).endswith(
        "track_running_stats=True, act='leaky_relu', negative_slope=0.01)"
    )
    assert repr(FusedSyncBatchNormAct(4, act="relu")).endswith("act='relu')")


@pytest.mark.parametrize("make", [
    lambda **kw: FusedAddAct("relu", **kw),
    lambda **kw: FusedBiasAct(3, **kw),
    lambda **kw: FusedLinear(2, 3, act="gelu", **kw),
    lambda **kw: FusedLinear(2, 3, **kw),
    lambda **kw: FusedBatchNormAct2d(3, act="relu", **kw),
    lambda **kw: FusedBatchNormAct1d(3, **kw),
    lambda **kw: FusedSyncBatchNormAct(3, act="silu", **kw),
    lambda **kw: FusedLinear.from_linear(nn.Linear(2, 3), act="relu", **kw),
    lambda **kw: FusedLinear.from_linear(nn.Linear(2, 3), **kw),
    lambda **kw: FusedBatchNormAct2d.from_batchnorm(nn.BatchNorm2d(3), **kw),
    lambda **kw: FusedBiasAct.from_bias(torch.zeros(3), act="tanh", **kw),
])
def test_negative_slope_without_leaky_relu_is_an_error(make):
    with pytest.raises(ValueError, match=r"negative_slope=0\.2 .*leaky_relu"):
        make(negative_slope=0.2)
    make()  # without it: fine


def test_negative_slope_defaults_to_torchs_and_is_used(device):
    assert FusedAddAct("leaky_relu").negative_slope == 0.01 == nn.LeakyReLU().negative_slope
    x = make_input((4, 6), torch.float32, device)
    torch.testing.assert_close(FusedAddAct("leaky_relu", negative_slope=0.25)(x, x), F.leaky_relu(2 * x, 0.25))
    layer = FusedLinear(6, 6, act="leaky_relu", negative_slope=0.25, device=device)
    torch.testing.assert_close(layer(x), F.leaky_relu(F.linear(x, layer.weight, layer.bias), 0.25))
    with pytest.raises(ValueError, match=r"negative_slope must be finite"):
        FusedLinear(2, 3, act="leaky_relu", negative_slope=float("nan"))
    with pytest.raises(ValueError, match=r"unknown activation 'swish'"):
        FusedBatchNormAct2d(3, act="swish")
