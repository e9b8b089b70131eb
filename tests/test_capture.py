"""tfuse.capture_step: a whole training step in one CUDA graph.

On the CPU (always run): every argument check and every refusal of a set-up
that cannot be captured, the input checks of the captured step, the
hyperparameter check at replay, the warm-up's discovery of modules and
optimizers, and the host-copy guard (with the meta device standing in for
the GPU). The set-up checks run before the device check, so they are tested
with CPU models.

On a GPU: a fuse_model'd CNN (conv, BN2d + ReLU, a residual add, channels_last,
bf16 autocast) with clip_grad_norm_ and FusedMomentum / FusedAdam (and FusedAdam
under fp16 with a GradScaler), alone and in a one-rank NCCL FusedDataParallel,
captured and replayed against the same steps run eagerly from the same state,
with torch.cuda.set_sync_debug_mode("error") around the replays.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ON_CUDA
from fusion_models import ResNetish
from torch import nn

import tfuse
from tfuse import capture
from tfuse.capture import CapturedStep, capture_step
from tfuse.distributed import FusedDataParallel


def _linear_setup(capturable: bool = True, **kwargs):
    model = nn.Linear(4, 3)
    return model, tfuse.optim.FusedMomentum(model.parameters(), lr=0.1, capturable=capturable, **kwargs)


def _step(model, optimizer):
    def step(x):
        optimizer.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


# ------------------------------------------------------------------------------------------ arguments


def test_capture_step_is_public():
    assert tfuse.capture_step is capture_step
    assert "capture_step" in tfuse.__all__


def test_bad_arguments_are_refused_by_name():
    model, optimizer = _linear_setup()
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        capture_step("step", x, optimizers=optimizer)
    with pytest.raises(TypeError, match=r"example input 1 is a list, not a tensor.*closure"):
        capture_step(_step(model, optimizer), x, [1, 2], optimizers=optimizer)
    with pytest.raises(TypeError, match="example input 0 is a float"):
        capture_step(_step(model, optimizer), 0.5, optimizers=optimizer)
    for warmup in (2, 0, 3.0, True, None):
        with pytest.raises(ValueError, match=r"warmup must be an int >= 3"):
            capture_step(_step(model, optimizer), x, optimizers=optimizer, warmup=warmup)
    with pytest.raises(TypeError, match="optimizers must be a torch.optim.Optimizer or a list of them, got Linear"):
        capture_step(_step(model, optimizer), x, optimizers=model)
    with pytest.raises(TypeError, match="models must be a torch.nn.Module or a list of them, got FusedMomentum"):
        capture_step(_step(model, optimizer), x, optimizers=[optimizer], models=[model, optimizer])


def test_cpu_tensors_are_refused_once_the_set_up_is_capturable():
    model, optimizer = _linear_setup()
    with pytest.raises(RuntimeError, match="example input 0 is on cpu; a CUDA graph captures the work of one GPU"):
        capture_step(_step(model, optimizer), torch.randn(2, 4), optimizers=optimizer, models=model)
    with pytest.raises(RuntimeError, match="parameter 'weight' of models\\[0\\] is on cpu"):
        capture_step(lambda: None, models=model)
    with pytest.raises(RuntimeError, match="a parameter of optimizers\\[0\\] is on cpu"):
        capture_step(lambda: None, optimizers=optimizer)


# ------------------------------------------------------------------------------------------ optimizers


@pytest.mark.parametrize("cls", [tfuse.optim.FusedMomentum, tfuse.optim.FusedSGD, tfuse.optim.FusedAdam,
                                 tfuse.optim.FusedAdamW])  # fmt: skip
def test_a_fused_optimizer_without_capturable_is_refused(cls):
    model = nn.Linear(4, 3)
    optimizer = cls(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"{cls.__name__} was built with capturable=False.*capturable=True"):
        capture_step(_step(model, optimizer), torch.randn(2, 4), optimizers=optimizer)
    capturable = cls(model.parameters(), lr=torch.tensor(0.1), capturable=True)
    with pytest.raises(RuntimeError, match="is on cpu"):  # accepted; then the device check
        capture_step(_step(model, capturable), torch.randn(2, 4), optimizers=capturable)


@pytest.mark.parametrize(
    "make,accepted",
    [
        (lambda p: torch.optim.Adam(p, lr=1e-3), False),
        (lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True), False),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
        (lambda p: torch.optim.Adam(p, lr=1e-3, capturable=True), True),
        (lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1), momentum=0.9, fused=True), True),
    ],
    ids=["Adam", "AdamW-foreach", "SGD", "Adam-capturable", "SGD-fused"],
)
def test_torch_optimizers_need_capturable_or_fused_sgd(make, accepted):
    model = nn.Linear(4, 3)
    optimizer = make(model.parameters())
    name = type(optimizer).__name__
    if accepted:
        with pytest.raises(RuntimeError, match="is on cpu"):
            capture_step(_step(model, optimizer), torch.randn(2, 4), optimizers=optimizer)
    else:
        with pytest.raises(ValueError, match=rf"{name} lacks capturable=True.*torch.optim.SGD: fused=True"):
            capture_step(_step(model, optimizer), torch.randn(2, 4), optimizers=optimizer)


# ------------------------------------------------------------------------------------------ modules


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, tfuse.nn.FusedBatchNormAct2d])
def test_batch_norm_with_momentum_none_in_training_is_refused_by_name(norm):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(norm(4, momentum=None)), nn.ReLU())
    optimizer = tfuse.optim.FusedMomentum(model.parameters(), lr=0.1, capturable=True)
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(ValueError, match=rf"batch norm layer '1.0' \({norm.__name__}\) has momentum=None in training"
                                         r".*num_batches_tracked.*layer.momentum = 0.1"):  # fmt: skip
        capture_step(_step(model, optimizer), x, optimizers=optimizer, models=model)
    for fine in (lambda: model.eval(), lambda: setattr(model[1][0], "momentum", 0.1)):
        model.train()
        fine()
        with pytest.raises(RuntimeError, match="is on cpu"):
            capture_step(_step(model, optimizer), x, optimizers=optimizer, models=model)
    untracked = nn.BatchNorm1d(4, momentum=None, track_running_stats=False)  # no running average to update
    capture._check_setup((), (untracked,), 3)


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo process group in this process (torch.distributed, CPU)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fdp(**options):
    return FusedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), **options)


def test_fused_data_parallel_on_gloo_is_refused_even_with_one_rank(gloo_world):
    model = _fdp()
    with pytest.raises(ValueError, match=r"FusedDataParallel \(FusedDataParallel\) all-reduces gradients \(one rank "
                                         r"too\) with the gloo backend.*NCCL"):  # fmt: skip
        capture._check_setup((), (model,), 3)


@pytest.mark.parametrize(
    "options,pattern",
    [
        (dict(find_unused_parameters=True), r"find_unused_parameters=True.*\.tolist\(\)"),
        (dict(gradient_merge_steps=2), r"gradient_merge_steps=2.*no_sync"),
    ],
    ids=["find_unused_parameters", "gradient_merge_steps"],
)
def test_fused_data_parallel_options_that_sync_are_refused(gloo_world, options, pattern):
    with pytest.raises(ValueError, match=pattern):
        capture._check_setup((), (_fdp(**options),), 3)


def test_fused_data_parallel_inside_no_sync_is_refused(gloo_world):
    model = _fdp()
    with model.no_sync(), pytest.raises(ValueError, match=r"in no_sync\(\), driven by LocalSGD or sharded"):
        capture._check_setup((), (model,), 3)


def test_fused_data_parallel_overlapping_its_optimizer_step_is_refused(gloo_world):
    model = _fdp()
    model.overlap_step(tfuse.optim.FusedMomentum(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"overlaps its optimizer's step \(communication 'overlapped'\)"):
        capture._check_setup((), (model,), 3)
    model.overlap_step(None)
    assert model.communication == "all_reduce"


def test_a_nested_fused_data_parallel_is_named_by_its_path(gloo_world, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    outer = nn.ModuleDict({"body": _fdp()})
    capture._check_setup((), (outer,), 3)  # NCCL serves CUDA tensors: accepted
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(ValueError, match="FusedDataParallel 'body' all-reduces"):
        capture._check_setup((), (outer,), 3)


def test_ddp_needs_nccl_and_torchs_warm_up(gloo_world, monkeypatch):
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    with pytest.raises(ValueError, match="DistributedDataParallel needs warmup=11"):
        capture._check_setup((), (model,), 3)
    capture._check_setup((), (model,), 11)  # one rank: no collective to capture
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="DistributedDataParallel \\(DistributedDataParallel\\) all-reduces gradients "
                                         "with the gloo backend"):  # fmt: skip
        capture._check_setup((), (model,), 11)


def test_sync_batch_norm_across_gloo_ranks_is_refused(gloo_world, monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    capture._check_setup((), (model,), 3)  # one rank: no statistics to all-gather
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="SyncBatchNorm layer '1' \\(SyncBatchNorm\\) all-gathers statistics with the "
                                         "gloo backend"):  # fmt: skip
        capture._check_setup((), (model,), 3)
    model.eval()
    capture._check_setup((), (model,), 3)


# ------------------------------------------------------------------------------------------ pieces of the capture


def test_the_warm_up_meets_every_module_and_optimizer_the_step_runs():
    model, optimizer = _linear_setup(capturable=False)
    net = nn.Sequential(model, nn.ReLU())
    met = {}
    capture._warm_up(_step(net, optimizer), (torch.randn(2, 4),), 2, met)
    assert list(met.values()) == [net, model, net[1], optimizer]
    assert len(optimizer.state) == 2  # the steps ran
    with pytest.raises(ValueError, match="FusedMomentum was built with capturable=False"):  # then checked
        capture._check_setup([x for x in met.values() if isinstance(x, torch.optim.Optimizer)], (), 3)
    other = nn.Linear(4, 4)
    other(torch.randn(2, 4))  # the hooks are gone afterwards
    optimizer.step()
    assert len(met) == 4


def test_a_step_must_return_tensors():
    out = torch.ones(2, requires_grad=True) * 2
    Pair = collections.namedtuple("Pair", "loss extra")
    detached = capture._detached((out, [out, None], {"a": out}, Pair(out, out)))
    assert not detached[0].requires_grad and not detached[1][0].requires_grad and detached[1][1] is None
    assert isinstance(detached[3], Pair) and not detached[3].extra.requires_grad and not detached[2]["a"].requires_grad
    with pytest.raises(TypeError, match=r"step_fn's result\[1\] is a float.*loss.item\(\)"):
        capture._detached((out, 0.5))


def test_copies_from_host_memory_are_refused_while_capturing():
    # The meta device stands in for the GPU: the guard looks at copies into its device type from the CPU.
    with capture._NoHostCopies("meta"):
        with pytest.raises(RuntimeError, match=r"copies a \[3\] torch.float32 tensor from host memory to the meta"):
            torch.ones(3).to("meta")
        with pytest.raises(RuntimeError, match="from host memory"):
            torch.empty(2, device="meta").copy_(torch.ones(2))
        torch.empty(3, device="meta").add(1).to(torch.float16)  # on the device: fine
        torch.ones(3).to(torch.float64).copy_(torch.zeros(3))  # on the host: fine


class _FakeGraph:
    """What CapturedStep uses of a torch.cuda.CUDAGraph, to test the step's own checks on a CPU."""

    def __init__(self):
        self.replays = 0

    def pool(self):
        return "pool"

    def replay(self):
        self.replays += 1


