"""The update maths of the fused optimizers, over element ranges of flat buffers.

One function per optimizer family runs one update step: :func:`adam_update`
(Adam and AdamW) and :func:`sgd_update` (SGD with momentum, dampening,
Nesterov). Each works on flat buffers that pair element by element
(:class:`FlatBuffers`: parameters, gradients, named state buffers, optional
float32 masters) over the element ranges of a :class:`RunTable`, each range
with its own row of hyperparameters (:class:`AdamStep`, :class:`SGDStep`).
Nothing here knows about ``torch.optim.Optimizer``: the fused optimizers, a
shard owner updating its shard ``[start, end)`` of the buffers, and an outer
optimizer stepping whole snapshot buffers all call the same functions.

Two paths, as everywhere in tfuse:

* Triton: one launch of the family's kernel (``kernels/optim.py``) over the
  whole table, whatever the number of ranges and rows.
* PyTorch: torch's fused kernels (``torch._fused_adam_`` and friends) over
  the ranges, cut into pieces of TORCH_PIECE elements. torch's fused CPU
  kernels are not trusted blindly for float16/bfloat16: torch 2.13's
  ``_fused_sgd_`` leaves low-precision parameters unchanged (its vectorized
  loop never stores them). The first low-precision update of a kind runs a
  small probe of torch's kernel against the same kernel on float32 copies
  (:func:`native_low_precision_ok`); a kernel that disagrees is routed around
  by computing in float32 and rounding (the Triton kernel's maths).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from tfuse import kernels
from tfuse._backend import Backend, select_backend
from tfuse._kit import acc_fp64, emulate_bf16_rtne, num_warps
from tfuse._launch import launch

logger = logging.getLogger(__name__)

BLOCK = 4096  # elements per program; blocks never cross a run's end
NUM_WARPS = num_warps(BLOCK, 16)  # 16 elements (four 128-bit vectors of float32) per thread: 8 warps
TORCH_PIECE = 1 << 20  # elements per tensor handed to torch's fused CPU kernels
UPCAST_BATCH = 8 * TORCH_PIECE  # most elements upcast to float32 at once on the PyTorch path (bounds the copies)
MAX_ALIGN = 16  # largest alignment hint worth a compile variant (16 float32 = four 128-bit vectors)
LOW_PRECISION = (torch.float16, torch.bfloat16)

# (torch kernel name, dtype, device type) -> whether torch's fused kernel computes that dtype right.
_NATIVE_OK: dict[tuple[str, torch.dtype, str], bool] = {}


# ---------------------------------------------------------------------------- what an update works on


@dataclasses.dataclass(frozen=True)
class FlatBuffers:
    """The flat tensors one update reads and writes, paired element by element.

    All are 1-D and indexed alike: element ``i`` of ``grad``, of every
    ``state`` buffer and of ``master`` belongs to element ``i`` of ``param``
    (a :class:`~tfuse.optim._state.FlatState` hands out such a set with
    :meth:`~tfuse.optim._state.FlatState.buffers_for_update`). Only the
    elements of the :class:`RunTable`'s ranges are read or written.

    Attributes:
        param: the parameters (written rounded to their dtype).
        grad: the gradients (divided by ``grad_scale`` in place when one is given).
        state: the optimizer state by torch's names (``exp_avg``, ``momentum_buffer``...).
        master: float32 master copies of the parameters, or None. With masters the
            update reads and writes them and writes ``param`` rounded from them.
    """

    param: torch.Tensor
    grad: torch.Tensor
    state: Mapping[str, torch.Tensor]
    master: torch.Tensor | None = None


class RunTable:
    """The element ranges an update covers, each with the index of its row of hyperparameters.

    Args:
        runs: ``(start, end, row)`` triples: elements ``[start, end)`` of the
            :class:`FlatBuffers` are updated with ``rows[row]``. Ranges must not overlap.
        start_align: every ``start`` is a multiple of it (a power of two up to
            16): a compile-time hint that lets the kernel use 128-bit accesses.
        end_align: every ``end`` is a multiple of it (a power of two, at most
            ``start_align``), e.g. when run ends are rounded up into zero padding.

    Tables are built once and reused while the ranges stay the same: the
    kernel's block table (ranges cut into blocks of BLOCK elements, on the
    device) and the PyTorch path's pieces are made on first use and kept.

    Example:
        >>> from tfuse.optim._update import RunTable
        >>> table = RunTable([(0, 5000, 0), (5008, 5100, 1)], start_align=16)
        >>> table.spans_by_row()
        {0: [(0, 5000)], 1: [(5008, 5100)]}
    """

    def __init__(self, runs: Iterable[tuple[int, int, int]], *, start_align: int = 1, end_align: int = 1) -> None:
        self.runs = tuple((int(start), int(end), int(row)) for start, end, row in runs)
        for align in (start_align, end_align):
            if not (0 < align <= MAX_ALIGN and align & (align - 1) == 0):
                raise ValueError(f"RunTable: alignments are powers of two up to {MAX_ALIGN}, got {align}")
        if end_align > start_align:
            raise ValueError(f"RunTable: end_align ({end_align}) cannot exceed start_align ({start_align})")
        for start, end, _ in self.runs:
            # A wrong hint would make the compiled kernel read and write the wrong elements: checked here, once.
            if start % start_align or end % end_align or end < start:
                raise ValueError(
                    f"RunTable: run [{start}, {end}) does not respect start_align={start_align}, end_align={end_align}"
                )
        self.start_align = start_align
        self.end_align = end_align
        self._blocks: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._spans: dict[int, list[tuple[int, int]]] | None = None

    @property
    def numel(self) -> int:
        """Elements the table covers."""
        return sum(end - start for start, end, _ in self.runs)

    def blocks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's block table on ``device``: block starts, ends and row indices (int64).

        A run is cut into blocks of at most BLOCK elements; one program updates one block.
        """
        table = self._blocks.get(device)
        if table is None:
            starts, ends, rows = [], [], []
            for start, end, row in self.runs:
                block_starts = range(start, end, BLOCK)
                starts.extend(block_starts)
                ends.extend(min(s + BLOCK, end) for s in block_starts)
                rows.extend([row] * len(block_starts))
            packed = torch.tensor([starts, ends, rows], dtype=torch.int64).to(device)
            table = self._blocks[device] = (packed[0], packed[1], packed[2])
        return table

    def spans_by_row(self) -> dict[int, list[tuple[int, int]]]:
        """The runs cut into pieces of at most TORCH_PIECE elements, by row (the PyTorch path's calls)."""
        if self._spans is None:
            spans: dict[int, list[tuple[int, int]]] = {}
            for start, end, row in self.runs:
                spans.setdefault(row, []).extend((s, min(s + TORCH_PIECE, end)) for s in range(start, end, TORCH_PIECE))
            self._spans = spans
        return self._spans


