"""tfuse.optim.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ and float64 maths.

Both paths run: the Triton kernels (through the interpreter on CPU) and the
PyTorch path (TFUSE_BACKEND=torch). The block tables the kernels read are
cached between calls; the tests below check that a cached table is reused
when nothing changed, and that no stale table is ever used: a wrong table
would silently read or scale the wrong elements, so those tests poison every
element no table should touch and check which elements the launched tables
cover.
"""

from __future__ import annotations

import copy
import gc
import math
import sys
import warnings
import weakref

import pytest
import torch
from torch import nn

import tfuse
import tfuse.optim.clip as clip_module
from tfuse.flat import FlatParams
from tfuse.optim import clip_grad_norm_

BACKENDS = ["triton", "torch"]
POISON = 1.0e4  # in slots no table may touch: reading it changes the norm, scaling it changes it


def model_pair(device, dtype=torch.float32):
    model = nn.Sequential(nn.Linear(70, 33), nn.Tanh(), nn.Linear(33, 5)).to(device=device, dtype=dtype)
    return model, copy.deepcopy(model)


def backward_both(model, reference, device, dtype=torch.float32):
    x = torch.randn(8, 70, device=device, dtype=dtype)
    for m in (model, reference):
        m(x).pow(2).sum().backward()


def float64_norm(grads, norm_type) -> float:
    """The total norm in float64 maths, independent of both paths."""
    p = float(norm_type)
    flat = torch.cat([g.detach().double().flatten() for g in grads]).abs()
    if math.isinf(p):
        return flat.max().item()
    return flat.pow(p).sum().pow(1 / p).item()


class LaunchRecorder:
    """Records the launches (kernel name and arguments) and lets them run."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, tuple, dict]] = []

        def record(kernel, grid, args, meta, device):
            self.calls.append((tfuse._launch.kernel_name(kernel), args, meta))

        # A watcher at tfuse's launch seam for the rest of the test (monkeypatch restores the seam's list).
        monkeypatch.setattr(tfuse._launch, "_watchers", [*tfuse._launch._watchers, (record, True)])

    def tables(self, kernel="_clip_segments_kernel") -> list[torch.Tensor]:
        """The block tables passed to ``kernel`` since the last clear, in launch order."""
        return [args[1] for name, args, _ in self.calls if name == kernel]

    def clear(self) -> None:
        self.calls.clear()


def covered(table: torch.Tensor) -> set[int]:
    """Element indices of the buffer that a block table covers (and checks blocks do not overlap)."""
    elements: set[int] = set()
    count = 0
    for start, length in table.cpu().tolist():
        assert 0 < length <= clip_module.BLOCK
        elements.update(range(start, start + length))
        count += length
    assert count == len(elements), "blocks overlap"
    return elements


def slot_elements(flat: FlatParams, params) -> set[int]:
    """Element indices of the gradient slots of ``params`` in ``flat``'s (single) gradient buffer."""
    (group,) = [g for g in flat.groups if g.grad is not None]
    offset = {id(p): o for p, o in zip(group.params, group.offsets)}
    return {i for p in params for i in range(offset[id(p)], offset[id(p)] + p.numel())}


def poison_all_but(flat: FlatParams, params) -> tuple[torch.Tensor, torch.Tensor]:
    """Fills every element of the gradient buffer outside the slots of ``params`` with POISON.

    Returns the buffer and a mask of the poisoned elements.
    """
    (buffer,) = flat.grad_buffers
    keep = torch.zeros(buffer.numel(), dtype=torch.bool)
    keep[sorted(slot_elements(flat, params))] = True
    keep = keep.to(buffer.device)
    buffer[~keep] = POISON
    return buffer, ~keep