def test_a_captured_step_copies_its_inputs_and_checks_them():
    graph, x, out = _FakeGraph(), torch.zeros(2, 3), torch.zeros(())
    step = CapturedStep(graph, (x,), out, (), ())
    new = torch.randn(2, 3)
    assert step(new) is out and graph.replays == 1 and torch.equal(x, new)
    assert step.replay() is out and graph.replays == 2
    with pytest.raises(TypeError, match=r"takes 1 input\(s\), as captured; got 2"):
        step(new, new)
    with pytest.raises(ValueError, match=r"input 0 must be a \[2, 3\] torch.float32 tensor, as captured, got \[3, 3\]"):
        step(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="got \\[2, 3\\] torch.float64"):
        step(torch.zeros(2, 3, dtype=torch.float64))
    assert graph.replays == 2 and step.pool == "pool"


def test_a_hyperparameter_changed_after_capture_raises_at_replay():
    model = nn.Linear(4, 3)
    lr = torch.tensor(0.1)
    optimizer = tfuse.optim.FusedMomentum(model.parameters(), lr=0.1, momentum=0.9, capturable=True)
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": lr})
    step = CapturedStep(_FakeGraph(), (), None, (optimizer,), (model,))
    step()
    optimizer.param_groups[0]["lr"] = float("0.1")  # an equal float: still what was captured
    lr.fill_(0.5)  # a tensor changed in place: the graph reads it
    step()
    optimizer.param_groups[0]["lr"] = 0.05
    with pytest.raises(RuntimeError, match=r"FusedMomentum param group 0: 'lr' is 0.05 since capture \(captured: 0.1\)"
                                           r".*tensor on the GPU.*fill_"):  # fmt: skip
        step()
    optimizer.param_groups[0]["lr"] = 0.1
    optimizer.param_groups[1]["lr"] = torch.tensor(0.5)
    with pytest.raises(RuntimeError, match="param group 1: 'lr' is another tensor since capture"):
        step()
    optimizer.param_groups[1]["lr"] = lr
    optimizer.param_groups[0]["momentum"] = 0.5
    with pytest.raises(RuntimeError, match="'momentum' is 0.5"):
        step.replay()
    optimizer.param_groups[0]["momentum"] = 0.9
    step()
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    with pytest.raises(RuntimeError, match=r"FusedMomentum's param groups changed \(load_state_dict\?\)"):
        step()