# ---------------------------------------------------------------------------- hyperparameters, one row each

# Columns of the coefficient rows (kernels/optim.py's ADAM_* and SGD_*; pinned by tests/test_capturable.py).
_ADAM_STEP_SIZE, _ADAM_BETA1, _ADAM_BETA2, _ADAM_DECAY, _ADAM_BC2_SQRT = 0, 1, 3, 7, 8
_ADAM_DECOUPLED_WD = 11  # an extra column of the static table on capturable steps: AdamW's wd (0 for Adam)
_SGD_LR = 0


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """What one Adam/AdamW update does: a parameter group's hyperparameters at one step count.

    The fields mean what they mean in ``torch.optim.Adam``; ``step`` is the
    step being taken (1 for the first), ``decoupled_weight_decay`` makes it AdamW.
    """

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    step: int | torch.Tensor = 1  # a 0-dim tensor on capturable steps
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state buffers this update reads and writes."""
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")

    @property
    def torch_kernel(self) -> str:
        """torch's fused kernel for this update (the PyTorch path)."""
        return "_fused_adamw_" if self.decoupled_weight_decay else "_fused_adam_"

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns ADAM_* of kernels/optim.py), computed in float64."""
        bias_correction1 = 1 - self.beta1**self.step
        bias_correction2 = 1 - self.beta2**self.step
        decoupled = self.decoupled_weight_decay
        return [
            self.lr / bias_correction1,
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            self.eps,
            0.0 if decoupled else self.weight_decay,
            1.0 - self.lr * self.weight_decay if decoupled else 1.0,
            math.sqrt(bias_correction2),
            -1.0 if self.maximize else 1.0,
            1.0 if self.amsgrad else 0.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from (see ``_AdamFamily.device_coefficients``): the columns
        that depend on neither lr nor the step, and AdamW's weight decay in an extra last column."""
        row = dataclasses.replace(self, lr=0.0, step=1).coefficients()
        return [*row, self.weight_decay if self.decoupled_weight_decay else 0.0]