# ---------------------------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, "inf", 3.0, 0.5])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_matches_torch(norm_type, max_norm, backend, device):
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    exact = float64_norm([p.grad for p in reference.parameters()], norm_type)
    with tfuse.use_backend(backend), tfuse.count_launches() as launches:
        total = clip_grad_norm_(flat, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, float(norm_type))
    # The kernels sum ~2.5k float32 terms (torch's CPU reduction is more
    # exact), about 1e-6 relative; the 1/p power multiplies that by 1/p (2
    # for p = 0.5), and general p goes through exp2(p log2|g|). Hence 1e-5.
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert total.item() == pytest.approx(exact, rel=1e-5)
    assert total.dtype == torch.float32 and total.device == expected.device and total.dim() == 0
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    assert launches.total == (3 if backend == "triton" else 0)  # partial norms, final norm, scaling


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_odd_sizes_touch_only_the_slots_with_gradients(norm_type, backend, device):
    # Sizes that are not multiples of a vector (tails), one that spans several blocks and ends
    # mid-vector, a zero-size slot, and a parameter whose grad is None (its slot must stay stale).
    shapes = [(17,), (1,), (33, 7), (0, 5), (4099,), (3, 1000), (9001,), (5,)]
    params = [nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    flat = FlatParams(params)
    reference = [torch.randn(s, device=device) for s in shapes]
    skipped = params[2]
    for param, grad in zip(params, reference):
        if param is not skipped:
            param.grad = flat.grad_view(param)
            param.grad.copy_(grad)
    active = [p for p in params if p is not skipped]
    before = [g for p, g in zip(params, reference) if p is not skipped]
    buffer, poisoned = poison_all_but(flat, active)
    exact = float64_norm(before, norm_type)
    # An empty gradient adds nothing (torch's foreach infinity norm would raise on it).
    expected = torch.nn.utils.get_total_norm([g for g in before if g.numel()], norm_type)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(params, 0.25, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    assert total.item() == pytest.approx(exact, rel=1e-5)
    coef = min(0.25 / (exact + 1e-6), 1.0)
    for param, grad in zip(active, before):
        torch.testing.assert_close(param.grad, grad * coef, rtol=1e-5, atol=1e-7)
    assert skipped.grad is None
    assert torch.all(buffer[poisoned] == POISON), "padding or a stale slot was read or written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_parameters_with_gradients_count(backend, device):
    # optimizer.zero_grad() leaves stale values in the flat buffer; a parameter
    # the next backward does not reach keeps grad None and must not count.
    used, unused = nn.Linear(9, 9).to(device), nn.Linear(9, 9).to(device)
    reference = copy.deepcopy(used)
    flat = FlatParams(list(used.parameters()) + list(unused.parameters()))
    optimizer = torch.optim.SGD(flat.params, lr=0.1)
    (used(torch.randn(3, 9, device=device)).sum() + unused(torch.randn(3, 9, device=device)).sum()).backward()
    optimizer.zero_grad()
    x = torch.randn(3, 9, device=device)
    used(x).sum().backward()
    reference(x).sum().backward()
    stale = [flat.grad_view(p).clone() for p in unused.parameters()]
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(flat, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.testing.assert_close(total, expected)
    for mine, theirs in zip(used.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)
    assert all(p.grad is None for p in unused.parameters())
    for param, before in zip(unused.parameters(), stale):
        assert torch.equal(flat.grad_view(param), before)  # stale slots neither read nor scaled


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_and_plain_gradients_together(backend, device):
    model, reference = model_pair(device)
    flat = FlatParams(model[0].parameters())  # the last layer stays un-coalesced
    backward_both(model, reference, device)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(model.parameters(), 0.3)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
    torch.testing.assert_close(total, expected)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_buffers_one_total(backend, device):
    double = nn.Linear(6, 6).to(device=device, dtype=torch.float64)
    single = nn.Linear(6, 6).to(device)
    references = [copy.deepcopy(double), copy.deepcopy(single)]
    flat = FlatParams(list(double.parameters()) + list(single.parameters()))
    x = torch.randn(2, 6, device=device)
    for a, b in ((double, single), references):
        (a(x.double()).sum() + b(x).sum()).backward()
    with tfuse.use_backend(backend), tfuse.count_launches() as launches:
        total = clip_grad_norm_(flat, 0.2)
    expected = torch.nn.utils.clip_grad_norm_([p for m in references for p in m.parameters()], 0.2)
    assert total.dtype == expected.dtype == torch.float64  # promoted across the gradients' dtypes, as torch
    torch.testing.assert_close(total, expected)
    for mine, theirs in zip(flat.params, [p for m in references for p in m.parameters()]):
        torch.testing.assert_close(mine.grad, theirs.grad)
    assert launches.total == (5 if backend == "triton" else 0)  # per buffer: partials and scaling; one final


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_return_dtype_follows_the_gradients(dtype, backend, device):
    model, reference = model_pair(device, dtype)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device, dtype)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(flat, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert total.dtype == expected.dtype == dtype
    assert total.device == expected.device
    torch.testing.assert_close(total, expected)
    # torch rounds each gradient's norm to the low-precision dtype before combining them; the kernels
    # round the total once. The norms may then differ by a rounding, the coefficients (rounded to the
    # dtype as torch rounds them) by an ulp, the clipped gradients by up to two.
    tolerance = {} if dtype == torch.float64 else dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_are_bit_identical_to_torch(dtype, backend, device):
    # Small integer gradients: every sum of squares is exact in float32, so both norms are the same
    # number, and what remains is how the coefficient is rounded: torch computes it in the norm's
    # dtype (max_norm / (norm + 1e-6), clamped), then multiplies in float32 and rounds once.
    param = nn.Parameter(torch.zeros(3000, device=device, dtype=dtype))
    reference = nn.Parameter(param.detach().clone())
    flat = FlatParams([param])
    reference.grad = torch.randint(-8, 9, (3000,), device=device).to(dtype)
    param.grad = flat.grad_view(param)
    param.grad.copy_(reference.grad)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(flat, 3.0)
    expected = torch.nn.utils.clip_grad_norm_([reference], 3.0)
    assert torch.equal(total, expected)
    assert torch.equal(param.grad, reference.grad)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) warns about the inf/NaN maths
@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_norm_that_overflows_is_inf_as_in_torch(backend, device):
    # torch keeps the norm of float16 gradients in float16: past 65504 it is inf, and the
    # coefficient max_norm / inf = 0 zeroes the gradients. The kernels do the same.
    params = [nn.Parameter(torch.zeros(20000, device=device, dtype=torch.float16)) for _ in range(2)]
    references = [nn.Parameter(p.detach().clone()) for p in params]
    flat = FlatParams(params)
    for p, r in zip(params, references):
        r.grad = torch.full_like(r, 400.0)
        p.grad = flat.grad_view(p)
        p.grad.copy_(r.grad)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(flat, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(references, 1.0)
    assert torch.isinf(expected) and torch.isinf(total) and total.dtype == torch.float16
    for p, r in zip(params, references):
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) warns about the inf/NaN maths
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradients(bad, norm_type, backend, device):
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    for m in (model, reference):
        m[0].weight.grad[0, 1] = bad
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(flat, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type)
    torch.testing.assert_close(total, expected, equal_nan=True)
    assert not torch.isfinite(total)
    # A NaN norm makes every gradient NaN, an infinite one zeroes them (and inf * 0 is NaN), as in torch.
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, equal_nan=True)
    with pytest.raises(RuntimeError) as torch_error:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type, error_if_nonfinite=True)
    with tfuse.use_backend(backend), pytest.raises(RuntimeError) as ours:
        clip_grad_norm_(flat, 1.0, norm_type, error_if_nonfinite=True)
    assert str(ours.value) == str(torch_error.value)


