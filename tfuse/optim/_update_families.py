"""The optimizer families: each one's Triton kernel launch and call of torch's fused kernel.

An :class:`UpdateFamily` knows how its kernel (``kernels/optim.py``) and
torch's fused kernel (``torch._fused_adam_`` and friends) take the buffers,
how a capturable step computes its coefficient table on the device, and
which step sequences check torch's kernel in low precision. :data:`ADAM`
(Adam and AdamW) and :data:`SGD` (SGD with momentum, dampening, Nesterov)
are the two families.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from tfuse import kernels
from tfuse._launch import launch
from tfuse.optim._update_buffers import FlatBuffers, RunTable
from tfuse.optim._update_rows import (
    _ADAM_BC2_SQRT,
    _ADAM_BETA1,
    _ADAM_BETA2,
    _ADAM_DECAY,
    _ADAM_DECOUPLED_WD,
    _ADAM_STEP_SIZE,
    _SGD_LR,
    AdamStep,
    SGDStep,
)


def launch_update(
    kernel: Any,
    buffers: FlatBuffers,
    states: tuple[torch.Tensor, ...],
    table: RunTable,
    rows: torch.Tensor,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    meta: dict[str, Any],
) -> None:
    """One launch of an update kernel of ``kernels/optim.py`` over ``table``: its arguments are the parameters, the
    gradients, ``states`` (the family's state buffers, in the kernel's order), the masters, the block table, the
    coefficient table ``rows`` and GradScaler's scale and flag (``rows`` stands in for an absent pointer)."""
    param = buffers.param
    starts, ends, block_rows = table.blocks(param.device)
    pointers = (
        param,
        buffers.grad,
        *states,
        param if buffers.master is None else buffers.master,
        starts,
        ends,
        block_rows,
        rows,
        rows if grad_scale is None else grad_scale,
        rows if found_inf is None else found_inf,
    )
    launch(kernel, (starts.numel(),), pointers, meta, param.device)


