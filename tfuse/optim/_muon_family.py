"""Muon's update over flat buffers: its row of hyperparameters (:class:`MuonStep`) and its family (:data:`MUON`).

torch.optim.Muon's maths (Keller Jordan's Muon, as torch 2.13 ships it), per
matrix parameter with gradient ``g`` and momentum ``B``::

    B = lerp(B, g, 1 - momentum)              (B = momentum B + (1 - momentum) g)
    U = lerp(g, B, momentum) if nesterov else B
    O = NewtonSchulz(U)                       (ns_steps quintic iterations, in ns_dtype)
    p = p * (1 - lr * weight_decay) - lr * ratio(shape) * O

Each parameter is a run of its own. The Triton path is two launches per flat
buffer around the batched orthogonalisation (``kernels/muon.py``,
:mod:`tfuse.optim._newton_schulz`); the PyTorch path runs torch's foreach
ops (float32 for float16/bfloat16 buffers) around the same orthogonalisation.
"""

from __future__ import annotations

import dataclasses

import torch

from tfuse import kernels
from tfuse._launch import launch
from tfuse.optim._newton_schulz import layout_of, orthogonalise
from tfuse.optim._per_parameter import PerParameterFamily, WholeParameters
from tfuse.optim._update_buffers import FlatBuffers, RunTable

# Columns of the coefficient row (kernels/muon.py's MUON_*).
_MUON_LR, _MUON_DECAY = 0, 4
_MUON_WEIGHT_DECAY = 5  # an extra column of the static table on capturable steps

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)


@dataclasses.dataclass(frozen=True)
class MuonStep:
    """What one Muon update does: a parameter group's hyperparameters."""

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    momentum: float = 0.95
    weight_decay: float = 0.1
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: torch.dtype = torch.bfloat16

    state_names = ("momentum_buffer",)
    torch_kernel = "_foreach_lerp"  # the op the PyTorch path is named by (with batched matmuls)

    def coefficients(self) -> list[float]:
        """The kernels' coefficient row (columns MUON_* of kernels/muon.py)."""
        return [self.lr, self.momentum, 1.0 - self.momentum, 1.0 if self.nesterov else 0.0,
                1.0 - self.lr * self.weight_decay]  # fmt: skip

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from: lr = 0, and the weight decay in an extra last column."""
        return [*dataclasses.replace(self, lr=0.0).coefficients(), self.weight_decay]


class _MuonFamily(PerParameterFamily):
    name = "muon"
    kernel_name = (
        "_muon_momentum_kernel and _muon_apply_kernel, around the Newton-Schulz iterations as batched matmuls "
        "per matrix shape"
    )
    uses_step = False
    launches_per_buffer = 2
    needs_host_rows = True
    sums_across_ranks = False
    # Orthogonalises each parameter's whole matrix: sharded, its buffers are laid out in shards of whole
    # parameters (FlatParams.shards(whole_params=True)), each matrix with one owner.
    whole_parameters = True

    def required_state(self, group):
        return {"momentum_buffer"}

    def launch_rows(self, buffers: FlatBuffers, table: RunTable, coefficients, hypers, grad_scale, found_inf, meta):
        param, device = buffers.param, buffers.param.device
        layout = layout_of(table, hypers)
        workspace = layout.workspace(param.dtype, device)
        block_dest, block_ratio = layout.block_tensors(device)
        starts, ends, block_rows = table.blocks(device)
        grid = (starts.numel(),)
        skip = coefficients if found_inf is None else found_inf
        scale = coefficients if grad_scale is None else grad_scale
        momentum_meta = {k: v for k, v in meta.items() if k != "MASTER"}
        momentum = (buffers.grad, buffers.state["momentum_buffer"], starts, ends, block_rows, coefficients, scale,
                    skip, workspace, block_dest)  # fmt: skip
        launch(kernels._muon_momentum_kernel, grid, momentum, momentum_meta, device)
        orthogonalise(workspace, layout)
        apply_meta = {k: v for k, v in meta.items() if k != "GRAD_SCALE"}
        master = param if buffers.master is None else buffers.master
        apply = (param, master, starts, ends, block_rows, coefficients, skip, workspace, block_dest, block_ratio)
        launch(kernels._muon_apply_kernel, grid, apply, apply_meta, device)

    def device_coefficients(self, static, lr, steps):
        table = static.clone()
        table[:, _MUON_LR] = lr
        table[:, _MUON_DECAY] = 1 - lr * static[:, _MUON_WEIGHT_DECAY]
        return table[:, :_MUON_WEIGHT_DECAY].contiguous()

    def torch_update(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf) -> None:
        layout = layout_of(table, rows)
        by_row: dict[int, list[int]] = {}
        for index, (_, _, row) in enumerate(table.runs):
            by_row.setdefault(row, []).append(index)
        pending, updates = [], {}
        flat_buffer = buffers.state["momentum_buffer"]
        for row, indices in by_row.items():
            hyper = rows[row]
            whole = WholeParameters(buffers, [table.runs[i][:2] for i in indices])
            grads, unscaled = whole.unscaled_grads(grad_scale)
            olds = whole.views(flat_buffer)
            news = torch._foreach_lerp(olds, unscaled, 1.0 - hyper.momentum)
            moved = torch._foreach_lerp(unscaled, news, hyper.momentum) if hyper.nesterov else news
            updates.update(zip(indices, moved))
            targets = [(flat_buffer, olds, news)]
            if grad_scale is not None:
                targets.append((buffers.grad, grads, unscaled))
            pending.append((hyper, whole, indices, targets))
        workspace = layout.workspace(buffers.param.dtype, buffers.param.device)
        torch.cat([updates[i] for i in layout.dest_order], out=workspace)  # the matrices, grouped by shape
        orthogonalise(workspace, layout)
        slices = layout.run_slices(workspace)
        for hyper, whole, indices, targets in pending:
            params = whole.views(whole.source)
            moved = torch._foreach_mul(params, 1.0 - hyper.lr * hyper.weight_decay)
            if isinstance(hyper.lr, torch.Tensor):  # (a capturable step's tensor lr, read on the device)
                scales = [hyper.lr * layout.run_ratio[i] for i in indices]
                torch._foreach_sub_(moved, torch._foreach_mul([slices[i] for i in indices], scales))
            else:  # one call per lr adjustment (matrix shape), as torch's add_(O, alpha=-lr * ratio) rounds
                by_ratio: dict[float, list[int]] = {}
                for at, i in enumerate(indices):
                    by_ratio.setdefault(layout.run_ratio[i], []).append(at)
                for ratio, ats in by_ratio.items():
                    torch._foreach_add_([moved[a] for a in ats], [slices[indices[a]] for a in ats],
                                        alpha=-hyper.lr * ratio)  # fmt: skip
            whole.write([(whole.source, params, moved), *targets], found_inf)

    def torch_words(self, kernel: str) -> str:
        return "torch's foreach ops (_foreach_lerp for the momentum) around batched matmuls per matrix shape"


MUON = _MuonFamily()