# ------------------------------------------------------------------------------------------ GPU
# A CUDA graph needs a GPU; nothing here can stand in for one (the CPU tests above cover every check that runs before
# capturing). These run whenever CUDA is present.

needs_gpu = pytest.mark.skipif(not ON_CUDA, reason="capturing a CUDA graph needs a GPU")
STEPS = 5


def _make_train_step(model, optimizer, amp_dtype, scaler=None):
    def train_step(x, y):
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=amp_dtype):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        tfuse.optim.clip_grad_norm_(optimizer, 1.0)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return train_step


def _batches(count, device):
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 16, 16, generator=generator).to(device).contiguous(memory_format=torch.channels_last),
         torch.randint(0, 5, (8,), generator=generator).to(device))
        for _ in range(count)
    ]  # fmt: skip


def _build(base, optimizer_name, example, amp_dtype, use_scaler, **options):
    model = copy.deepcopy(base)
    lr = torch.tensor(0.05 if optimizer_name == "momentum" else 1e-3, device="cuda")
    made = tfuse.setup(model, optimizer_name, example_inputs=(example,), lr=lr, capturable=True, **options)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8) if use_scaler else None
    return made.model, made.optimizer, lr, scaler, _make_train_step(made.model, made.optimizer, amp_dtype, scaler)


