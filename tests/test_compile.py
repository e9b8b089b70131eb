"""tfuse under torch.compile and CUDA graphs: the registered ops, compiled models, capturable optimizers.

On CPU: every ``torch.ops.tfuse`` op passes ``torch.library.opcheck`` (schema,
fake tensors, autograd registration, AOT dispatch); a model of tfuse layers
compiles with ``fullgraph=True``, no graph break, and gives eager tfuse's
outputs, gradients and running statistics; the optimizers' step runs inside
compiled functions; ``capturable=True`` steps follow torch.optim's and read
nothing on the host. On CUDA (when a GPU is present) a whole training step is
captured in a CUDA graph and replayed, bit for bit equal to eager steps.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.library import opcheck

import tfuse

from optim_helpers import make_pair, run_side_by_side
from tfuse.ops._activations import Activation
from optim_references import ReferenceLAMB, ReferenceLARS, ReferenceLion, ReferenceMuon
from tfuse.optim import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, FusedLion, FusedMomentum, FusedMuon,
                         FusedSGD)
from tfuse.optim._update import _ADAM_BC2_SQRT, _ADAM_BETA1, _ADAM_BETA2, _ADAM_DECAY, _ADAM_STEP_SIZE, _SGD_LR

ON_CUDA = torch.cuda.is_available()
OPCHECK_OK = {"test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"}


def assert_opcheck(op, args) -> None:
    result = opcheck(op, args)
    assert set(result) == OPCHECK_OK and all(v == "SUCCESS" for v in result.values()), result


@pytest.fixture(autouse=True, scope="module")
def _registered_ops():
    """The tests below call torch.ops.tfuse.* directly: register them (this imports torch._dynamo, seconds of
    CPU, so it happens when this file's tests run, not when every worker collects it)."""
    tfuse.ops.register_library()


# ---------------------------------------------------------------------------- the registered ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_op_passes_opcheck(device, dtype):
    shapes = [(3, 4), (4,), (1, 4)]
    for grad in (False, True):
        args = [torch.randn(s, device=device, dtype=dtype, requires_grad=grad) for s in shapes]
        assert_opcheck(torch.ops.tfuse.add.default, (args,))
    mixed = [torch.randn(2, 3, device=device, dtype=dtype), torch.randn(2, 3, device=device)]
    assert_opcheck(torch.ops.tfuse.add.default, (mixed,))


@pytest.mark.parametrize("act,slope", [("relu", 0.01), ("gelu", 0.01), ("leaky_relu", -0.2), ("identity", 0.01),
                                       ("tanh", 0.01), ("silu", 0.01)])
def test_add_act_ops_pass_opcheck(device, act, slope):
    code = int(Activation.from_name(act))
    cases = [
        [torch.randn(3, 4, device=device, requires_grad=True), torch.randn(4, device=device, requires_grad=True)],
        [torch.randn(2, 3, 4, device=device, requires_grad=True)] * 1
        + [torch.randn(2, 3, 4, device=device, requires_grad=True)],  # x and a residual: one shared gradient
        [torch.randn(2, 3, dtype=torch.bfloat16, device=device, requires_grad=True)],
    ]
    for tensors in cases:
        assert_opcheck(torch.ops.tfuse.add_act.default, (tensors, code, slope))
    # The backward op on its own, with what the forward saves for this activation.
    x, bias = torch.randn(3, 4, device=device), torch.randn(4, device=device)
    y = torch.ops.tfuse.add_act([x, bias], code, slope)
    source = Activation(code).grad_source(slope).value
    saved = {"none": [], "output": [y], "input": [x, bias]}[source]
    args = (torch.randn(3, 4, device=device), saved, code, slope, [3, 4], [4, 1], [3, 4, 4], [2, 1], [2, 2],
            [True, True])
    assert_opcheck(torch.ops.tfuse.add_act_backward.default, args)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("residual", [False, True])
def test_batch_norm_act_ops_pass_opcheck_and_match_torch(device, training, act, residual):
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.rand(3, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, device=device, requires_grad=True)
    skip = torch.randn_like(x, requires_grad=True) if residual else None
    mean = torch.randn(3, dtype=torch.float64, device=device)
    var = torch.rand(3, dtype=torch.float64, device=device) + 0.5
    args = (x, weight, bias, skip, mean, var, training, 0.1, 1e-5, int(Activation.from_name(act)), 0.01)
    assert_opcheck(torch.ops.tfuse.batch_norm_act.default, args)

    y, _, new_mean, new_var = torch.ops.tfuse.batch_norm_act(*args)
    ref_mean, ref_var = mean.clone(), var.clone()
    ref = nn.functional.batch_norm(x, ref_mean, ref_var, weight, bias, training, 0.1, 1e-5)
    ref = ref + skip if residual else ref
    ref = torch.relu(ref) if act == "relu" else nn.functional.gelu(ref)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    if training:  # new running statistics are returned; the inputs are left as they were
        torch.testing.assert_close(new_mean, ref_mean, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(new_var, ref_var, rtol=1e-12, atol=1e-14)
    inputs = [t for t in (x, weight, bias, skip) if t is not None]
    dy = torch.randn_like(ref)
    for ours, theirs in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(ref, inputs, dy)):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_the_ops_keep_their_outputs_apart_from_their_inputs(device):
    """An op's output never aliases an input (the dispatcher's rule): identity's gradient is dy itself."""
    dy = torch.randn(3, 4, device=device)
    code = int(Activation.IDENTITY)
    (grad,) = torch.ops.tfuse.add_act_backward(dy, [], code, 0.01, [3, 4], [4, 1], [3, 4], [2], [2], [True])
    assert grad.untyped_storage().data_ptr() != dy.untyped_storage().data_ptr()
    torch.testing.assert_close(grad, dy)


# ---------------------------------------------------------------------------- compiled models


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = tfuse.nn.FusedBatchNormAct2d(8, act="relu")
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = tfuse.nn.FusedBatchNormAct2d(8, act="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), residual=x)


class Net(nn.Module):
    """A residual CNN block and an MLP head, every tfuse layer in it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block()
        self.fc1 = tfuse.nn.FusedLinear(8, 16, act="gelu")
        self.act = tfuse.nn.FusedBiasAct(16, act="silu")
        self.add = tfuse.nn.FusedAdd()
        self.add_act = tfuse.nn.FusedAddAct("tanh")
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.stem(x)).mean((2, 3))
        h = self.fc1(h)
        h = self.add_act(self.add(h, self.act(h), h), h)
        return self.fc2(h)


def test_a_model_of_tfuse_layers_compiles_without_a_graph_break(device):
    import torch._dynamo

    model = Net().to(device)
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 8, 8, device=device))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1
    targets = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    ops = {name.split(".")[1] for name in targets if name.startswith("tfuse.")}
    assert ops == {"add", "add_act", "batch_norm_act"}, targets


@pytest.mark.parametrize("train", [True, False])
def test_compiled_model_equals_eager_tfuse(device, train):
    torch.manual_seed(0)
    eager = Net().to(device).train(train)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=False)
    for _ in range(2):  # the second call runs the cached graph; running statistics advance twice
        x = torch.randn(4, 3, 8, 8, device=device)
        expected, actual = eager(x), compiled(x)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        dy = torch.randn_like(expected)
        expected.backward(dy)
        actual.backward(dy)
    for (name, ours), theirs in zip(compiled_model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for (name, ours), theirs in zip(compiled_model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if train:
        assert int(compiled_model.block.bn1.num_batches_tracked) == 2


def test_compiled_inplace_add_act_writes_into_x(device):
    def f(x, bias):
        y = x * 2
        return tfuse.add_act(y, bias, act="relu", inplace=True), y

    x, bias = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    out, y = torch.compile(f, fullgraph=True)(x, bias)
    torch.testing.assert_close(out, torch.relu(x * 2 + bias))
    torch.testing.assert_close(y, out)  # y was written in place, as in eager


def test_double_backward_through_a_compiled_op(device):
    x = torch.randn(5, 6, device=device, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, device=device, dtype=torch.float64, requires_grad=True)

    def penalty(x, bias):
        y = torch.ops.tfuse.add_act([x, bias], int(Activation.GELU), 0.01)
        (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return grad.square().sum()

    def reference(x, bias):
        y = nn.functional.gelu(x + bias)
        (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return grad.square().sum()

    ours = torch.autograd.grad(penalty(x, bias), (x, bias))
    theirs = torch.autograd.grad(reference(x, bias), (x, bias))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_optimizer_step_inside_a_compiled_function(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), tfuse.nn.FusedBiasAct(16, act="gelu"), nn.Linear(16, 4)).to(device)
    reference = copy.deepcopy(model)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    compiled_model = torch.compile(model, fullgraph=True)

    @torch.compile
    def train_step(x):
        optimizer.zero_grad()
        compiled_model(x).square().sum().backward()
        optimizer.step()

    for _ in range(3):
        x = torch.randn(5, 8, device=device)
        train_step(x)
        torch_optimizer.zero_grad()
        reference(x).square().sum().backward()
        torch_optimizer.step()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- capturable optimizers


CAPTURABLE_CASES = [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (FusedMomentum, torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.2)),
    (FusedLion, ReferenceLion, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, maximize=True)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.1)),
    (FusedLAMB, ReferenceLAMB, dict(lr=1e-2, weight_decay=0.1, trust_clip=True)),
    (FusedLARS, ReferenceLARS, dict(lr=0.5, weight_decay=0.01, nesterov=True)),
    (FusedMuon, ReferenceMuon, dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2)),
]
# The tests below take every other case, plus Lion (whose PyTorch path is torch's foreach ops, not a fused kernel)
# and LAMB (three launches, and whole parameters on the PyTorch path), and Muon (its iterations between two
# launches, its AdamW groups); LARS is among every other case.
SOME_CAPTURABLE_CASES = CAPTURABLE_CASES[::2] + [CAPTURABLE_CASES[5], CAPTURABLE_CASES[7], CAPTURABLE_CASES[9]]


def case_id(value):
    return value.__name__ if isinstance(value, type) else None


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("fused_cls,torch_cls,options", CAPTURABLE_CASES, ids=case_id)
def test_capturable_steps_follow_torch_optim(fused_cls, torch_cls, options, backend, device):
    """Parameters that skip steps (an auxiliary head every other step) keep their own device step counts;
    both paths (the kernel with its device-side table, torch's fused kernels with tensor lr and steps)."""
    model, reference = make_pair(device, torch.float64)
    fused = fused_cls(model.parameters(), **options, capturable=True)
    torch_opt = torch_cls(reference.parameters(), **options)
    with tfuse.use_backend(backend):
        run_side_by_side(model, reference, fused, torch_opt, 5, device, torch.float64)
    if fused.family.uses_step:
        steps = [fused.state[p]["step"] for p in model.parameters()]
        assert all(step.device == device for step in steps)  # on the parameters' device, like torch's capturable


@pytest.mark.parametrize("fused_cls,torch_cls,options", SOME_CAPTURABLE_CASES, ids=case_id)
def test_capturable_tensor_lr_changes_are_read_on_the_device(fused_cls, torch_cls, options, device):
    model, reference = make_pair(device, torch.float64)
    lr = torch.tensor(options["lr"], dtype=torch.float64, device=device)
    fused = fused_cls(model.parameters(), **{**options, "lr": lr}, capturable=True)
    torch_opt = torch_cls(reference.parameters(), **options)

    def schedule(step):
        if step == 2:  # a scheduler's change, copied into the tensor the step reads
            lr.fill_(options["lr"] / 4)
            torch_opt.param_groups[0]["lr"] = options["lr"] / 4

    run_side_by_side(model, reference, fused, torch_opt, 5, device, torch.float64, before_step=schedule)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("fused_cls,torch_cls,options", SOME_CAPTURABLE_CASES, ids=case_id)
def test_grad_scaler_skip_on_found_inf(fused_cls, torch_cls, options, capturable, backend, device):
    """A step with found_inf set changes nothing (parameters, state, step counts, gradients);
    the next step continues as torch's does. Both paths: the kernel masks the step, the PyTorch path's
    calls skip it (torch's fused kernels, or the foreach maths selecting the old values on the device)."""
    if backend == "torch" and not capturable:
        # Not a gap: with capturable=False, step() reads found_inf on the host and returns before choosing a
        # backend, so this combination would run exactly the code of backend="auto" (which runs above).
        pytest.skip("the host-side skip (capturable=False) reads found_inf before any path runs: 'auto' covers it")  # (one backend's run covers it)
    with tfuse.use_backend(backend):
        _grad_scaler_skip_on_found_inf(fused_cls, torch_cls, options, capturable, device)


def _grad_scaler_skip_on_found_inf(fused_cls, torch_cls, options, capturable, device):
    model, reference = make_pair(device, torch.float64)
    fused = fused_cls(model.parameters(), **options, capturable=capturable)
    torch_opt = torch_cls(reference.parameters(), **options)
    run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float64)
    for param in model.parameters():
        param.grad = torch.full_like(param, float("nan"))
    before = copy.deepcopy((list(model.parameters()), fused.state_dict()))
    fused.grad_scale = torch.tensor(4.0, device=device)
    fused.found_inf = torch.tensor(1.0, device=device)
    fused.step()
    del fused.grad_scale, fused.found_inf
    for ours, theirs in zip(model.parameters(), before[0]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert torch.isnan(ours.grad).all()  # not unscaled either
    for index, entry in fused.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(value, before[1]["state"][index][key], rtol=0, atol=0)
    run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float64)


@contextlib.contextmanager
def no_host_reads(allowed: tuple[str, ...] = ()):
    """Fails on any read of a tensor's value by the host: what would be a device sync on a GPU."""
    names = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names if name not in allowed}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"the host read a tensor's value (Tensor.{name}) inside the step")

        return method

    for name in originals:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("fused_cls,torch_cls,options", SOME_CAPTURABLE_CASES, ids=case_id)
