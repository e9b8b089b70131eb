"""FusedAdam and FusedAdamW: torch.optim.Adam/AdamW semantics, one launch per flat buffer."""

from __future__ import annotations

from typing import Any

import torch

from tfuse.optim._checks import as_float, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim._update import ADAM, AdamStep


class FusedAdam(FlatOptimizer):
    """Adam (and AdamW with ``decoupled_weight_decay=True``) over flat buffers.

    Same constructor, update, state and ``state_dict`` format as
    ``torch.optim.Adam`` (``step``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq`` per parameter), so a state dict moves between the two
    both ways. The parameters are coalesced into flat buffers (or the
    :class:`~tfuse.flat.FlatParams` they already live in is reused) and each
    buffer is updated by one Triton launch per step, whatever the number of
    parameters, groups or parameters without a gradient. On CPU without the
    Triton interpreter, torch's fused CPU kernel runs over whole contiguous
    runs of the buffers.

    Args:
        params: parameters or parameter groups, as for torch.optim, or a
            :class:`~tfuse.flat.FlatParams` (its parameters, updated in its
            buffers; see :attr:`~tfuse.optim.FlatOptimizer.flat_params`).
        lr: learning rate, a float or a 0-dim tensor (read once per step).
        betas: coefficients of the running averages of the gradient and its
            square (both floats or both 1-element tensors, as in torch).
        eps: added to the denominator.
        weight_decay: L2 penalty (decoupled, as AdamW, when ``decoupled_weight_decay``).
        amsgrad: use the maximum of past second moments.
        foreach: accepted for compatibility and ignored: it picks among
            torch's for-loop and multi-tensor implementations, which compute
            the same update; tfuse has one, the fused update of whole buffers.
        maximize: maximize the objective.
        capturable: must be False (CUDA-graph capture of the step is not
            supported: step counts and hyperparameters are read on the host).
        differentiable: must be False (the update runs outside autograd).
        fused: None or True; tfuse is always fused. False is refused (use
            ``torch.optim.Adam`` for torch's non-fused implementations).
        decoupled_weight_decay: AdamW's decay ``p *= 1 - lr * weight_decay``.
        master_weights: for float16/bfloat16 parameters, keep float32 master
            copies (and float32 state) in their own flat buffer; the same launch
            updates the master and writes the rounded parameter. Saved in the
            state dict as ``master_param``.

    Positional arguments bind as in ``torch.optim.Adam``; everything after
    ``amsgrad`` is keyword-only, as there. Without master weights, float16 and
    bfloat16 parameters are updated in float32 and rounded to nearest even,
    their state kept in their own dtype (torch's fused kernels do the same).

    With ``torch.amp.GradScaler``, the scale is divided out inside the update
    kernel (no separate unscale pass); a step with inf/NaN gradients is
    skipped without any state change (the flag is read on the host).

    ``copy.deepcopy`` and pickling work as for torch.optim: the copy holds
    copies of the parameters (those of the model copy when both are copied
    together, e.g. ``copy.deepcopy({"model": model, "optimizer": optimizer})``)
    and coalesces them into flat buffers of its own.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedAdam
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> optimizer = FusedAdam(model.parameters(), lr=1e-3)
        >>> model(torch.randn(16, 4)).pow(2).mean().backward()
        >>> optimizer.step()
        >>> optimizer.zero_grad()
        >>> sorted(optimizer.state_dict()["state"][0])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    family = ADAM
    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    torch_name = "torch.optim.Adam"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self.check_group(defaults)
        _check_betas_types(betas)
        defaults["betas"] = tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() != 0 else b for b in betas)
        super().__init__(params, defaults, master_weights)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["eps"], "epsilon")
        betas = group["betas"]
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        check_non_negative(group["weight_decay"], "weight_decay")

    def pads_stay_zero(self) -> bool:
        # Zero padding stays zero only while the denominator is positive there.
        return all(as_float(g["eps"]) > 0 for g in self.param_groups)

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> AdamStep:
        beta1, beta2 = (as_float(b) for b in group["betas"])
        return AdamStep(
            lr=as_float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=as_float(group["eps"]),
            weight_decay=as_float(group["weight_decay"]),
            step=step,
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
        )


def _check_betas_types(betas: Any) -> None:
    """torch.optim.Adam's constructor checks of tensor betas, in its words."""
    if not (
        (isinstance(betas[0], float) and isinstance(betas[1], float))
        or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))
    ):
        raise ValueError("betas must be either both floats or both Tensors")
    for index in (0, 1):
        if isinstance(betas[index], torch.Tensor) and betas[index].numel() != 1:
            raise ValueError(f"Tensor betas[{index}] must be 1-element")


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default 1e-2) over flat buffers; see :class:`FusedAdam`.

    Matches ``torch.optim.AdamW`` (same positional and keyword arguments,
    plus ``master_weights``); its state dicts load both ways.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedAdamW
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedAdamW(layer.parameters(), lr=1e-3, weight_decay=0.1)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
    """

    torch_name = "torch.optim.AdamW"

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            master_weights=master_weights,
        )