def _compare_captured_with_eager(optimizer_name, amp_dtype, use_scaler, exact, **options):
    """Replays STEPS steps and runs the same steps eagerly from the same state; returns the two models."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = ResNetish().to(device).to(memory_format=torch.channels_last).train()
    batches = _batches(capture.MIN_WARMUP + STEPS, device)
    example = batches[0][0]
    eager = _build(base, optimizer_name, example, amp_dtype, use_scaler, **options)
    graphed = _build(base, optimizer_name, example, amp_dtype, use_scaler, **options)
    assert any(isinstance(m, tfuse.nn.FusedBatchNormAct2d) for m in graphed[0].modules())

    step = capture_step(graphed[4], *batches[0], optimizers=graphed[1], models=graphed[0])
    for _ in range(capture.MIN_WARMUP):  # what capture_step's warm-up did to the graphed copy
        eager[4](*batches[0])
    eager_losses, graph_losses = [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # neither the replays nor the eager capturable steps may sync
    try:
        for index, (x, y) in enumerate(batches[capture.MIN_WARMUP :]):
            if index == 2:  # a scheduler's change, in place: the graph reads the lr tensor
                eager[2].mul_(0.5)
                graphed[2].mul_(0.5)
            graph_losses.append(step(x, y).clone())
            eager_losses.append(eager[4](x, y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    pairs = [(f"loss {i}", ours, theirs) for i, (ours, theirs) in enumerate(zip(graph_losses, eager_losses))]
    pairs += [(name, ours, theirs) for (name, ours), theirs in zip(*_model_and_optimizer_tensors(graphed, eager))]
    for name, ours, theirs in pairs:
        if exact:
            difference = (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0
            assert torch.equal(ours, theirs), f"{name}: not bit for bit, max |difference| {difference:.3g}"
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")
    assert all(torch.isfinite(loss).all() for loss in graph_losses)
    return graphed, eager


def _model_and_optimizer_tensors(graphed, eager):
    """(name, tensor) of both runs' parameters, buffers and optimizer state, in the same order."""

    def tensors(made):
        model, optimizer = made[0], made[1]
        found = list(model.state_dict().items())
        for index, (param, state) in enumerate(zip(model.parameters(), map(optimizer.state.get, model.parameters()))):
            found += [(f"state {index} {key}", value) for key, value in (state or {}).items() if torch.is_tensor(value)]
        return found

    ours, theirs = tensors(graphed), tensors(eager)
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    return ours, [tensor for _, tensor in theirs]


