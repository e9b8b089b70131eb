"""Parameters whose storage is replaced after coalescing, and memory formats kept by coalescing.

Every way of replacing a parameter's storage that the issue lists is run end to end with
FusedMomentum and FusedAdam on both backends, against torch.optim on an uncoalesced copy
of the model that goes through the same replacement: the ones FlatParams can follow must
train exactly like torch.optim, the others must raise a clear error before anything is
updated (never train silently wrong, never fail with an unrelated message).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tfuse
from tfuse.flat import FlatParams, flat_params_of
from tfuse.optim import FusedAdam, FusedMomentum, FusedSGD

TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64 on both sides
PAIRS = [
    (FusedMomentum, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
]
PAIR_IDS = ["momentum", "adam"]
BACKENDS = ["triton", "torch"]


class ConvNet(nn.Module):
    """4-D convolution weights, biases, a square matrix and a vector shaped like a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.mix = nn.Conv2d(6, 5, 1)
        self.square = nn.Linear(5, 5)
        self.gate = nn.Parameter(torch.rand(5) + 0.5)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.mix(torch.tanh(self.conv(x))).mean(dim=(2, 3))
        return self.head(torch.tanh(self.square(hidden)) * self.gate)


def make_models(device, channels_last: bool = False) -> tuple[ConvNet, ConvNet]:
    model = ConvNet().to(device=device, dtype=torch.float64)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, copy.deepcopy(model)


def inputs(device, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, device=device, dtype=dtype)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def in_flat_buffer(param: torch.Tensor) -> bool:
    owner = flat_params_of(param)
    if owner is None:
        return False
    for buffer in owner.param_buffers:
        start = buffer.data_ptr()
        if start <= param.data_ptr() < start + buffer.numel() * buffer.element_size():
            return True
    return False


def assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------- memory formats kept