class UpdateFamily:
    """An optimizer family's update: its Triton kernel and its call of torch's fused kernel."""

    name: ClassVar[str]
    kernel_name: ClassVar[str]  # the Triton kernel (named in describe() and the log)
    uses_step: ClassVar[bool]  # whether the update depends on a per-parameter step count (torch's 'step')
    # Whether the PyTorch path may run float16/bfloat16 buffers natively (after the probe of torch's kernel);
    # False: always on float32 copies (a family written with torch's foreach ops, which round each intermediate).
    native_low_precision: ClassVar[bool] = True
    # Whether the update needs each parameter's elements in runs of their own (per-parameter norms: LAMB). Such
    # a family's PyTorch path is its torch_update, over whole runs; sharded, its norms are summed across ranks.
    per_parameter: ClassVar[bool] = False
    launches_per_buffer: ClassVar[int] = 1  # Triton launches of one update of a flat buffer
    # Whether the Triton path also needs the host's rows (launch_rows, not launch): work sized on the host (Muon).
    needs_host_rows: ClassVar[bool] = False

    def torch_update(self, buffers: FlatBuffers, table: RunTable, rows: Any, grad_scale, found_inf) -> None:
        """The PyTorch path of a per-parameter family, over whole runs (the others go through torch_call)."""
        raise NotImplementedError

    def torch_words(self, kernel: str) -> str:
        """The PyTorch path's torch call ``kernel`` (a row's ``torch_kernel``), in describe()'s words."""
        return f"torch.{kernel}"

    def launch(
        self,
        buffers: FlatBuffers,
        table: RunTable,
        rows: torch.Tensor,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        meta: dict[str, Any],
    ) -> None:
        """One launch of the family's kernel over ``table`` (``rows``: the coefficient table on the device)."""
        raise NotImplementedError

    def launch_rows(
        self,
        buffers: FlatBuffers,
        table: RunTable,
        rows: torch.Tensor,
        hypers: Any,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        meta: dict[str, Any],
    ) -> None:
        """:meth:`launch` for a family with :attr:`needs_host_rows`: ``hypers`` are the rows of ``rows``."""
        raise NotImplementedError

    def torch_call(
        self,
        hyper: Any,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: dict[str, list[torch.Tensor]],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """One call of torch's fused kernel ``hyper.torch_kernel`` over lists of slices (updated in place)."""
        raise NotImplementedError

    def device_coefficients(self, static: torch.Tensor, lr: torch.Tensor, steps: torch.Tensor | None) -> torch.Tensor:
        """The coefficient table computed on the device (capturable steps): ``static`` holds each row's
        :meth:`coefficients` at step 1 and any lr (float64, on the device), ``lr`` each row's learning
        rate and ``steps`` each row's step count (the step being taken), both on the device.
        Device ops only: no host reads, no host-to-device copies."""
        raise NotImplementedError

    def probe_sequences(self, kernel: str) -> list[list[Any]]:
        """Step sequences :func:`native_low_precision_ok` runs to check torch's ``kernel``."""
        raise NotImplementedError

    def required_state(self, group: dict[str, Any]) -> set[str]:
        """The state a parameter of ``group`` (its options as a state dict has them) holds once stepped."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<tfuse update family {self.name}>"


class _AdamFamily(UpdateFamily):
    name = "adam"
    kernel_name = "_adam_kernel"
    uses_step = True

    def required_state(self, group):
        return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())

    def launch(self, buffers, table, rows, grad_scale, found_inf, meta):
        state = buffers.state
        exp_avg_sq = state["exp_avg_sq"]
        max_exp_avg_sq = state.get("max_exp_avg_sq")
        states = (state["exp_avg"], exp_avg_sq, exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq)
        meta = dict(AMSGRAD=max_exp_avg_sq is not None, **meta)
        launch_update(kernels._adam_kernel, buffers, states, table, rows, grad_scale, found_inf, meta)

    def torch_call(self, hyper, params, grads, states, grad_scale, found_inf=None):
        # torch's fused kernels want the step count on the parameters' device (CUDA with TFUSE_BACKEND=torch).
        step = hyper.step
        if not isinstance(step, torch.Tensor):
            step = torch.tensor(float(step), dtype=torch.float32, device=params[0].device)
        getattr(torch, hyper.torch_kernel)(
            params,
            grads,
            states["exp_avg"],
            states["exp_avg_sq"],
            states.get("max_exp_avg_sq", []),
            [step] * len(params),
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            amsgrad=hyper.amsgrad,
            maximize=hyper.maximize,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )

    def device_coefficients(self, static, lr, steps):
        # The columns that depend on lr and the step count; the others are the host's (see AdamStep).
        table = static.clone()
        steps = steps.to(torch.float64)
        bias_correction1 = 1 - torch.pow(static[:, _ADAM_BETA1], steps)
        table[:, _ADAM_STEP_SIZE] = lr / bias_correction1
        table[:, _ADAM_BC2_SQRT] = torch.sqrt(1 - torch.pow(static[:, _ADAM_BETA2], steps))
        # static's decay column at lr = 0 is 1 for every row; AdamW's is 1 - lr * wd, wd kept in its own column.
        table[:, _ADAM_DECAY] = 1 - lr * static[:, _ADAM_DECOUPLED_WD]
        return table[:, :_ADAM_DECOUPLED_WD].contiguous()  # the kernel reads rows of ADAM_ROW columns

    def probe_sequences(self, kernel):
        # Every option changes the result by many ulps of float16 and bfloat16 (2 ulps pass the check).
        decoupled = kernel == "_fused_adamw_"
        plain = dict(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, decoupled_weight_decay=decoupled)
        every = dict(plain, lr=0.2, beta1=0.5, beta2=0.9, weight_decay=0.5, eps=1e-3, amsgrad=True, maximize=True)
        return [[AdamStep(**plain, step=s) for s in (1, 2)], [AdamStep(**every, step=s) for s in (1, 2, 3)]]


class _SGDFamily(UpdateFamily):
    name = "sgd"
    kernel_name = "_sgd_kernel"
    uses_step = False

    def required_state(self, group):
        return {"momentum_buffer"} if group.get("momentum") else set()

    def launch(self, buffers, table, rows, grad_scale, found_inf, meta):
        momentum_buffer = buffers.state.get("momentum_buffer")
        states = (buffers.param if momentum_buffer is None else momentum_buffer,)
        meta = dict(MOMENTUM=momentum_buffer is not None, **meta)
        launch_update(kernels._sgd_kernel, buffers, states, table, rows, grad_scale, found_inf, meta)

    def torch_call(self, hyper, params, grads, states, grad_scale, found_inf=None):
        torch._fused_sgd_(
            params,
            grads,
            states.get("momentum_buffer", []),
            weight_decay=hyper.weight_decay,
            momentum=hyper.momentum,
            lr=hyper.lr,
            dampening=hyper.dampening,
            nesterov=hyper.nesterov,
            maximize=hyper.maximize,
            is_first_step=hyper.first_step,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )

    def device_coefficients(self, static, lr, steps):
        table = static.clone()
        table[:, _SGD_LR] = lr
        return table

    def probe_sequences(self, kernel):
        # Every option changes the result by many ulps of float16 and bfloat16 (2 ulps pass the check).
        plain = SGDStep(lr=0.5, first_step=True)
        nesterov = SGDStep(lr=0.5, momentum=0.9, weight_decay=0.5, nesterov=True, maximize=True, first_step=True)
        damped = SGDStep(lr=0.5, momentum=0.8, dampening=0.3, weight_decay=0.3, first_step=True)
        return [
            [plain],
            [nesterov, dataclasses.replace(nesterov, first_step=False)],
            [damped, dataclasses.replace(damped, first_step=False)],
        ]


ADAM = _AdamFamily()
SGD = _SGDFamily()
