"""What fuse_model must keep for any model: the original untouched, the same keys and parameters, the same
computation in train and eval mode and across switches between them, whichever mode it was fused in."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

import tfuse
from fusion_models import double


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Every tensor of ``model`` (parameters and buffers, persistent or not) cloned, and each module's
    attribute names, class and mode."""
    tensors = {
        name: t.detach().clone()
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    }
    modules = {
        name: (type(m), tuple(sorted(vars(m))), m.training) for name, m in model.named_modules(remove_duplicate=False)
    }
    return {"tensors": tensors, "modules": modules}


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    """``model`` is as ``before`` saw it: every tensor bitwise, the same modules and attributes, no tracer
    Proxy left anywhere in its attributes."""
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert list(after["tensors"]) == list(before["tensors"])
    for name, tensor in before["tensors"].items():
        assert after["tensors"][name].dtype == tensor.dtype and torch.equal(after["tensors"][name], tensor), name
    for name, module in model.named_modules():
        assert not _holds_proxy(vars(module)), f"{name or 'the model'} holds a torch.fx Proxy"


def _holds_proxy(value: Any, depth: int = 0) -> bool:
    if isinstance(value, fx.Proxy):
        return True
    if depth > 3 or isinstance(value, nn.Module):
        return False
    if isinstance(value, dict):
        return any(_holds_proxy(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_holds_proxy(v, depth + 1) for v in value)
    return False


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _flat(value[k])]
    return []


def assert_same_over_modes(original: nn.Module, fused: nn.Module, shape, modes=("train", "eval", "train", "eval"),
                           rtol: float = 1e-10, atol: float = 1e-12, device: torch.device | str = "cpu"):
    """Deep copies of both, called in each mode in turn (same random numbers): the same outputs, input and
    parameter gradients, and buffers after each call, within float64 rounding (``rtol``/``atol`` for the
    outputs and buffers, ten times them for gradients)."""
    reference, candidate = copy.deepcopy(original), copy.deepcopy(fused)
    for step, mode in enumerate(modes):
        reference.train(mode == "train")
        candidate.train(mode == "train")
        x = torch.randn(shape, dtype=torch.float64, device=device)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outputs = []
        for net, xi in zip((reference, candidate), xs):
            net.zero_grad(set_to_none=True)
            torch.manual_seed(1000 + step)  # the same dropout / drop-path draws in both
            outputs.append(_flat(net(xi)))
        assert len(outputs[0]) == len(outputs[1]), (mode, step)
        for ours, theirs in zip(outputs[1], outputs[0]):
            torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol, msg=lambda m, s=step: f"{mode} {s}: {m}")
        weights = [torch.randn_like(t) for t in outputs[0]]
        for out in outputs:
            sum((o * w).sum() for o, w in zip(out, weights)).backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=10 * rtol, atol=10 * atol)
        theirs = dict(reference.named_parameters())
        for name, param in candidate.named_parameters():
            if theirs[name].grad is None:
                assert param.grad is None or not param.grad.any(), name
                continue
            torch.testing.assert_close(param.grad, theirs[name].grad, rtol=10 * rtol, atol=10 * atol,
                                       msg=lambda m, n=name, s=step: f"{mode} {s} {n}: {m}")
        theirs = dict(reference.named_buffers())
        for name, buffer in candidate.named_buffers():
            if name in theirs:
                torch.testing.assert_close(buffer, theirs[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_fuse_invariants(make, shape, *, fuse_in: str = "train", example: bool = False, strategy=None,
                           rtol: float = 1e-10, atol: float = 1e-12, prepare=double, device="cpu"):
    """fuse_model on ``prepare(make())`` (float64) in mode ``fuse_in``: every invariant; returns (model, fused,
    report)."""
    model = prepare(make()).train(fuse_in == "train")
    before = snapshot(model)
    example_inputs = torch.randn(shape, dtype=torch.float64, device=device) if example else None
    fused, report = tfuse.fuse_model(model, strategy, example_inputs)
    assert_untouched(model, before)
    if not report.fused:
        assert fused is model and "nothing fused" in report.note
    # Checkpoints and optimizer state dicts are positional: the same keys, the same parameters, in order.
    assert list(fused.state_dict()) == list(model.state_dict())
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(fused.parameters(), model.parameters(), strict=True))
    # (The tracer's constants, tensors the forward creates, are non-persistent buffers of the fused model.)
    ours = [n for n, _ in fused.named_buffers() if not n.startswith("_tensor_constant")]
    assert ours == [n for n, _ in model.named_buffers()]
    copy.deepcopy(fused).load_state_dict(model.state_dict())
    copy.deepcopy(model).load_state_dict(fused.state_dict())
    assert_same_over_modes(model, fused, shape, rtol=rtol, atol=atol, device=device)
    return model, fused, report