def test_no_gradients_and_single_tensor(device):
    layer = nn.Linear(3, 3).to(device)
    flat = FlatParams(layer.parameters())
    none = clip_grad_norm_(layer.parameters(), 1.0)
    assert none.item() == 0.0 and none.device.type == "cpu" and none.dtype == torch.float32  # torch's tensor(0.)
    tensor = torch.randn(5, device=device, requires_grad=True)
    tensor.grad = torch.full((5,), 2.0, device=device)
    total = clip_grad_norm_(tensor, 1.0)
    torch.testing.assert_close(total, torch.tensor(math.sqrt(20.0), device=device))
    with pytest.warns(UserWarning, match="empty generator"):
        clip_grad_norm_((p for p in []), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_([], 1.0)  # an empty list is not a generator: no warning, as in torch


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_parameter_counts_twice_as_in_torch(backend, device, monkeypatch):
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    mine = [model[0].weight, model[0].weight, model[2].bias]
    theirs = [reference[0].weight, reference[0].weight, reference[2].bias]
    recorder = LaunchRecorder(monkeypatch)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(mine, 0.05)
    if backend == "triton":
        # The slot is in the table once (blocks never overlap: on a GPU two programs would race on
        # the same elements); the repeat is counted and scaled again with torch ops.
        assert covered(recorder.tables()[0]) == slot_elements(flat, [model[0].weight, model[2].bias])
    # torch's per-tensor loop scales a repeated gradient once per listing; its CUDA foreach kernel
    # races on the repeat (both chunks read the unscaled values), so the reference is the loop.
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.05, foreach=False)
    torch.testing.assert_close(total, expected)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_gradients_are_clipped_like_torch(backend, device):
    # backward(create_graph=True): the gradients keep their graph and stay out of the flat buffer.
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    x = torch.randn(4, 70, device=device)
    for m in (model, reference):
        m(x).pow(2).sum().backward(create_graph=True)
    with tfuse.use_backend(backend):
        total = clip_grad_norm_(model.parameters(), 0.1)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.testing.assert_close(total, expected)
    assert not total.requires_grad
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_option_for_plain_gradients(foreach, device):
    model, reference = model_pair(device)
    backward_both(model, reference, device)
    total = clip_grad_norm_(model.parameters(), 0.2, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.2, foreach=foreach)
    torch.testing.assert_close(total, expected)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_foreach_true_on_a_device_without_foreach_is_torchs_error():
    param = torch.zeros(3, device="meta", requires_grad=True)
    param.grad = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=True)
    with pytest.raises(RuntimeError) as ours:
        clip_grad_norm_([param], 1.0, foreach=True)
    assert str(ours.value) == str(theirs.value)