@needs_gpu
@pytest.mark.parametrize(
    "optimizer_name,amp_dtype,use_scaler",
    [("momentum", torch.bfloat16, False), ("adam", torch.bfloat16, False), ("adam", torch.float16, True)],
    ids=["FusedMomentum-bf16", "FusedAdam-bf16", "FusedAdam-fp16-GradScaler"],
)
def test_a_captured_cnn_step_replays_the_eager_steps_bit_for_bit(monkeypatch, optimizer_name, amp_dtype, use_scaler):
    # Every kernel of the step is deterministic here: tfuse's batch norm, clip and optimizer kernels reduce in a fixed
    # order, cuBLAS GEMMs and torch's reductions (cross entropy, mean) are run-to-run deterministic on one GPU, and
    # cuDNN is restricted to deterministic convolution algorithms (its default may pick backward-weight algorithms
    # that accumulate with atomics). So the replays must equal the eager steps bit for bit.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    _compare_captured_with_eager(optimizer_name, amp_dtype, use_scaler, exact=True)


@needs_gpu
def test_a_captured_step_with_autotuned_convolutions_stays_close_to_eager(monkeypatch):
    # cuDNN's autotuner may pick convolution algorithms whose weight gradient accumulates with atomics (another order
    # of float32 sums at every run): replays and eager steps then differ by rounding. A float32 difference of ~1e-7
    # can flip the bf16 rounding of an activation (0.4% of that element), so after 5 steps (lr 0.05, gradients
    # clipped to norm 1) the bound is rtol 1e-2 / atol 1e-3 on the losses, parameters, buffers and optimizer state.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    _compare_captured_with_eager("momentum", torch.bfloat16, False, exact=False)


@needs_gpu
def test_a_captured_step_of_fused_data_parallel_on_one_nccl_rank_equals_eager(monkeypatch, tmp_path):
    # One rank of NCCL: the reducer's bucket all-reduces and the buffer broadcasts are captured as NCCL kernels (a copy
    # with one rank); the sum of one rank is exact, so the bit-for-bit comparison holds as without FusedDataParallel.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        graphed, eager = _compare_captured_with_eager("momentum", torch.bfloat16, False, exact=True)
        assert isinstance(graphed[0], FusedDataParallel) and isinstance(eager[0], FusedDataParallel)
    finally:
        dist.destroy_process_group()


def _tiny_cuda_setup():
    model = nn.Sequential(nn.Linear(8, 8), tfuse.nn.FusedBatchNormAct1d(8, act="relu"), nn.Linear(8, 2)).cuda()
    optimizer = tfuse.optim.FusedMomentum(model.parameters(), lr=torch.tensor(0.1, device="cuda"), capturable=True)
    return model, optimizer, torch.randn(16, 8, device="cuda")


@needs_gpu
def test_a_host_sync_in_the_step_is_refused_before_capture():
    model, optimizer, x = _tiny_cuda_setup()

    def step(x):
        loss = _step(model, optimizer)(x)
        return loss * 0 + loss.item()  # .item(): a sync

    with pytest.raises(RuntimeError, match=r"(?s)synchronizes the host with the GPU in the last warm-up step.*\.item"):
        capture_step(step, x, optimizers=optimizer, models=model)
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


@needs_gpu
def test_a_copy_from_host_memory_in_the_step_is_refused():
    model, optimizer, x = _tiny_cuda_setup()
    scale = torch.full((1,), 2.0).pin_memory()  # a pinned copy does not sync: only the capture guard sees it

    def step(x):
        return _step(model, optimizer)(x * scale.to("cuda", non_blocking=True))

    with pytest.raises(RuntimeError, match=r"copies a \[1\] torch.float32 tensor from host memory to the cuda device"):
        capture_step(step, x, optimizers=optimizer, models=model)


@needs_gpu
def test_a_batch_norm_met_in_the_warm_up_is_checked_before_capture():
    model, optimizer, x = _tiny_cuda_setup()
    model[1].momentum = None
    # Not passed as models=: found by the warm-up's hooks, refused before the checked step and the capture.
    with pytest.raises(ValueError, match=r"batch norm layer '1' \(FusedBatchNormAct1d\) has momentum=None"):
        capture_step(_step(model, optimizer), x, optimizers=optimizer)


@needs_gpu
def test_a_float_lr_changed_after_capture_raises_and_a_replay_keeps_its_outputs():
    model = nn.Linear(8, 2).cuda()
    optimizer = tfuse.optim.FusedSGD(model.parameters(), lr=0.1, capturable=True)
    x = torch.randn(4, 8, device="cuda")
    step = capture_step(_step(model, optimizer), x, optimizers=optimizer)
    first = step(torch.randn(4, 8, device="cuda"))
    assert step(torch.randn(4, 8, device="cuda")) is first  # the same static output, overwritten
    optimizer.param_groups[0]["lr"] = 0.01
    with pytest.raises(RuntimeError, match=r"'lr' is 0.01 since capture \(captured: 0.1\)"):
        step(x)