@dataclasses.dataclass(frozen=True)
class SGDStep:
    """What one SGD update does: a parameter group's hyperparameters, as in ``torch.optim.SGD``.

    ``first_step``: the momentum buffer starts as the gradient (torch: the
    parameter has no momentum buffer yet) instead of being read.
    """

    lr: float | torch.Tensor  # a tensor on capturable steps (read on the device)
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    first_step: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state buffers this update reads and writes."""
        return ("momentum_buffer",) if self.momentum != 0 else ()

    @property
    def torch_kernel(self) -> str:
        """torch's fused kernel for this update (the PyTorch path)."""
        return "_fused_sgd_"

    def coefficients(self) -> list[float]:
        """The kernel's coefficient row (columns SGD_* of kernels/optim.py)."""
        return [
            self.lr,
            self.momentum,
            1.0 - self.dampening,
            self.weight_decay,
            1.0 if self.nesterov else 0.0,
            -1.0 if self.maximize else 1.0,
            1.0 if self.first_step else 0.0,
        ]

    def static_coefficients(self) -> list[float]:
        """The row a capturable step starts from: every column but the learning rate's."""
        return dataclasses.replace(self, lr=0.0).coefficients()


# ---------------------------------------------------------------------------- the families


class UpdateFamily:
    """An optimizer family's update: its Triton kernel and its call of torch's fused kernel."""

    name: ClassVar[str]
    kernel_name: ClassVar[str]  # the Triton kernel (named in describe() and the log)
    uses_step: ClassVar[bool]  # whether the update depends on a per-parameter step count (torch's 'step')

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
        starts, ends, block_rows = table.blocks(buffers.param.device)
        launch(
            kernels._adam_kernel,
            (starts.numel(),),
            (
                buffers.param,
                buffers.grad,
                state["exp_avg"],
                exp_avg_sq,
                exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq,
                buffers.param if buffers.master is None else buffers.master,
                starts,
                ends,
                block_rows,
                rows,
                rows if grad_scale is None else grad_scale,
                rows if found_inf is None else found_inf,
            ),
            dict(AMSGRAD=max_exp_avg_sq is not None, **meta),
            buffers.param.device,
        )

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
        starts, ends, block_rows = table.blocks(buffers.param.device)
        launch(
            kernels._sgd_kernel,
            (starts.numel(),),
            (
                buffers.param,
                buffers.grad,
                buffers.param if momentum_buffer is None else momentum_buffer,
                buffers.param if buffers.master is None else buffers.master,
                starts,
                ends,
                block_rows,
                rows,
                rows if grad_scale is None else grad_scale,
                rows if found_inf is None else found_inf,
            ),
            dict(MOMENTUM=momentum_buffer is not None, **meta),
            buffers.param.device,
        )

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


# ---------------------------------------------------------------------------- the update functions


