"""Muon's orthogonalisation, batched: Newton-Schulz iterations over groups of same-shaped matrices.

Muon orthogonalises each parameter's update matrix. torch.optim.Muon loops
over the parameters (about 17 launches each, five iterations); here the
matrices of one shape sit side by side in a workspace and each iteration is
three batched matmuls per shape, whatever the number of parameters.

A parameter's matrix is its elements in memory order, ``(size(0), numel /
size(0))`` when its first dimension is outermost (row-major and channels_last
weights: a convolution weight ``(out, in, kh, kw)`` is the ``(out, in*kh*kw)``
matrix, its columns maybe permuted) or the transpose when it is innermost.
Orthogonalisation commutes with permuting rows or columns and with
transposition, so the update is the one of the logical matrix. The
:class:`MatrixLayout` of a step's runs says where each matrix sits in the
workspace, and is kept with the run table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from tfuse._kit import acc_dtype
from tfuse.optim._update_buffers import BLOCK, RunTable


def matrix_shape(param: torch.Tensor) -> tuple[int, int, bool]:
    """``(rows, cols, transposed)``: the matrix a parameter's elements form in memory order; ``transposed``
    when that is the transpose of its logical ``(size(0), numel / size(0))`` matrix.

    Example:
        >>> import torch
        >>> from tfuse.optim._newton_schulz import matrix_shape
        >>> matrix_shape(torch.empty(8, 3, 3, 3)), matrix_shape(torch.empty(3, 5).t())
        ((8, 27, False), (3, 5, True))
    """
    if param.dim() < 2:
        raise ValueError(f"Muon orthogonalises matrices; a parameter of shape {tuple(param.shape)} is not one")
    size0 = param.shape[0]
    rest = param.numel() // size0 if size0 else 0
    order = sorted((d for d in range(param.dim()) if param.shape[d] > 1), key=lambda d: -param.stride(d))
    if not order or order[0] == 0 or size0 == 1:
        return size0, rest, False
    if order[-1] == 0:
        return rest, size0, True
    raise ValueError(
        f"Muon needs a parameter's first dimension outermost or innermost in memory (a matrix in memory order); "
        f"a parameter of shape {tuple(param.shape)} has strides {param.stride()}: make it contiguous first"
    )


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment for an ``(rows, cols)`` matrix (its ``_adjust_lr``)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


@dataclasses.dataclass(frozen=True)
class ShapeGroup:
    """Matrices of one memory shape and one set of iteration settings, side by side in the workspace."""

    offset: int  # first element in the workspace
    count: int
    rows: int
    cols: int
    slot: int  # elements from one matrix to the next: rows * cols, or the run's length rounded up into padding
    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    dtype: torch.dtype  # ns_dtype: what the iterations compute in


class MatrixLayout:
    """Where each run's matrix sits in the workspace (grouped by shape), and per block of the run table its
    workspace offset and learning-rate ratio (for the kernels).

    A run rounded up into the zero padding after its parameter (the aligned ends that give the kernels 128-bit
    accesses) keeps its padding in the workspace: zeros in, zeros out, never read by the iterations."""

    def __init__(self, table: RunTable, params: tuple[torch.Tensor, ...], rows: list[Any]) -> None:
        keys, shapes = [], []
        for (start, end, row), param in zip(table.runs, params):
            r, c, transposed = matrix_shape(param)
            if end - start < r * c:
                raise ValueError("Muon updates whole matrices: a run covers part of a parameter")
            hyper = rows[row]
            logical = (c, r) if transposed else (r, c)
            shapes.append((r, c, lr_ratio(hyper.adjust_lr_fn, *logical)))
            settings = (tuple(map(float, hyper.ns_coefficients)), int(hyper.ns_steps), float(hyper.eps), hyper.ns_dtype)
            keys.append((r, c, end - start, *settings))  # (a run may end rounded up into the zero padding)
        order = sorted(range(len(keys)), key=lambda i: (str(keys[i]), i))
        self.run_dest = [0] * len(keys)
        self.groups: list[ShapeGroup] = []
        offset = 0
        for index in order:
            group = ShapeGroup(offset, 1, *keys[index])
            last = self.groups[-1] if self.groups else None
            if last is not None and dataclasses.replace(last, offset=offset, count=1) == group:
                self.groups[-1] = dataclasses.replace(last, count=last.count + 1)
            else:
                self.groups.append(group)
            self.run_dest[index] = offset
            offset += group.slot
        self.numel = offset
        self.dest_order = order  # the runs in workspace order
        self.run_ratio = [ratio for _, _, ratio in shapes]
        self._blocks: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table = table

    def block_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block of the run table: its workspace offset (int64) and its run's lr ratio (float64)."""
        found = self._blocks.get(device)
        if found is None:
            dest, ratio = [], []
            for (start, end, _), run_dest, run_ratio in zip(self._table.runs, self.run_dest, self.run_ratio):
                for block_start in range(start, end, BLOCK):
                    dest.append(run_dest + block_start - start)
                    ratio.append(run_ratio)
            found = self._blocks[device] = (
                torch.tensor(dest, dtype=torch.int64).to(device),
                torch.tensor(ratio, dtype=torch.float64).to(device),
            )
        return found

    def workspace(self, param_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh workspace in the update's precision (float64 for float64 parameters, else float32; each
        group is cast to its ``ns_dtype`` to iterate). The caching allocator makes it cheap; nothing is kept."""
        return torch.empty(self.numel, dtype=acc_dtype(param_dtype), device=device)

    def run_slices(self, workspace: torch.Tensor) -> list[torch.Tensor]:
        """Each run's matrix in the workspace, flat, in run order."""
        return [workspace[d : d + end - start] for d, (start, end, _) in zip(self.run_dest, self._table.runs)]