def test_capturable_step_reads_nothing_on_the_host(fused_cls, torch_cls, options, device):
    model, reference = make_pair(device)
    lr = torch.tensor(options["lr"], device=device)
    optimizer = fused_cls(model.parameters(), **{**options, "lr": lr}, capturable=True)
    for step in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 5, device=device), use_aux=True).square().sum().backward()
        if step == 0:
            optimizer.step()  # the first step sets up (state, tables); later ones must be pure device work
            continue
        optimizer.grad_scale = torch.tensor(2.0, device=device)
        optimizer.found_inf = torch.tensor(0.0, device=device)
        with no_host_reads():
            optimizer.step()
            tfuse.optim.clip_grad_norm_(optimizer, 1.0)
        del optimizer.grad_scale, optimizer.found_inf


def test_non_capturable_step_reads_only_its_own_host_step_counts(device):
    """Without capturable and without AMP, the step reads no device value: the step counts it reads
    (numpy) are host tensors by design; the coefficient table goes to the device from pinned memory."""
    model, _ = make_pair(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 5, device=device), use_aux=True).square().sum().backward()
        with no_host_reads(allowed=("numpy",)):
            optimizer.step()


def test_capturable_state_dict_round_trips_with_torchs_capturable(device):
    model, reference = make_pair(device)
    fused = FusedAdam(model.parameters(), lr=1e-2, capturable=True)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)
    again = FusedAdam(copy.deepcopy(model).parameters(), lr=1e-2, capturable=True)
    again.load_state_dict(fused.state_dict())
    assert [float(again.state[p]["step"]) for p in again.param_groups[0]["params"]] == [
        float(fused.state[p]["step"]) for p in fused.param_groups[0]["params"]
    ]
    copied = copy.deepcopy(fused)
    assert copied.capturable and all(s["step"].device == device for s in copied.state.values() if "step" in s)