def test_coalescing_keeps_each_parameters_memory_format_and_gradients_follow_it(device):
    conv = nn.Conv2d(3, 8, 3).to(device).to(memory_format=torch.channels_last)
    matrix = nn.Parameter(torch.randn(6, 4, device=device).t())  # a transposed (column-major) 2-D parameter
    loose = nn.Parameter(torch.randn(5, 9, device=device)[:, ::2])  # not dense: gets the contiguous layout
    reference = [p.detach().clone().requires_grad_() for p in (conv.weight, conv.bias, matrix, loose)]
    strides = [conv.weight.stride(), conv.bias.stride(), matrix.stride()]
    flat = FlatParams([conv.weight, conv.bias, matrix, loose])
    assert [conv.weight.stride(), conv.bias.stride(), matrix.stride()] == strides
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert loose.is_contiguous()
    (group,) = flat.groups
    for index, param in enumerate(group.params):
        assert in_flat_buffer(param)
        view = group.slot(group.data, index)
        assert view.data_ptr() == param.data_ptr() and view.stride() == param.stride()
    for param, theirs in zip((conv.weight, conv.bias, matrix, loose), reference):
        torch.testing.assert_close(param, theirs, rtol=0, atol=0)

    def loss(weight, bias, m, extra):
        x = torch.randn(2, 3, 5, 5, device=device, generator=torch.Generator(device).manual_seed(0))
        out = torch.nn.functional.conv2d(x, weight, bias).sum(dim=(2, 3))
        return (out[:, :4] @ m).pow(2).sum() + (extra * extra.sum()).sum()

    loss(conv.weight, conv.bias, matrix, loose).backward()
    loss(*reference).backward()
    for param, theirs in zip((conv.weight, conv.bias, matrix, loose), reference):
        assert param.grad.stride() == param.stride()  # the gradient view has the parameter's layout
        assert param.grad.data_ptr() == flat.grad_view(param).data_ptr()
        torch.testing.assert_close(param.grad, theirs.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_a_channels_last_model_stays_channels_last_and_trains_like_torch_optim(pair, backend, device):
    fused_cls, torch_cls, options = pair
    model, reference = make_models(device, channels_last=True)
    fused = fused_cls(model.parameters(), **options)
    torch_opt = torch_cls(reference.parameters(), **options)
    with tfuse.use_backend(backend):
        for _ in range(4):
            x = inputs(device).to(memory_format=torch.channels_last)
            train_step(model, fused, x)
            train_step(reference, torch_opt, x)
    assert_same_params(model, reference)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert mine.stride() == theirs.stride() and mine.grad.stride() == theirs.stride()
        assert in_flat_buffer(mine)
        # The optimizer state pairs element by element with the parameter, as torch's does.
        for key, value in torch_opt.state[theirs].items():
            if key != "step":
                torch.testing.assert_close(fused.state[mine][key], value, **TIGHT)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_master_weights_of_a_channels_last_bfloat16_model_follow_a_float32_run(device):
    model, reference = make_models(device, channels_last=True)
    reference = reference.float()
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            theirs.copy_(mine.float())
    fused = FusedSGD(model.parameters(), lr=0.05, momentum=0.9, master_weights=True)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = inputs(device, torch.bfloat16).contiguous(memory_format=torch.channels_last)
        fused.zero_grad()
        model(x).pow(2).mean().backward()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            theirs.grad = mine.grad.float()  # same gradients: this compares the updates
        fused.step()
        torch_opt.step()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        master = fused.state[mine]["master_param"]
        torch.testing.assert_close(master, theirs.detach(), rtol=2e-6, atol=2e-7)
        torch.testing.assert_close(mine.detach(), master.to(torch.bfloat16), rtol=0, atol=0)


# --------------------------------------------------------------------------- replacements FlatParams follows


def _assign_new_values(model, reference, device):
    values = torch.randn_like(model.conv.weight)
    model.conv.weight.data = values.clone(memory_format=torch.preserve_format)
    reference.conv.weight.data = values.clone(memory_format=torch.preserve_format)


def _assign_strided_values(model, reference, device):
    # The new tensor is not dense (every other element of a bigger one): values count, layout does not.
    shape = model.square.weight.shape
    big = torch.randn(shape[0], 2 * shape[1], device=device, dtype=torch.float64)
    model.square.weight.data = big[:, ::2]
    reference.square.weight.data = big.clone()[:, ::2]


def _to_empty_same_device(model, reference, device):
    model.to_empty(device=device)
    reference.to_empty(device=device)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            values = torch.randn_like(theirs)
            mine.copy_(values)
            theirs.copy_(values)


def _load_state_dict_after_to_empty(model, reference, device):
    snapshot = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    for net in (model, reference):
        net.to_empty(device=device)
        net.load_state_dict(snapshot)


FOLLOWED = {
    "data_assign": (_assign_new_values, False),
    "data_assign_channels_last": (_assign_new_values, True),
    "data_assign_not_dense": (_assign_strided_values, False),
    "to_empty_same_device": (_to_empty_same_device, False),
    "to_empty_then_load_state_dict": (_load_state_dict_after_to_empty, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("how", list(FOLLOWED))
def test_replaced_storage_is_taken_back_and_training_follows_torch_optim(how, pair, backend, device):
    """The live parameter keeps training, the optimizer keeps its state, exactly like torch.optim."""
    replace, channels_last = FOLLOWED[how]
    fused_cls, torch_cls, options = pair
    model, reference = make_models(device, channels_last)
    fused = fused_cls(model.parameters(), **options)
    torch_opt = torch_cls(reference.parameters(), **options)
    flat = flat_params_of(model.conv.weight)
    version = flat.layout_version
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with tfuse.use_backend(backend):
        for _ in range(2):
            x = inputs(device).contiguous(memory_format=fmt)
            train_step(model, fused, x)
            train_step(reference, torch_opt, x)
        replace(model, reference, device)
        replaced = {name: p.detach().clone() for name, p in model.named_parameters()}
        assert not all(in_flat_buffer(p) for p in model.parameters())  # the replacement really left the buffer
        for _ in range(3):
            x = inputs(device).contiguous(memory_format=fmt)
            train_step(model, fused, x)
            train_step(reference, torch_opt, x)
    assert_same_params(model, reference)  # state kept: a reset momentum / Adam moment would diverge
    for name, param in model.named_parameters():
        assert in_flat_buffer(param), name
        assert flat_params_of(param) is flat
        assert not torch.equal(param.detach(), replaced[name]), f"{name} stopped training"
        theirs = dict(reference.named_parameters())[name]
        assert param.stride() == torch.empty_like(theirs).stride()  # their memory format (dense)
    assert flat.layout_version == version  # re-homed in place: offsets and optimizer state did not move


# --------------------------------------------------------------------------- replacements FlatParams refuses


def _dtype_change(dtype):
    def change(model, device):
        model.to(dtype)

    return change


def _channels_last(model, device):
    model.to(memory_format=torch.channels_last)


def _other_shape(model, device):
    model.head.bias.data = torch.zeros(1, device=device, dtype=torch.float64)  # still broadcasts in forward


def _transposed_in_place(model, device):
    model.square.weight.data = model.square.weight.data.t()  # same memory, other strides


def _tied_through_data(model, device):
    model.gate.data = model.square.bias.data


REFUSED = {
    "double": (_dtype_change(torch.float64), torch.float32, r"changed dtype from torch\.float32 to torch\.float64.*"
               r"model\.double\(\).*Convert the model first"),
    "half": (_dtype_change(torch.float16), torch.float64, r"changed dtype from torch\.float64 to torch\.float16.*"
             r"Convert the model first"),
    "bfloat16": (_dtype_change(torch.bfloat16), torch.float64, r"changed dtype from torch\.float64 to torch\.bfloat16"),
    "channels_last": (_channels_last, torch.float64, r"'?parameter \d+ \(shape \(6, 3, 3, 3\)\)'? changed memory layout "
                      r"from strides \(27, 9, 3, 1\) to \(27, 1, 9, 3\).*channels_last.*Convert the memory format first"),
    "other_shape": (_other_shape, torch.float64, r"changed shape from \(4,\) to \(1,\)"),
    "transposed_in_place": (_transposed_in_place, torch.float64, r"changed memory layout from strides \(5, 1\) to \(1, 5\)"),
    "tied_through_data": (_tied_through_data, torch.float64, r"now shares memory with parameter \d+ \(shape \(5,\)\).*"
                          r"assign the Parameter itself"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("how", list(REFUSED))
def test_replacements_the_flat_buffers_cannot_follow_raise_before_any_update(how, pair, backend, device):
    change, dtype, message = REFUSED[how]
    fused_cls, _, options = pair
    model = ConvNet().to(device=device, dtype=dtype)
    fused = fused_cls(model.parameters(), **options)
    with tfuse.use_backend(backend):
        for _ in range(2):
            train_step(model, fused, inputs(device, dtype))
        change(model, device)
        after_change = [p.detach().clone() for p in model.parameters()]
        x = inputs(device, model.conv.weight.dtype).contiguous(memory_format=torch.preserve_format)
        with pytest.raises(RuntimeError, match=message):  # from zero_grad or backward: our message, not an unrelated dtype error
            fused.zero_grad()
            model(x).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match=message):  # and from the step, whatever backward did
            fused.step()
    for param, before in zip(model.parameters(), after_change):
        torch.testing.assert_close(param.detach(), before, rtol=0, atol=0)  # nothing was updated


def test_the_error_names_parameters_and_lists_every_one_that_changed(device):
    model = ConvNet().to(device)
    flat = FlatParams(model)  # a module: names known
    model.double()
    with pytest.raises(RuntimeError) as error:
        flat.check_storage()
    text = str(error.value)
    assert "the storage of 9 parameters was replaced after they were coalesced" in text
    assert "'conv.weight' changed dtype from torch.float32 to torch.float64" in text
    assert "and 3 more" in text  # six named, then a count
    assert "Nothing was updated" in text


def test_meta_device_materialized_after_creating_the_optimizer_raises_and_in_the_right_order_trains(device):
    with torch.device("meta"):
        late = ConvNet().double()
    optimizer = FusedMomentum(late.parameters(), lr=0.05)
    late.to_empty(device=device)
    with torch.no_grad():
        for param in late.parameters():
            param.normal_()
    # torch gives the module new Parameter objects (a meta parameter cannot be re-homed in place): the
    # optimizer holds the old ones, which get no gradient; torch.optim would silently train nothing.
    with pytest.raises(RuntimeError, match=r"still on the meta device and none has a gradient.*"
                                           r"module\.to_empty\(device=\.\.\.\).*Move or materialize the model first"):
        train_step(late, optimizer, inputs(device))
    # Materialized first, then the optimizer: trains like torch.optim.
    with torch.device("meta"):
        model = ConvNet().double()
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3)
    reference = copy.deepcopy(model)
    fused = FusedMomentum(model.parameters(), lr=0.05)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = inputs(device)
        train_step(model, fused, x)
        train_step(reference, torch_opt, x)
    assert_same_params(model, reference)


# --------------------------------------------------------------------------- the check itself


def test_check_storage_leaves_intact_parameters_alone_and_rehoming_bumps_the_version(device):
    model = ConvNet().to(device)
    flat = FlatParams(model.parameters())
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    versions = {name: p._version for name, p in model.named_parameters()}
    flat.check_storage()
    flat.sync_grads()
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert {name: p._version for name, p in model.named_parameters()} == versions
    values = torch.randn_like(model.head.weight)
    model.head.weight.data = values
    flat.check_storage()
    assert model.head.weight.data_ptr() == pointers["head.weight"]  # back in its slot
    assert torch.equal(model.head.weight.detach(), values)
    assert model.head.weight._version > versions["head.weight"]  # optimizers with master copies see the write


def test_master_weights_take_values_assigned_through_data(device):
    model = ConvNet().to(device=device, dtype=torch.bfloat16)
    optimizer = FusedSGD(model.parameters(), lr=0.0, master_weights=True)
    train_step(model, optimizer, inputs(device, torch.bfloat16))
    model.head.weight.data = torch.full_like(model.head.weight, 0.25)
    train_step(model, optimizer, inputs(device, torch.bfloat16))  # lr 0: must keep what was assigned
    assert (model.head.weight == 0.25).all()
    assert (optimizer.state[model.head.weight]["master_param"] == 0.25).all()


def test_a_plain_torch_optimizer_keeps_working_after_a_data_assignment(device):
    """Without a fused optimizer, torch.optim updates the assigned tensor; the next check takes it back."""
    model, reference = make_models(device)
    flat = FlatParams(model.parameters())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for step in range(4):
        if step == 1:
            _assign_new_values(model, reference, device)
        x = inputs(device)
        for net, opt in zip((model, reference), optimizers):
            train_step(net, opt, x)
        flat.sync_grads()
    assert_same_params(model, reference)
    assert all(in_flat_buffer(p) for p in model.parameters())