def adam_update(
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[AdamStep],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """One Adam/AdamW step over the ranges of ``table``: ``torch.optim.Adam``'s maths, in place.

    Args:
        buffers: parameters, gradients, ``exp_avg``/``exp_avg_sq`` (and
            ``max_exp_avg_sq`` for amsgrad rows) state buffers, optional masters.
        table: the element ranges to update and the row of each.
        rows: the hyperparameters of each row (``step`` is the step being taken).
        grad_scale: a GradScaler's scale (a 1-element float tensor on the
            buffers' device): gradients are divided by it, and left unscaled.
        found_inf: a GradScaler's flag (1-element, on the device): when
            non-zero nothing is updated. Read on the device, never by the host.
        coefficients: the Triton kernel's coefficient table, already on the
            device (capturable steps: see ``UpdateFamily.device_coefficients``);
            None builds it from ``rows`` on the host. The PyTorch path reads ``rows``.
        backend: the path to take; None picks it by tfuse's rules for the device.

    Example:
        >>> import torch
        >>> from tfuse.optim._update import AdamStep, FlatBuffers, RunTable, adam_update
        >>> param, grad = torch.zeros(8), torch.ones(8)
        >>> state = {"exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)}
        >>> adam_update(FlatBuffers(param, grad, state), RunTable([(2, 6, 0)]), [AdamStep(lr=0.1)])
        >>> param  # the first Adam step moves each updated element by lr
        tensor([ 0.0000,  0.0000, -0.1000, -0.1000, -0.1000, -0.1000,  0.0000,  0.0000])
    """
    update(
        ADAM,
        buffers,
        table,
        rows,
        grad_scale=grad_scale,
        found_inf=found_inf,
        coefficients=coefficients,
        backend=backend,
    )


def sgd_update(
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[SGDStep],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """One SGD step over the ranges of ``table``: ``torch.optim.SGD``'s maths, in place.

    Arguments as for :func:`adam_update`; ``buffers.state`` holds
    ``momentum_buffer`` when a row has a momentum.

    Example (Nesterov momentum over a pseudo-gradient, as an outer optimizer does):
        >>> import torch
        >>> from tfuse.optim._update import FlatBuffers, RunTable, SGDStep, sgd_update
        >>> weights, delta = torch.ones(4), torch.full((4,), 0.5)
        >>> buffers = FlatBuffers(weights, delta, {"momentum_buffer": torch.zeros(4)})
        >>> sgd_update(buffers, RunTable([(0, 4, 0)]), [SGDStep(lr=1.0, momentum=0.9, nesterov=True, first_step=True)])
        >>> weights  # 1 - (0.5 + 0.9 * 0.5)
        tensor([0.0500, 0.0500, 0.0500, 0.0500])
    """
    update(
        SGD,
        buffers,
        table,
        rows,
        grad_scale=grad_scale,
        found_inf=found_inf,
        coefficients=coefficients,
        backend=backend,
    )


def update(
    family: UpdateFamily,
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[Any],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    coefficients: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """One step of ``family``'s update (see :func:`adam_update`): the Triton kernel or the PyTorch path."""
    device = buffers.param.device
    if backend is None:
        backend = select_backend(device, f"{family.name}_update")
    if backend is Backend.TRITON:
        if coefficients is None:
            coefficients = _host_table(rows, device)
        meta = dict(
            ACC_FP64=acc_fp64(buffers.param.dtype),
            MASTER=buffers.master is not None,
            GRAD_SCALE=grad_scale is not None,
            FOUND_INF=found_inf is not None,
            EMULATE_BF16_RTNE=emulate_bf16_rtne(),
            BLOCK=BLOCK,
            START_ALIGN=table.start_align,
            END_ALIGN=table.end_align,
            num_warps=NUM_WARPS,
        )
        family.launch(buffers, table, coefficients, grad_scale, found_inf, meta)
    else:
        _torch_update(family, buffers, table, rows, grad_scale, found_inf)


def _host_table(rows: Sequence[Any], device: torch.device) -> torch.Tensor:
    """The coefficient table built on the host and sent to ``device`` without a host sync.

    A copy from pageable memory makes CUDA wait for the stream first (a host
    sync per step); from pinned memory it is queued like a kernel.
    """
    table = torch.tensor([hyper.coefficients() for hyper in rows], dtype=torch.float64)
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def upcasts(family: UpdateFamily, kernel: str, dtype: torch.dtype, device: torch.device, master: bool) -> bool:
    """Whether the PyTorch path computes an update on float32 copies.

    With master weights it always does (on the masters). Low-precision
    parameters without masters go through float32 only when torch's fused
    kernel for their dtype failed the probe (torch 2.13's ``_fused_sgd_`` does).
    """
    if master:
        return True
    return dtype in LOW_PRECISION and not native_low_precision_ok(family, kernel, dtype, device)


def _torch_update(
    family: UpdateFamily,
    buffers: FlatBuffers,
    table: RunTable,
    rows: Sequence[Any],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """torch's fused kernels over the runs (one call per row).

    Runs are cut into pieces of TORCH_PIECE elements: torch's fused CPU kernels
    parallelize over a list of tensors better than inside one huge tensor
    (measured: ResNet-50's 25.6M elements in one tensor 14.5 ms, in 1M pieces
    10.7 ms, 2 cores). When the update goes through float32 (master weights, or
    a low-precision dtype torch's kernel gets wrong), at most UPCAST_BATCH elements
    are upcast at a time; the parameters, the low-precision state and, under AMP,
    the unscaled gradients are written back rounded to nearest even.
    """
    param, grad, state, master = buffers.param, buffers.grad, buffers.state, buffers.master
    scale = None if grad_scale is None else grad_scale.to(torch.float32)
    skip = None if found_inf is None else found_inf.to(torch.float32)
    for row, spans in table.spans_by_row().items():
        hyper = rows[row]
        names = hyper.state_names
        if not upcasts(family, hyper.torch_kernel, param.dtype, param.device, master is not None):
            family.torch_call(
                hyper,
                [param[s:e] for s, e in spans],
                [grad[s:e] for s, e in spans],
                {name: [state[name][s:e] for s, e in spans] for name in names},
                scale,
                skip,
            )
            continue
        for batch in _batches(spans, UPCAST_BATCH):
            if master is not None:
                params = [master[s:e] for s, e in batch]
            else:
                params = [param[s:e].float() for s, e in batch]
            grads = [grad[s:e].float() for s, e in batch]
            states = {name: [state[name][s:e].float() for s, e in batch] for name in names}
            family.torch_call(hyper, params, grads, states, scale, skip)
            for index, (s, e) in enumerate(batch):
                param[s:e].copy_(params[index])
                if grad_scale is not None:
                    grad[s:e].copy_(grads[index])
                for name in names:
                    buffer = state[name]
                    if buffer.dtype != torch.float32:  # float32 state (masters): updated in place already
                        buffer[s:e].copy_(states[name][index])


def _batches(spans: list[tuple[int, int]], limit: int) -> Iterable[list[tuple[int, int]]]:
    """Consecutive spans in lists of at most ``limit`` elements (at least one span each)."""
    batch: list[tuple[int, int]] = []
    size = 0
    for span in spans:
        length = span[1] - span[0]
        if batch and size + length > limit:
            yield batch
            batch, size = [], 0
        batch.append(span)
        size += length
    if batch:
        yield batch


# ---------------------------------------------------------------------------- checking torch's kernels


def native_low_precision_ok(family: UpdateFamily, kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's fused ``kernel`` updates ``dtype`` tensors on ``device``'s type correctly.

    Checked once per process and (kernel, dtype, device type): a few steps of
    the option sets of ``family.probe_sequences(kernel)`` on a 331-element
    tensor (vector bodies of every CPU ISA and a tail), with and without a grad
    scale, against the same kernel on float32 copies rounded back to ``dtype``.
    Parameters, state and unscaled gradients must agree within 2 units in the
    last place. torch 2.13's ``_fused_sgd_`` fails it on CPU for float16 and
    bfloat16: it leaves the parameters unchanged.
    """
    if device.type == "meta":
        return True  # nothing is computed on the meta device
    key = (kernel, dtype, device.type)
    ok = _NATIVE_OK.get(key)
    if ok is None:
        with torch.no_grad():
            ok = _probe(family, kernel, dtype, device)
        _NATIVE_OK[key] = ok
        if not ok:
            logger.info(
                "tfuse: torch.%s gives wrong results for %s tensors on %s (torch %s); tfuse computes these "
                "updates on float32 copies and rounds them instead",
                kernel,
                str(dtype).replace("torch.", ""),
                device.type,
                torch.__version__,
            )
    return ok


def _probe(family: UpdateFamily, kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
    generator = torch.Generator().manual_seed(0)  # never the global generator: the user's randomness stays theirs
    n = 331
    finfo = torch.finfo(dtype)

    def random(scale: float = 1.0, positive: bool = False) -> torch.Tensor:
        values = torch.randn(n, generator=generator) * scale
        return (values.abs() if positive else values).to(device=device, dtype=dtype)

    def agree(native: torch.Tensor, reference: torch.Tensor) -> bool:
        return bool(torch.isclose(native.float(), reference.float(), rtol=2 * finfo.eps, atol=finfo.tiny).all())

    for sequence in family.probe_sequences(kernel):
        for grad_scale in (None, torch.tensor(8.0, device=device)):
            names = sequence[0].state_names
            param = random()
            states = {name: random(0.1, positive=True) for name in names}
            for hyper in sequence:
                grad = random(1.0 if grad_scale is None else 8.0)
                native = [param.clone()], [grad.clone()], {k: [v.clone()] for k, v in states.items()}
                family.torch_call(hyper, *native, grad_scale)
                upcast = [param.float()], [grad.float()], {k: [v.float()] for k, v in states.items()}
                family.torch_call(hyper, *upcast, grad_scale)
                param, grad = upcast[0][0].to(dtype), upcast[1][0].to(dtype)
                states = {k: v[0].to(dtype) for k, v in upcast[2].items()}
                if not agree(native[0][0], param) or (grad_scale is not None and not agree(native[1][0], grad)):
                    return False
                if not all(agree(native[2][k][0], states[k]) for k in names):
                    return False
    return True
