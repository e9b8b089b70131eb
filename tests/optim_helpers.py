"""A small model with the awkward cases, and a side-by-side driver against torch.optim."""

from __future__ import annotations

import copy
import functools
import io
import math
from collections.abc import Callable

import torch
from torch import nn

# Tolerances of a fused step against torch.optim's, per parameter dtype. float64:
# both sides compute in float64, so only the order of a few operations differs.
# float32: the kernel computes in float32 like torch, with a different order of
# operations (and torch's fused CPU kernel vectorizes differently), so a few ulps.
# That holds where the step is well conditioned; run_side_by_side keeps the data
# away from the one place it is not (see steer_clear_of_cancellation).
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-6, atol=2e-7)}
LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.cache
def _torch_has_fused(torch_cls: type, device_type: str) -> bool:
    parameter = nn.Parameter(torch.zeros(1, device=device_type))
    parameter.grad = torch.ones(1, device=device_type)
    try:
        torch_cls([parameter], fused=True).step()
    except RuntimeError:  # e.g. torch's Adagrad has no fused CUDA kernel ("fused=True requires ... devices")
        return False
    return True


def torch_path_reference(torch_cls: type, device: torch.device) -> dict:
    """The torch.optim implementation that tfuse's PyTorch path runs on ``device``: torch's fused kernel where
    torch has one for the class on that device, else its foreach ops (as the path falls back)."""
    return dict(fused=True) if _torch_has_fused(torch_cls, device.type) else dict(foreach=True)


def assert_rounded_from(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg,
                        slack: torch.Tensor | None = None) -> None:
    """``actual`` (in ``dtype``) is float32 ``expected`` rounded to ``dtype``, one ulp either way.

    Plus float32 rounding on the tensor's scale: where the update cancels (``0.7 g + 0.3 m`` close to
    zero), two float32 evaluations in different orders differ by an ulp of the operands, which is
    all of a tiny result. ``slack``: a per-element bound added where the computation itself amplifies
    float32 rounding (see adam_cancellation_slack).
    """
    finfo = torch.finfo(dtype)
    atol = max(finfo.smallest_normal * finfo.eps, 4 * torch.finfo(torch.float32).eps * float(expected.abs().max()))
    if slack is None:
        torch.testing.assert_close(actual, expected.to(dtype), rtol=finfo.eps, atol=atol, msg=msg)
        return
    target = expected.to(dtype).float()
    allowed = finfo.eps * target.abs() + atol + slack
    error = (actual.float() - target).abs()
    bad = error > allowed
    assert not bad.any(), msg(f"{int(bad.sum())} of {bad.numel()} elements beyond their bound; worst error "
                              f"{float(error.max()):.3e}")