def layout_of(table: RunTable, rows: list[Any]) -> MatrixLayout:
    """The table's matrix layout for these rows' iteration settings (kept with the table)."""
    key = ("muon", tuple((h.adjust_lr_fn, tuple(h.ns_coefficients), h.ns_steps, h.eps, h.ns_dtype) for h in rows))
    layout = table.derived.get(key)
    if layout is None:
        if table.params is None:
            raise ValueError("Muon needs the run table's parameters (a per-parameter table)")
        layout = table.derived[key] = MatrixLayout(table, table.params, rows)
    return layout


def orthogonalise(workspace: torch.Tensor, layout: MatrixLayout) -> None:
    """Replaces each matrix of the workspace by its Newton-Schulz orthogonalisation, as torch.optim.Muon's
    ``_zeropower_via_newtonschulz`` computes it (same ops and order, in each group's ``ns_dtype``), batched.

    Example:
        >>> import torch
        >>> from tfuse.optim._update_buffers import BLOCK, RunTable
        >>> from tfuse.optim._muon_family import MuonStep
        >>> from tfuse.optim._newton_schulz import layout_of, orthogonalise
        >>> weights = (torch.empty(4, 6), torch.empty(4, 6))
        >>> table = RunTable([(0, 24, 0), (24, 48, 0)]).with_params(weights)
        >>> layout = layout_of(table, [MuonStep(lr=0.1, ns_dtype=torch.float64, ns_steps=30,
        ...                                     ns_coefficients=(1.5, -0.5, 0.0))])
        >>> workspace = torch.randn(48, dtype=torch.float64)  # (as for float64 parameters)
        >>> orthogonalise(workspace, layout)
        >>> m = workspace[:24].view(4, 6)
        >>> torch.allclose(m @ m.T, torch.eye(4, dtype=torch.float64), atol=1e-6)
        True
    """
    for group in layout.groups:
        where = workspace.storage_offset() + group.offset
        stacked = workspace.as_strided((group.count, group.rows, group.cols), (group.slot, group.cols, 1), where)
        tall = group.rows > group.cols
        x = (stacked.mT if tall else stacked).to(group.dtype)
        x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=group.eps)
        a, b, c = group.coefficients
        for _ in range(group.steps):
            gram = torch.bmm(x, x.mT)
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
        stacked.copy_(x.mT if tall else x)
