"""What an update works on: the flat buffers it reads and writes, and the element ranges it covers.

:class:`FlatBuffers` pairs the flat tensors of one update element by element;
:class:`RunTable` lists the element ranges to update, each with its row of
hyperparameters, and cuts them into the Triton kernel's blocks
(:data:`BLOCK` elements) or the PyTorch path's pieces (:data:`TORCH_PIECE`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import torch

from tfuse._kit import num_warps

BLOCK = 4096  # elements per program; blocks never cross a run's end
NUM_WARPS = num_warps(BLOCK, 16)  # 16 elements (four 128-bit vectors of float32) per thread: 8 warps
TORCH_PIECE = 1 << 20  # elements per tensor handed to torch's fused CPU kernels
MAX_ALIGN = 16  # largest alignment hint worth a compile variant (16 float32 = four 128-bit vectors)


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
        reduce_sums: see the field's comment (per-parameter families on a shard).
    """

    param: torch.Tensor
    grad: torch.Tensor
    state: Mapping[str, torch.Tensor]
    master: torch.Tensor | None = None
    # Sums per-parameter partial sums across the ranks that hold parts of the parameters (in place): a shard
    # owner's per-parameter update (LAMB, LARS), whose norms need every part. None: the parameters are whole.
    reduce_sums: Callable[[torch.Tensor], None] | None = None


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
        self._runs_of_blocks: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._spans: dict[int, list[tuple[int, int]]] | None = None
        self.params: tuple[torch.Tensor, ...] | None = None  # each run's parameter (per-parameter tables)
        self.derived: dict[object, object] = {}  # what a family derives from the table, kept with it

    def with_params(
        self, params: Iterable[torch.Tensor], positions: Iterable[int] | None = None, members: int | None = None
    ) -> RunTable:
        """The table, told each run's parameter (a per-parameter table: Muon reads their shapes) and, for sums
        across ranks, each run's parameter's position among the buffer's ``members`` parameters (the same
        positions on every rank, whichever parameters are active where)."""
        self.params = tuple(params)
        if len(self.params) != len(self.runs):
            raise ValueError(f"RunTable: {len(self.params)} parameters for {len(self.runs)} runs")
        self.run_members = tuple(range(len(self.runs))) if positions is None else tuple(positions)
        self.plan_members = (max(self.run_members, default=-1) + 1) if members is None else members
        return self

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

    def runs_of_blocks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each run's blocks are in :meth:`blocks` (for per-run reductions, one run per parameter): each
        run's first block and block count, each run's row, and each block's run (int64, on ``device``)."""
        table = self._runs_of_blocks.get(device)
        if table is None:
            first, counts, rows, block_runs = [], [], [], []
            for index, (start, end, row) in enumerate(self.runs):
                count = len(range(start, end, BLOCK))
                first.append(len(block_runs))
                counts.append(count)
                rows.append(row)
                block_runs.extend([index] * count)
            per_run = torch.tensor([first, counts, rows], dtype=torch.int64).to(device)
            table = self._runs_of_blocks[device] = (
                per_run[0],
                per_run[1],
                per_run[2],
                torch.tensor(block_runs, dtype=torch.int64).to(device),
            )
        return table

    def spans_by_row(self) -> dict[int, list[tuple[int, int]]]:
        """The runs cut into pieces of at most TORCH_PIECE elements, by row (the PyTorch path's calls)."""
        if self._spans is None:
            spans: dict[int, list[tuple[int, int]]] = {}
            for start, end, row in self.runs:
                spans.setdefault(row, []).extend((s, min(s + TORCH_PIECE, end)) for s in range(start, end, TORCH_PIECE))
            self._spans = spans
        return self._spans