def adam_cancellation_slack(options: dict, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """Per element, how far two correct float32 evaluations of an Adam step with L2 weight decay may differ.

    The step adds ``weight_decay * p`` to the gradient; where that sum cancels to below ``eps`` (g close to
    -wd p), its float32 rounding (one rounding with a fused multiply-add, as torch's CPU kernel; two without,
    as Triton's interpreter) is amplified by d(update)/dg = lr eps / (|g| + eps)^2, up to lr / eps = 1e6.
    Elsewhere the bound is negligible. None where the step adds no weight decay to the gradient.
    """
    decay = float(options.get("weight_decay", 0.0))
    if decay == 0.0 or options.get("decoupled_weight_decay"):
        return None
    lr, eps = float(options.get("lr", 1e-3)), float(options.get("eps", 1e-8))
    p, g = param.detach().double(), grad.detach().double()
    rounding = 2 * torch.finfo(torch.float32).eps * (g.abs() + decay * p.abs())
    return (lr * eps / ((g + decay * p).abs() + eps) ** 2 * rounding).float()


def lion_sign_slack(group: dict, grad: torch.Tensor, exp_avg: torch.Tensor | None) -> torch.Tensor:
    """Per element, how far two correct float32 evaluations of a Lion step may differ: 2 lr where the direction
    c = b1 m + (1 - b1) g is zero within its own float32 rounding (its sign, the whole update, is then not
    determined: low-precision m and g often cancel exactly in one evaluation and not in another), else 0.
    ``group``: the parameter's group (its lr, betas and maximize)."""
    lr, beta1 = float(group["lr"]), float(group["betas"][0])
    g = grad.detach().double() * (-1.0 if group["maximize"] else 1.0)
    m = torch.zeros_like(g) if exp_avg is None else exp_avg.detach().double()
    direction = beta1 * m + (1 - beta1) * g
    rounding = 4 * torch.finfo(torch.float32).eps * (beta1 * m.abs() + (1 - beta1) * g.abs())
    return ((direction.abs() <= rounding).double() * 2 * lr).float()


def muon_ns_slack(group: dict, param: torch.Tensor) -> float | None:
    """How far two correct evaluations of one Muon step may move a parameter apart: the Newton-Schulz iterations
    run in bfloat16 (torch.optim.Muon's choice), where an input one float32 ulp apart (another, equally correct
    evaluation of the momentum) or another matmul kernel (torch's CPU mm and bmm round some tiny bfloat16 products
    differently) changes entries of O by a few bfloat16 ulps. O's entries are below 2 (its singular values are
    about 1), so ``lr * ratio * 2**-4`` (8 ulps of 1) bounds it; a wrong update (ratio, momentum, decay) moves the
    parameter by ``lr * ratio * |O|``, many times more. None for AdamW groups and float32/float64 iterations."""
    if not group.get("use_muon") or group.get("ns_dtype", torch.bfloat16) not in LOW_PRECISION:
        return None
    rows = param.shape[0]
    cols = param.numel() // rows
    if group.get("adjust_lr_fn") == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = math.sqrt(max(1.0, rows / cols))
    return float(group["lr"]) * ratio * 2**-4


def muon_param_slacks(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> dict[str, float]:
    """:func:`muon_ns_slack` of each Muon parameter of ``model``, by name, after ``steps`` steps (empty for other
    optimizers). With the same gradients on both sides the differences of the steps only add up."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    slacks = {}
    for name, param in model.named_parameters():
        slack = muon_ns_slack(group_of[id(param)], param) if id(param) in group_of else None
        if slack is not None:
            slacks[name] = steps * slack
    return slacks


class Net(nn.Module):
    """Odd sizes, a zero-dim parameter, and an auxiliary head used only on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.second = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.aux = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        hidden = self.second(torch.tanh(self.first(x))) * self.scale
        if use_aux:
            hidden = torch.cat([hidden, self.aux(hidden)], dim=1)
        return hidden


def make_pair(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[Net, Net]:
    model = Net().to(device=device, dtype=dtype)
    return model, copy.deepcopy(model)


def groups_of(model: Net, options: dict, two_groups: bool) -> list[dict]:
    """Parameter groups: all in one, or two with different hyperparameters."""
    if not two_groups:
        return [dict(params=list(model.parameters()))]
    first = [model.first.weight, model.first.bias, model.scale]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    overrides = {"lr": options.get("lr", 1e-2) * 3}
    if "weight_decay" in options:
        overrides["weight_decay"] = 0.0
    return [dict(params=first, **overrides), dict(params=rest)]


def backward(model: Net, x: torch.Tensor, step: int, sign: float = 1.0) -> None:
    """The loss is negated for ``maximize=True`` runs, so they converge too (a diverging
    trajectory would amplify rounding differences until no tolerance means anything)."""
    (model(x, use_aux=step % 2 == 0).pow(2).mean() * sign).backward()


def assert_same_state(fused: torch.optim.Optimizer, reference: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Per-parameter state of the two optimizers, key by key, after mapping parameters in order."""
    ours = [p for g in fused.param_groups for p in g["params"]]
    theirs = [p for g in reference.param_groups for p in g["params"]]
    for index, (mine, other) in enumerate(zip(ours, theirs)):
        mine_state = {k: v for k, v in fused.state.get(mine, {}).items() if k != "master_param"}
        other_state = reference.state.get(other, {})
        assert sorted(mine_state) == sorted(k for k, v in other_state.items() if v is not None), index
        for key, value in other_state.items():
            if value is None:
                continue
            if key == "step":
                assert float(mine_state[key]) == float(value), (index, key)
            else:
                torch.testing.assert_close(mine_state[key], value, **TOLERANCE[dtype], msg=lambda m, i=index, k=key: f"param {i} {k}: {m}")


def assert_same_params(model: nn.Module, reference: nn.Module, dtype: torch.dtype,
                       slack: dict[str, float] | None = None) -> None:
    """``slack``: an absolute bound added to the tolerance of the named parameters (see muon_ns_slack)."""
    for (name, mine), other in zip(model.named_parameters(), reference.parameters()):
        tolerance = dict(TOLERANCE[dtype])
        tolerance["atol"] += (slack or {}).get(name, 0.0)
        torch.testing.assert_close(mine, other, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def steer_clear_of_cancellation(optimizer: torch.optim.Optimizer, margin: float = 0.01) -> None:
    """Nudges gradients whose L2-decayed value ``±g + weight_decay * p`` nearly cancels.

    Where ``g`` is within ``margin`` of ``-weight_decay * p`` (relative to their size), any float32
    evaluation of the sum keeps only a few significant bits, and two correct implementations that
    round in a different order disagree in them; Adam then divides the difference by ``sqrt(v)`` of
    the same tiny value and it becomes a visible difference of the step (seen: 5e-6 on a weight of
    0.2 at lr=1e-2). That is the conditioning of the data, not a defect of either optimizer, so the
    float32 side-by-side comparisons keep the effective gradient at least ``margin`` of its operands
    away from zero; the float64 comparisons keep such elements and check them to 1e-10.
    Changes ``optimizer``'s gradients in place, before they are copied to the fused side.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and param.grad.dtype.is_floating_point:
                clear_of_cancellation(param.grad, param.detach(), group, margin)


def clear_of_cancellation(grad: torch.Tensor, param: torch.Tensor, options: dict, margin: float = 0.01) -> None:
    """The tensor-level rule of :func:`steer_clear_of_cancellation`: nudges ``grad`` in place where the
    L2-decayed gradient ``±grad + weight_decay * param`` of ``options`` (torch.optim's names) is within
    ``margin`` of its operands' size from zero. Nothing changes without (coupled) weight decay."""
    decay = float(options.get("weight_decay", 0.0))
    if decay == 0.0 or options.get("decoupled_weight_decay", False):
        return
    sign = -1.0 if options.get("maximize", False) else 1.0
    decayed = decay * param
    effective = sign * grad + decayed
    size = grad.abs() + decayed.abs()
    near = effective.abs() < margin * size
    if bool(near.any()):
        push = torch.where(effective >= 0, 1.0, -1.0) * 3 * margin * size
        grad.add_(torch.where(near, sign * push, torch.zeros_like(grad)))


def run_side_by_side(
    model: Net, reference: Net, fused: torch.optim.Optimizer, torch_opt: torch.optim.Optimizer, steps: int,
    device: torch.device, dtype: torch.dtype, before_step: Callable[[int], None] | None = None,
) -> None:
    """Same inputs, same zero_grad(set_to_none) pattern; params and state compared after every step."""
    sign = -1.0 if torch_opt.param_groups[0].get("maximize") else 1.0
    for step in range(steps):
        x = torch.randn(6, 5, device=device, dtype=dtype)
        for net, opt in ((model, fused), (reference, torch_opt)):
            opt.zero_grad(set_to_none=step % 3 != 2)
            backward(net, x, step, sign)
        # Same gradient values on both sides (the fused side's still arrived through its flat
        # views): the comparison then measures the optimizers, not the model's sensitivity.
        steer_clear_of_cancellation(torch_opt)
        for mine, other in zip(model.parameters(), reference.parameters()):
            assert (mine.grad is None) == (other.grad is None)
            if mine.grad is not None:
                mine.grad.copy_(other.grad)
        if before_step is not None:
            before_step(step)
        fused.step()
        torch_opt.step()
        assert_same_params(model, reference, dtype, muon_param_slacks(model, fused, step + 1))
        assert_same_state(fused, torch_opt, dtype)


def saved(state_dict: dict) -> dict:
    """A state dict as a checkpoint file gives it back (no tensor shared with the source)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def float32_for_loop_reference(fused: torch.optim.Optimizer, torch_cls: type, options: dict) -> tuple[list, list, torch.optim.Optimizer]:
    """torch.optim's for-loop implementation (``foreach=False``) on float32 copies of the fused
    optimizer's parameters, state (through its state dict) and gradients, as they are now.

    Returns (the fused side's parameters, their float32 copies, the torch optimizer over the copies).
    """
    params = [p for group in fused.param_groups for p in group["params"]]
    copies = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in params]
    remaining = iter(copies)
    groups = [dict(params=[next(remaining) for _ in group["params"]]) for group in fused.param_groups]
    reference = torch_cls(groups, **{**options, "foreach": False})
    reference.load_state_dict(copy.deepcopy(fused.state_dict()))  # hyperparameters and state, cast to float32 by torch
    for group in reference.param_groups:
        group["foreach"], group["fused"] = False, None  # the for-loop, whatever the fused side's group says
    for copied, param in zip(copies, params):
        copied.grad = None if param.grad is None else param.grad.float()
    return params, copies, reference


def run_low_precision_step_by_step(model: Net, fused: torch.optim.Optimizer, torch_cls: type, options: dict, steps: int,
                                   device: torch.device, dtype: torch.dtype, zero_grads: bool = True) -> None:
    """A float16/bfloat16 trajectory, every step checked against torch.optim's for-loop step in float32.

    Before each fused step, torch's for-loop optimizer (``foreach=False``) is built on float32 copies of
    the fused side's parameters, state and gradients and takes the same step; the fused parameters
    and state must then equal its results rounded to ``dtype``, within one ulp: the fused update
    computes in float32 and rounds once, as its contract says. (A whole trajectory of torch's for-loop
    run in float16 itself is no reference: it rounds every intermediate to float16, and Adam's
    eps=1e-8 underflows to zero there, so its parameters become inf where the float32 maths stay finite.)

    ``zero_grads``: every third step, ``zero_grad(set_to_none=False)`` (zero gradients, as in
    run_side_by_side). Off for Adam in float16: a zero gradient on an element whose float16
    ``exp_avg_sq`` underflowed to zero makes the update ``m / eps`` (torch's fused Adam does the
    same), the model then overflows, and NaN compared with NaN would prove nothing.
    """
    sign = -1.0 if options.get("maximize") else 1.0
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        fused.zero_grad(set_to_none=not zero_grads or step % 3 != 2)
        backward(model, torch.randn(6, 5, device=device, dtype=dtype), step, sign)
        params, copies, reference = float32_for_loop_reference(fused, torch_cls, options)
        adam = torch_cls is torch.optim.Adam  # AdamW's decay is decoupled: nothing added to the gradient
        slacks = [adam_cancellation_slack(options, c, c.grad) if adam and c.grad is not None else None for c in copies]
        if torch_cls.__name__ == "ReferenceMuon":
            group_of = {id(p): group for group in fused.param_groups for p in group["params"]}
            slacks = [muon_ns_slack(group_of[id(p)], p) for p in params]
        if torch_cls.__name__ == "ReferenceLion":
            group_of = {id(c): group for group in reference.param_groups for c in group["params"]}
            slacks = [None if c.grad is None else
                      lion_sign_slack(group_of[id(c)], c.grad, reference.state.get(c, {}).get("exp_avg")) for c in copies]
        fused.step()
        reference.step()
        for index, (param, copied) in enumerate(zip(params, copies)):
            assert_rounded_from(param.detach(), copied.detach(), dtype, msg=lambda m, i=index, s=step: f"step {s}, param {i}: {m}",
                                slack=slacks[index])
            mine = {k: v for k, v in fused.state.get(param, {}).items() if k != "master_param"}
            theirs = {k: v for k, v in reference.state.get(copied, {}).items() if v is not None}
            assert sorted(mine) == sorted(theirs), (step, index)
            for key, value in theirs.items():
                if key == "step":
                    assert float(mine[key]) == float(value), (step, index)
                else:
                    assert mine[key].dtype == dtype
                    assert_rounded_from(mine[key], value, dtype, msg=lambda m, i=index, k=key, s=step: f"step {s}, param {i} {k}: {m}")
    # The updates were large enough to show in the low-precision parameters (a no-op step would fail above).
    moved = [bool((p.detach() != s).any()) for p, s in zip(model.parameters(), start)]
    assert sum(moved) >= len(moved) - 1, moved
