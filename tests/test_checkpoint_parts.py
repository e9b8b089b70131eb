"""A checkpoint of part of a model holds only that part, whichever tfuse object coalesced the parameters.

Coalescing makes each parameter (its gradient, its optimizer state) a view of a flat buffer, and torch
serialises a view with its whole storage. The reference is torch itself: the same model never coalesced.
For every coalescing path (each optimizer family, ``setup``, ``FlatParams``, FusedDataParallel,
ShardedOptimizer, LocalSGD, a layout change after freezing), after a training step:

* ``torch.save(layer.state_dict())``, ``torch.save(layer)``, ``pickle.dumps(layer)``,
  ``copy.deepcopy(layer)``, ``torch.save(param)``, ``torch.save(param.grad)`` and the optimizer's
  per-parameter state are as large as torch's for the uncoalesced model, within the zip records' slack;
* what they write loads with ``weights_only=True`` into a fresh uncoalesced model, bit for bit;
* the whole model's state dict is no larger than torch's either.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tfuse
from tfuse.distributed import FusedDataParallel, LocalSGD, ShardedOptimizer

#: Bytes a coalesced save may exceed torch's by (a record's name and alignment: the same records are written).
SLACK = 256
LAYERS, WIDTH = 4, 32


def make_model(relu: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()] if relu else [nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers)


def size(obj) -> int:
    out = io.BytesIO()
    torch.save(obj, out)
    return len(out.getvalue())


def loaded(obj):
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return torch.load(out, weights_only=True)


def train_step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, WIDTH)).square().mean().backward()
    optimizer.step()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included)."""
    return a.shape == b.shape and torch.equal(a.detach().flatten().view(torch.uint8), b.detach().flatten().view(torch.uint8))


def _optimizer(name):
    def build(model):
        cls = getattr(tfuse.optim, name)
        return model, cls(model.parameters(), lr=0.01)

    return build


def _setup(model):
    done = tfuse.setup(model, optimizer="adam", lr=0.01)
    return done.model, done.optimizer