def test_capturable_must_agree_across_groups(device):
    model, _ = make_pair(device)
    optimizer = FusedAdam([model.first.weight], lr=1e-2, capturable=True)
    with pytest.raises(ValueError, match="capturable=False .* capturable=True"):
        optimizer.add_param_group({"params": [model.first.bias], "capturable": False})
    with pytest.raises(TypeError, match="capturable must be a bool"):
        FusedSGD(model.parameters(), lr=0.1, capturable="yes")


def test_coefficient_columns_match_the_kernels():
    from tfuse import kernels

    optim = kernels.optim
    assert (_ADAM_STEP_SIZE, _ADAM_BETA1, _ADAM_BETA2, _ADAM_DECAY, _ADAM_BC2_SQRT) == (
        optim.ADAM_STEP_SIZE.value, optim.ADAM_BETA1.value, optim.ADAM_BETA2.value, optim.ADAM_DECAY.value,
        optim.ADAM_BC2_SQRT.value,
    )
    assert _SGD_LR == optim.SGD_LR.value


# ---------------------------------------------------------------------------- CUDA graphs (GPU only)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fused_cls,options", [(FusedAdam, dict(weight_decay=0.01)), (FusedSGD, dict(momentum=0.9))],
                         ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_cuda_graph_of_a_whole_training_step_equals_eager(fused_cls, options):
    """Forward, backward, clipping and the capturable step captured once and replayed: bit for bit the
    eager steps, across an lr change copied into the lr tensor, with no host sync inside the step."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    # Layers with deterministic kernels only (tfuse's reductions have fixed grids; cuBLAS GEMMs on one stream):
    # bit-for-bit equality then measures the graph, not run-to-run nondeterminism (cuDNN's conv backward has some).
    base = nn.Sequential(
        nn.Linear(32, 64), tfuse.nn.FusedBatchNormAct1d(64, act="relu"), tfuse.nn.FusedLinear(64, 64, act="gelu"),
        tfuse.nn.FusedBiasAct(64, act="silu"), nn.Linear(64, 10),
    ).to(device)
    inputs = [torch.randn(16, 32, device=device) for _ in range(6)]

    def build():
        model = copy.deepcopy(base)
        lr = torch.tensor(1e-2, device=device)
        return model, lr, fused_cls(model.parameters(), lr=lr, capturable=True, **options)

    def step(model, optimizer, x):
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        tfuse.optim.clip_grad_norm_(optimizer, 1.0)
        optimizer.step()

    eager_model, eager_lr, eager_opt = build()
    graph_model, graph_lr, graph_opt = build()
    static_x = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs[:2]:  # warm-up: Triton compiles, tables are built, state is created
            static_x.copy_(x)
            step(graph_model, graph_opt, static_x)
            step(eager_model, eager_opt, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_model, graph_opt, static_x)
    torch.cuda.set_sync_debug_mode("error")  # neither the replay nor the eager capturable step may sync
    try:
        for index, x in enumerate(inputs[2:]):
            if index == 2:  # a scheduler's change, copied into the lr tensors
                graph_lr.fill_(5e-3)
                eager_lr.fill_(5e-3)
            static_x.copy_(x)
            graph.replay()
            step(eager_model, eager_opt, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for (name, ours), theirs in zip(graph_model.named_parameters(), eager_model.parameters()):
        assert torch.equal(ours, theirs), name
