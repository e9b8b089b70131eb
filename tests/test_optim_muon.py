"""FusedMuon beyond the shared trajectory suites: float64 iterations against the algorithm written out in float64
(convolution, channels_last, transposed and 3-D weights), the batched orthogonalisation and the launches per step,
state dicts to and from torch.optim.Muon, the AdamW groups, and errors in torch's words."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tfuse
from optim_helpers import muon_param_slacks, saved
from tfuse.optim import FusedMuon

COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_float64(matrix: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Keller Jordan's Muon, in float64, on the wide orientation."""
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(float(x.norm()), eps)
    a, b, c = COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class ReferenceMuonFloat64:
    """Muon from its definition, one parameter at a time: momentum and Nesterov as torch.optim.Muon's lerps, the
    matrix (size(0), -1) of an N-D weight, the lr adjustment of that shape, decoupled weight decay."""

    def __init__(self, params, lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn=None, eps=1e-7):
        self.params, self.lr, self.wd, self.mu, self.nesterov = list(params), lr, weight_decay, momentum, nesterov
        self.steps, self.fn, self.eps = ns_steps, adjust_lr_fn, eps
        self.buffers = [torch.zeros(p.shape[0], p.numel() // p.shape[0], dtype=torch.float64) for p in self.params]

    @torch.no_grad()
    def step(self):
        for param, buffer in zip(self.params, self.buffers):
            grad = param.grad.reshape(buffer.shape).double()
            buffer.mul_(self.mu).add_((1 - self.mu) * grad)
            update = (1 - self.mu) * grad + self.mu * buffer if self.nesterov else buffer
            rows, cols = buffer.shape
            ratio = 0.2 * math.sqrt(max(rows, cols)) if self.fn == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
            moved = param.double().reshape(buffer.shape) * (1 - self.lr * self.wd)
            moved -= self.lr * ratio * newton_schulz_float64(update, self.steps, self.eps)
            param.copy_(moved.reshape(param.shape))


class Matrices(nn.Module):
    """A channels_last convolution, a Conv1d (3-D weight), a Linear, and a transposed weight (first dimension
    innermost in memory), all without biases: every parameter is a matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False).to(memory_format=torch.channels_last)
        self.conv1d = nn.Conv1d(4, 5, 2, bias=False)
        self.linear = nn.Linear(5 * 3, 6, bias=False)
        self.transposed = nn.Parameter(torch.randn(3, 6).t())  # (6, 3) with strides (1, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(2)  # (N, 4, 16)
        h = torch.tanh(self.conv1d(h))[:, :, :3].flatten(1)  # (N, 15)
        return torch.tanh(self.linear(h)) @ self.transposed


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("options", [dict(nesterov=True), dict(nesterov=False, adjust_lr_fn="match_rms_adamw")],
                         ids=["nesterov", "plain-match_rms_adamw"])
def test_float64_iterations_follow_the_algorithm_for_every_weight_layout(options, backend, device):
    """ns_dtype=float64 leaves nothing to rounding: every step equals the float64 algorithm within 1e-10,
    whatever the weight's rank and memory layout (its matrix is read in memory order, permuted or transposed)."""
    torch.manual_seed(0)
    model = Matrices().to(device=device, dtype=torch.float64)
    reference = Matrices().to(device=device, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    assert model.transposed.stride() == (1, 6) and model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    hyper = dict(lr=0.05, weight_decay=0.1, momentum=0.9, ns_steps=6, **options)
    fused = FusedMuon(model.parameters(), ns_dtype=torch.float64, **hyper)
    expected = ReferenceMuonFloat64(reference.parameters(), nesterov=hyper.pop("nesterov"), **hyper)
    with tfuse.use_backend(backend):
        for _ in range(4):
            x = torch.randn(2, 3, 6, 6, device=device, dtype=torch.float64)
            for net, opt in ((model, fused), (reference, expected)):
                for p in net.parameters():
                    p.grad = None
                net(x).pow(2).sum().backward()
            fused.step()
            expected.step()
            for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert model.transposed.stride() == (1, 6)  # the layouts are kept


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_iterations_are_batched_per_shape_and_the_launches_per_buffer(backend, device):
    """Eight matrices of two shapes: three batched matmuls per iteration per shape, not per matrix (torch.optim.Muon
    runs three per matrix); two Triton launches for the Muon buffer and one for the AdamW buffer (the biases)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)], *[nn.Linear(8, 8, bias=False) for _ in range(3)]).to(device)
    model[5] = nn.Linear(8, 4, bias=False).to(device)
    model[6] = nn.Linear(4, 8, bias=False).to(device)
    optimizer = FusedMuon(model.parameters(), lr=0.02, ns_steps=5)
    model(torch.randn(3, 8, device=device)).sum().backward()
    with tfuse.use_backend(backend):
        text = optimizer.describe()
        with tfuse.count_launches() as launches, _CountMatmuls() as matmuls:
            optimizer.step()
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    assert len(shapes) == 3  # (8, 8) x6, (4, 8), (8, 4)
    assert matmuls.counts == {"bmm": 5 * len(shapes), "baddbmm": 2 * 5 * len(shapes)}
    if backend == "triton":
        assert launches.by_kernel == {"_muon_momentum_kernel": 1, "_muon_apply_kernel": 1, "_adam_kernel": 1}
        assert "3 Triton launches per step" in text and "batched matmuls per matrix shape" in text
    else:
        assert launches.total == 0 and "_foreach_lerp" in text and "torch._fused_adamw_" in text


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_state_dicts_move_to_and_from_torch_muon_and_training_goes_on_alike(backend, device):
    """On 2-D weights FusedMuon's state dict is torch.optim.Muon's: loaded either way through a checkpoint file,
    both continue on the same trajectory (within the bfloat16 iterations' rounding, see muon_param_slacks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 4, bias=False)).to(device)
    reference = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 4, bias=False)).to(device)
    reference.load_state_dict(model.state_dict())
    options = dict(lr=0.02, weight_decay=0.05, momentum=0.9)
    fused = FusedMuon(model.parameters(), **options)

    def step(net, opt, x):
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        opt.step()

    with tfuse.use_backend(backend):
        for _ in range(2):
            step(model, fused, torch.randn(3, 6, device=device))
        ours = saved(fused.state_dict())
        assert sorted(ours["state"][0]) == ["momentum_buffer"] and ours["param_groups"][0]["use_muon"] is True
        torch_opt = torch.optim.Muon(reference.parameters(), **options)
        reference.load_state_dict(model.state_dict())
        torch_opt.load_state_dict(ours)  # tfuse -> torch
        again = FusedMuon(model.parameters(), lr=1.0)
        again.load_state_dict(saved(torch_opt.state_dict()))  # torch -> tfuse (hyperparameters included)
        assert again.param_groups[0]["lr"] == 0.02 and again.param_groups[0]["use_muon"] is True
        for steps in range(1, 4):
            x = torch.randn(3, 6, device=device)
            step(model, again, x)
            step(reference, torch_opt, x)
            slacks = muon_param_slacks(model, again, steps)
            for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=slacks[name])
                torch.testing.assert_close(again.state[mine]["momentum_buffer"], torch_opt.state[theirs]["momentum_buffer"],
                                           rtol=1e-4, atol=1e-6)


def test_groups_split_into_muon_and_adamw_as_people_use_muon():
    """A group without use_muon: matrices to Muon with its options, the rest to AdamW with the adamw_* options;
    use_muon=False (an embedding or a head): AdamW with the group's own lr, betas, eps and weight_decay."""
    embedding, body = nn.Embedding(10, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = FusedMuon([{"params": body.parameters(), "lr": 0.05},
                           {"params": embedding.parameters(), "use_muon": False, "lr": 1e-3, "betas": (0.8, 0.9)}],
                          lr=0.02, adamw_lr=3e-3, adamw_weight_decay=0.01)
    kinds = [(len(g["params"]), g["use_muon"], g["lr"]) for g in optimizer.param_groups]
    assert kinds == [(1, True, 0.05), (3, False, 3e-3), (1, False, 1e-3)]
    side, embedding_group = optimizer.param_groups[1:]
    assert (side["betas"], side["eps"], side["weight_decay"]) == ((0.9, 0.95), 1e-10, 0.01)
    assert (embedding_group["betas"], embedding_group["weight_decay"]) == ((0.8, 0.9), 0.01)  # (adamw_weight_decay)
    head = nn.Linear(4, 3)
    optimizer.add_param_group({"params": head.parameters()})  # split as well
    assert [(len(g["params"]), g["use_muon"]) for g in optimizer.param_groups[3:]] == [(1, True), (1, False)]
    body(embedding(torch.tensor([1, 2]))).sum().backward()
    head(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert sorted(optimizer.state[embedding.weight]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sorted(optimizer.state[head.weight]) == ["momentum_buffer"]
    names = FusedMuon([{"params": [body[0].weight, body[0].bias], "param_names": ["w", "b"]}])
    assert [g["param_names"] for g in names.param_groups] == [["w"], ["b"]]
    named = FusedMuon(body.named_parameters())  # torch's (name, parameter) pairs split as well
    assert [(g["param_names"], g["use_muon"]) for g in named.param_groups] == [
        (["0.weight"], True), (["0.bias", "1.weight", "1.bias"], False)]


def test_bad_arguments_are_refused_in_torchs_words():
    layer = nn.Linear(3, 2, bias=False)
    for options in (dict(lr=-1.0), dict(momentum=-0.5), dict(weight_decay=-0.1), dict(adjust_lr_fn="cosine")):
        with pytest.raises(ValueError) as theirs:
            torch.optim.Muon(layer.parameters(), **options)
        with pytest.raises(ValueError, match=str(theirs.value)):
            FusedMuon(layer.parameters(), **options)
    # torch checks these only when it steps; FusedMuon when it is built, in torch's words.
    with pytest.raises(ValueError, match="Number of steps must be less than 100"):
        FusedMuon(layer.parameters(), ns_steps=100)
    with pytest.raises(ValueError, match="Coefficients must be a tuple of exactly 3 values"):
        FusedMuon(layer.parameters(), ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters .* size: torch.Size\(\[2\]\).*use_muon=False"):
        FusedMuon([{"params": nn.Linear(3, 2).parameters(), "use_muon": True}])
    odd = nn.Parameter(torch.randn(4, 3, 2, 5).permute(1, 0, 2, 3))  # first dimension neither outer- nor innermost
    with pytest.raises(ValueError, match=r"first dimension outermost or innermost .* shape \(3, 4, 2, 5\)"):
        FusedMuon([odd])
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        FusedMuon(layer.parameters(), adamw_betas=(0.9, 1.5))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_both_kinds_in_one_flat_buffer_share_one_state_and_step_as_apart(backend, device):
    """Matrices and biases coalesced together (as FusedDataParallel and tfuse.setup leave them): one FlatState,
    Muon's momentum in the elements of exp_avg no bias uses (two state buffers, as AdamW), and the trajectory of
    an optimizer whose kinds live apart, through a freeze and unfreeze that lays the buffer out again."""
    from tfuse.flat import FlatParams

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).to(device)

    shared_model, apart_model = net(), net()
    flat = FlatParams(shared_model.parameters())  # held: the optimizer takes the parameters' buffer
    layout = flat.layout_version
    shared, apart = FusedMuon(shared_model.parameters(), lr=0.02), FusedMuon(apart_model.parameters(), lr=0.02)
    assert len(shared.flat_params) == 1 and len(apart.flat_params) == 2 and "in 1 flat buffer" in shared.describe()
    state = shared.spans[0].state
    assert all(span.state is state for span in shared.spans)
    with tfuse.use_backend(backend):
        for step in range(5):
            frozen = step == 2
            for model in (shared_model, apart_model):
                model[4].requires_grad_(not frozen)  # a layout change and back
            x = torch.randn(4, 6, device=device)
            for model, optimizer in ((shared_model, shared), (apart_model, apart)):
                optimizer.zero_grad()
                model(x).pow(2).sum().backward()
                optimizer.step()
            for mine, theirs in zip(shared_model.parameters(), apart_model.parameters()):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert flat.layout_version > layout  # (the freeze laid the buffer out again: the shared state followed once)
    state = shared.spans[0].state
    assert all(span.state is state for span in shared.spans)
    assert sorted(state.buffers) == ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    assert state.buffers["momentum_buffer"] is state.buffers["exp_avg"]
    for mine, theirs in zip(shared_model.parameters(), apart_model.parameters()):
        for key, value in apart.state[theirs].items():
            torch.testing.assert_close(shared.state[mine][key], value, rtol=0, atol=0)