def test_errors(device):
    layer = nn.Linear(3, 3).to(device)
    with pytest.raises(ValueError, match=r"norm_type must be a positive number or 'inf', got 0"):
        clip_grad_norm_(layer.parameters(), 1.0, 0)
    with pytest.raises(ValueError, match=r"got 'fro'"):
        clip_grad_norm_(layer.parameters(), 1.0, "fro")
    with pytest.raises(TypeError, match=r"max_norm must be a number, got str"):
        clip_grad_norm_(layer.parameters(), "1")
    with pytest.raises(TypeError, match=r"foreach must be None or a bool, got str"):
        clip_grad_norm_(layer.parameters(), 1.0, foreach="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only exist with a GPU")
def test_no_host_sync_once_the_table_is_cached(device):
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    clip_grad_norm_(flat, 0.5)  # builds and uploads the block table
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        clip_grad_norm_(flat, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------- block-table cache


def grads_in_slots(flat: FlatParams, params, device) -> dict:
    """Fresh random gradients written into the slots of ``params``; returns param -> expected gradient."""
    grads = {}
    for param in params:
        param.grad = flat.grad_view(param)
        param.grad.copy_(torch.randn(param.shape, device=device))
        grads[param] = param.grad.clone()
    return grads


def check_clipped(total: torch.Tensor, grads: dict, max_norm: float) -> None:
    """The norm and the scaled gradients against float64 maths over ``grads`` (param -> gradient before)."""
    exact = float64_norm(list(grads.values()), 2.0)
    assert total.item() == pytest.approx(exact, rel=1e-5)
    coef = min(max_norm / (exact + 1e-6), 1.0)
    for param, before in grads.items():
        torch.testing.assert_close(param.grad, before * coef, rtol=1e-5, atol=1e-7)


def test_cached_table_is_reused_and_covers_exactly_the_slots(monkeypatch, device):
    model, _ = model_pair(device)
    flat = FlatParams(model.parameters())
    recorder = LaunchRecorder(monkeypatch)
    params = flat.params
    for _ in range(3):
        grads = grads_in_slots(flat, params, device)
        check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    partial_tables = recorder.tables("_norm_partial_kernel")
    clip_tables = recorder.tables()
    assert len(clip_tables) == len(partial_tables) == 3
    # One device tensor for every call: built once, never copied from the host again.
    assert all(table is clip_tables[0] for table in clip_tables + partial_tables)
    assert clip_tables[0].device.type == device.type and clip_tables[0].dtype == torch.int64
    assert covered(clip_tables[0]) == slot_elements(flat, params)
    # The same parameters given another way (a list, the optimizer-style iterable) give the same blocks.
    recorder.clear()
    grads = grads_in_slots(flat, params, device)
    check_clipped(clip_grad_norm_(list(model.parameters()), 0.5), grads, 0.5)
    assert covered(recorder.tables()[0]) == slot_elements(flat, params)


def test_grad_set_to_none_gets_a_new_table(monkeypatch, device):
    model, _ = model_pair(device)
    flat = FlatParams(model.parameters())
    recorder = LaunchRecorder(monkeypatch)
    params = flat.params
    grads_in_slots(flat, params, device)
    clip_grad_norm_(flat, 0.5)
    first = recorder.tables()[-1]
    # Drop a gradient in the middle of the buffer; its slot keeps stale (here: poisoned) values.
    dropped = model[0].bias
    dropped.grad = None
    active = [p for p in params if p is not dropped]
    grads = grads_in_slots(flat, active, device)
    buffer, poisoned = poison_all_but(flat, active)
    recorder.clear()
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    second = recorder.tables()[0]
    assert second is not first
    assert covered(second) == slot_elements(flat, active)
    assert torch.all(buffer[poisoned] == POISON)
    assert dropped.grad is None
    # The gradient comes back: the first table again (from the cache), covering every slot.
    grads = grads_in_slots(flat, params, device)
    recorder.clear()
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    assert recorder.tables()[0] is first


def test_recreated_grad_is_clipped_where_it_lives(monkeypatch, device):
    model, _ = model_pair(device)
    flat = FlatParams(model.parameters())
    recorder = LaunchRecorder(monkeypatch)
    params = flat.params
    grads_in_slots(flat, params, device)
    clip_grad_norm_(flat, 0.5)
    # A gradient set by hand lives outside the buffer; its slot holds stale values that must not count.
    moved = model[2].weight
    others = [p for p in params if p is not moved]
    grads = grads_in_slots(flat, others, device)
    moved.grad = torch.randn(moved.shape, device=device)
    grads[moved] = moved.grad.clone()
    buffer, poisoned = poison_all_but(flat, others)
    recorder.clear()
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    assert covered(recorder.tables()[0]) == slot_elements(flat, others)
    assert torch.all(buffer[poisoned] == POISON)
    # The same memory through another tensor object counts as in the slot.
    moved.grad = flat.grad_view(moved).view(moved.shape)
    grads = grads_in_slots(flat, others, device)
    moved.grad.copy_(torch.randn(moved.shape, device=device))
    grads[moved] = moved.grad.clone()
    recorder.clear()
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    assert covered(recorder.tables()[0]) == slot_elements(flat, params)


def test_layout_change_never_uses_a_stale_table(monkeypatch, device):
    # The last layer frozen, then unfrozen: sync_grads lays the buffer out again (trainable
    # parameters in backward order, so the first layer's slots move). The old table would read
    # and scale the wrong elements.
    model, _ = model_pair(device)
    model[2].requires_grad_(False)
    flat = FlatParams(model.parameters())
    recorder = LaunchRecorder(monkeypatch)
    trainable = [p for p in flat.params if p.requires_grad]
    grads = grads_in_slots(flat, trainable, device)
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    old_table = recorder.tables()[0]
    old_slots = slot_elements(flat, trainable)
    version = flat.layout_version
    # Keep the old buffer and gradient views alive (as a caller may): only the layout version then
    # tells that a cached plan and its tables are stale.
    old_buffer, old_views = flat.grad_buffers, [p.grad for p in trainable]
    model[2].requires_grad_(True)
    flat.sync_grads()
    assert flat.layout_version != version
    params = flat.params
    assert slot_elements(flat, trainable) != old_slots  # the offsets really moved
    grads = grads_in_slots(flat, params, device)
    buffer, poisoned = poison_all_but(flat, params)
    recorder.clear()
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    new_table = recorder.tables()[0]
    assert new_table is not old_table
    assert covered(new_table) == slot_elements(flat, params)
    assert torch.all(buffer[poisoned] == POISON)
    del old_buffer, old_views
    # The first layer frozen (a third layout), one remaining gradient None: still exact.
    model[0].requires_grad_(False)
    for p in model[0].parameters():
        p.grad = None
    flat.sync_grads()
    trainable = [p for p in flat.params if p.requires_grad]
    assert set(trainable) == set(model[2].parameters())
    model[2].bias.grad = None
    active = [model[2].weight]
    grads = grads_in_slots(flat, active, device)
    buffer, poisoned = poison_all_but(flat, active)
    recorder.clear()
    check_clipped(clip_grad_norm_(flat, 0.5), grads, 0.5)
    assert covered(recorder.tables()[0]) == slot_elements(flat, active)
    assert torch.all(buffer[poisoned] == POISON)


def test_a_subset_of_the_parameters_has_its_own_table(monkeypatch, device):
    model, _ = model_pair(device)
    flat = FlatParams(model.parameters())
    recorder = LaunchRecorder(monkeypatch)
    params = flat.params
    grads_in_slots(flat, params, device)
    clip_grad_norm_(flat, 1e9)
    subset = list(model[2].parameters())
    outside = {p: p.grad.clone() for p in model[0].parameters()}
    grads = {p: p.grad.clone() for p in subset}
    recorder.clear()
    check_clipped(clip_grad_norm_(subset, 0.01), grads, 0.01)
    assert covered(recorder.tables()[0]) == slot_elements(flat, subset)
    for param, before in outside.items():
        assert torch.equal(param.grad, before)


def test_parameters_coalesced_after_a_first_call_use_the_kernels(device):
    model, reference = model_pair(device)
    backward_both(model, reference, device)
    with tfuse.use_backend("triton"), tfuse.count_launches() as launches:
        clip_grad_norm_(model.parameters(), 0.3)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
    assert launches.total == 0  # no FlatParams yet: torch's foreach ops
    flat = FlatParams(model.parameters())
    for m in (model, reference):
        m.zero_grad()
    backward_both(model, reference, device)
    with tfuse.use_backend("triton"), tfuse.count_launches() as launches:
        total = clip_grad_norm_(model.parameters(), 0.3)
    assert launches.total == 3
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3))
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_cache_holds_no_tensor_alive(device):
    # Plain parameters: the cached plan refers to them weakly, so they die with the model.
    model, reference = model_pair(device)
    backward_both(model, reference, device)
    clip_grad_norm_(model.parameters(), 0.5)
    refs = [weakref.ref(t) for p in model.parameters() for t in (p, p.grad)]
    del model
    gc.collect()
    assert all(ref() is None for ref in refs)
    # Flat buffers and the gradient views: the cache adds no reference to any of them.
    model, reference = model_pair(device)
    flat = FlatParams(model.parameters())
    backward_both(model, reference, device)
    tensors = flat.grad_buffers + [p.grad for p in flat.params]
    counts = [sys.getrefcount(t) for t in tensors]
    clip_grad_norm_(flat, 0.5)
    clip_grad_norm_(list(model.parameters()), 0.5)
    assert [sys.getrefcount(t) for t in tensors] == counts
