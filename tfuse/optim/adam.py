"""FusedAdam and FusedAdamW: torch.optim.Adam/AdamW semantics, one launch per flat buffer."""

from __future__ import annotations

import math
from typing import Any

import torch

from tfuse import kernels
from tfuse._launch import launch
from tfuse.optim._flat_optimizer import BlockTable, FlatOptimizer, _Unit, as_float, check_lr, check_non_negative


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
        params: parameters or parameter groups, as for torch.optim.
        lr: learning rate, a float or a 0-dim tensor (read once per step).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty (decoupled, as AdamW, when ``decoupled_weight_decay``).
        amsgrad: use the maximum of past second moments.
        maximize: maximize the objective.
        decoupled_weight_decay: AdamW's decay ``p *= 1 - lr * weight_decay``.
        master_weights: for float16/bfloat16 parameters, keep float32 master
            copies (and float32 state) in their own flat buffer; the same launch
            updates the master and writes the rounded parameter. Saved in the
            state dict as ``master_param``.

    With ``torch.amp.GradScaler``, the scale is divided out inside the update
    kernel (no separate unscale pass); a step with inf/NaN gradients is
    skipped without any state change (the flag is read on the host).

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

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self._check_group(defaults)
        super().__init__(params, defaults, master_weights)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["eps"], "epsilon")
        betas = group["betas"]
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        check_non_negative(group["weight_decay"], "weight_decay")

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _merge_runs(self) -> bool:
        # Zero padding stays zero only while the denominator is positive there.
        return all(as_float(g["eps"]) > 0 for g in self.param_groups)

    def _row(self, group: dict[str, Any], step: int, first: bool) -> tuple[list[float], dict[str, Any]]:
        lr = as_float(group["lr"])
        beta1, beta2 = (as_float(b) for b in group["betas"])
        eps, weight_decay = as_float(group["eps"]), as_float(group["weight_decay"])
        decoupled = bool(group["decoupled_weight_decay"])
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        row = [
            lr / bias_correction1,
            beta1,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            eps,
            0.0 if decoupled else weight_decay,
            1.0 - lr * weight_decay if decoupled else 1.0,
            math.sqrt(bias_correction2),
            -1.0 if group["maximize"] else 1.0,
            1.0 if group["amsgrad"] else 0.0,
        ]
        spec = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=bool(group["amsgrad"]),
                    maximize=bool(group["maximize"]), decoupled=decoupled, step=step)
        return row, spec

    def _launch(self, unit: _Unit, table: BlockTable, rows: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        exp_avg, exp_avg_sq = unit.buffers["exp_avg"], unit.buffers["exp_avg_sq"]
        max_exp_avg_sq = unit.buffers.get("max_exp_avg_sq")
        launch(
            kernels._adam_kernel,
            (table.n_blocks,),
            (
                unit.data, unit.grad, exp_avg, exp_avg_sq,
                exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq,
                unit.data if unit.master is None else unit.master,
                table.starts, table.ends, table.rows, rows,
                rows if grad_scale is None else grad_scale,
            ),
            dict(AMSGRAD=max_exp_avg_sq is not None, **self._kernel_meta(unit, table, grad_scale)),
            unit.device,
        )

    def _torch_update(self, unit: _Unit, table: BlockTable, specs: list[dict[str, Any]], grad_scale: torch.Tensor | None) -> None:
        """torch's fused CPU Adam over whole runs of the flat buffers (one call per coefficient row)."""
        for spec, spans, params, grads in self._torch_runs(unit, table, specs, grad_scale):
            exp_avgs = [unit.buffers["exp_avg"][s:e] for s, e in spans]
            exp_avg_sqs = [unit.buffers["exp_avg_sq"][s:e] for s, e in spans]
            maxes = [unit.buffers["max_exp_avg_sq"][s:e] for s, e in spans] if spec["amsgrad"] else []
            # torch's fused kernels want the step count on the parameters' device (CUDA with TFUSE_BACKEND=torch).
            step = torch.tensor(float(spec["step"]), dtype=torch.float32, device=unit.device)
            fused = torch._fused_adamw_ if spec["decoupled"] else torch._fused_adam_
            fused(
                params, grads, exp_avgs, exp_avg_sqs, maxes, [step] * len(spans),
                lr=spec["lr"], beta1=spec["beta1"], beta2=spec["beta2"], weight_decay=spec["weight_decay"],
                eps=spec["eps"], amsgrad=spec["amsgrad"], maximize=spec["maximize"],
                grad_scale=None if grad_scale is None else grad_scale.to(torch.float32),
            )


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default 1e-2) over flat buffers; see :class:`FusedAdam`.

    Matches ``torch.optim.AdamW``; its state dicts load both ways.

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedAdamW
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = FusedAdamW(layer.parameters(), lr=1e-3, weight_decay=0.1)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> optimizer.step()
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, decoupled_weight_decay=True,
            master_weights=master_weights,
        )