def _flat_params(model):
    tfuse.flat.FlatParams(model.parameters())
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _flat_params_of_module(model):
    tfuse.flat.FlatParams(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _fuse_model(model):
    fused, _ = tfuse.fuse_model(make_model(relu=True))  # Linear + ReLU -> FusedLinear
    return fused, tfuse.optim.FusedAdam(fused.parameters(), lr=0.01)


def _after_freezing(model):
    optimizer = tfuse.optim.FusedAdamW(model.parameters(), lr=0.01)
    train_step(model, optimizer)
    model[1].weight.requires_grad_(False)  # the next step changes the layout: new buffers
    train_step(model, optimizer)
    model[1].weight.requires_grad_(True)
    return model, optimizer


PATHS = {
    **{name: _optimizer(name) for name in ("FusedSGD", "FusedMomentum", "FusedAdam", "FusedAdamW", "FusedAdagrad",
                                           "FusedLion", "FusedLAMB", "FusedLARS", "FusedMuon")},
    "setup": _setup,
    "fuse_model": _fuse_model,
    "FlatParams": _flat_params,
    "FlatParams(module)": _flat_params_of_module,
    "freeze_unfreeze": _after_freezing,
}


#: Paths that know the module, and so make deep copies of its state dicts compact too.
KNOWS_THE_MODULE = {"setup", "FlatParams(module)"}


def assert_part_is_compact(model: nn.Module, optimizer, relu: bool = False) -> None:
    """The class of checks above, for layer 0 of a trained, coalesced ``model`` (``make_model(relu)``'s)."""
    reference = make_model(relu)
    layer, torch_layer = model.get_submodule("0"), reference[0]
    assert size(layer.state_dict()) <= size(torch_layer.state_dict()) + SLACK
    assert size(layer) <= size(torch_layer) + SLACK
    assert len(pickle.dumps(layer)) <= len(pickle.dumps(torch_layer)) + SLACK
    assert size(copy.deepcopy(layer)) <= size(torch_layer) + SLACK
    assert size(layer.weight) <= size(torch_layer.weight) + SLACK
    assert layer.weight.grad is not None
    assert size(layer.weight.grad) <= size(torch.zeros_like(torch_layer.weight)) + SLACK
    for name, value in optimizer.state.get(layer.weight, {}).items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            assert size(value) <= size(value.clone()) + SLACK, name
    whole = model.state_dict()
    assert size(whole) <= size(reference.state_dict()) + SLACK
    # Bit for bit into a fresh, uncoalesced model (weights_only: plain tensors).
    fresh = make_model(relu)
    fresh[0].load_state_dict(loaded(layer.state_dict()))
    for mine, theirs in zip(layer.parameters(), fresh[0].parameters()):
        assert same_bits(mine, theirs)
    fresh.load_state_dict(loaded(whole))
    assert all(same_bits(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert same_bits(loaded(layer.weight), layer.weight)
    assert same_bits(pickle.loads(pickle.dumps(layer)).weight, layer.weight)


def assert_state_dict_deep_copies_compactly(model: nn.Module) -> None:
    assert size(copy.deepcopy(model.get_submodule("0").state_dict())) <= size(make_model()[0].state_dict()) + SLACK


@pytest.mark.parametrize("path", PATHS)
def test_part_of_a_coalesced_model_saves_only_that_part(path):
    model, optimizer = PATHS[path](make_model())
    train_step(model, optimizer)
    weight = model.get_submodule("0").weight
    assert weight.untyped_storage().nbytes() > weight.numel() * 4  # coalesced: a view
    assert_part_is_compact(model, optimizer, relu=path == "fuse_model")
    if path not in KNOWS_THE_MODULE:  # an optimizer (or FlatParams) handed parameters: the user registers it
        tfuse.flat.register_compact_state_dict(model)
    assert_state_dict_deep_copies_compactly(model)


def test_tied_parameters_are_written_once():
    model = make_model()
    model[1].weight = model[0].weight  # tied
    optimizer = tfuse.optim.FusedAdam(model.parameters(), lr=0.01)
    train_step(model, optimizer)
    both = {"a": model[0].weight.detach(), "b": model[1].weight.detach()}
    assert size(both) <= size(model[0].weight.detach().clone()) + 2 * SLACK
    back = loaded(both)
    assert torch.equal(back["a"], back["b"])


def test_unrelated_views_keep_torch_semantics():
    """Only tfuse's buffers are written compactly: a view of a user's tensor saves its whole storage, as
    torch does (views sharing a storage load sharing it)."""
    tfuse.optim.FusedAdam(make_model().parameters())  # coalescing installs the reducer
    base = torch.arange(1000.0)
    views = {"head": base[:10], "tail": base[990:]}
    assert size(views) > 4000
    back = loaded(views)
    assert back["head"].untyped_storage().data_ptr() == back["tail"].untyped_storage().data_ptr()


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo process group in this process."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fused_data_parallel(gloo_world):
    wrapped = FusedDataParallel(make_model())
    optimizer = tfuse.optim.FusedAdam(wrapped.parameters(), lr=0.01)
    train_step(wrapped, optimizer)
    assert_part_is_compact(wrapped.module, optimizer)
    assert_state_dict_deep_copies_compactly(wrapped.module)


def test_sharded_optimizer(gloo_world):
    model = make_model()
    optimizer = ShardedOptimizer(model.parameters(), tfuse.optim.FusedAdam, lr=0.01)
    train_step(model, optimizer)
    assert_part_is_compact(model, optimizer)


def test_local_sgd(gloo_world):
    model = make_model()
    optimizer = tfuse.optim.FusedMomentum(model.parameters(), lr=0.01)
    local = LocalSGD(model, optimizer, sync_every=2)
    for _ in range(2):
        train_step(model, optimizer)
        local.step()
    assert_part_is_compact(model, optimizer)
    assert_state_dict_deep_copies_compactly(model)


def test_the_reducer_defers_to_torch_and_to_an_earlier_reducer(monkeypatch):
    """Unmarked tensors, tensors that require grad and whole-buffer tensors reduce as torch reduces them; a
    reducer registered before tfuse's still serves the unmarked ones."""
    from tfuse.flat import _compact_pickle

    buffer = torch.zeros(100)
    tfuse.flat.mark_compact(buffer)
    plain = torch.arange(10.0)
    assert _compact_pickle._reduce_tensor(plain)[0] is plain.__reduce_ex__(2)[0]
    whole = _compact_pickle._reduce_tensor(buffer)[1]
    assert whole[0]._size() == 100  # the buffer itself: its whole storage
    view = buffer[:10]
    assert _compact_pickle._reduce_tensor(view)[1][0]._size() == 10
    leaf = buffer[:10].detach().requires_grad_()
    assert _compact_pickle._reduce_tensor(leaf)[1][0]._size() == 100  # torch's behaviour kept
    seen = []
    monkeypatch.setattr(_compact_pickle, "_previous", lambda t: seen.append(t) or t.__reduce_ex__(2))
    _compact_pickle._reduce_tensor(plain)
    assert seen == [plain]
    assert _compact_pickle._reduce_tensor(view)[1][0]._size() == 10 and seen == [plain]
