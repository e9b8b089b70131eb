"""What LAMB and LARS share: updates scaled per parameter by a ratio of its norms (a trust ratio).

:class:`PerParameterFamily` is the base of such families: each parameter is a
run of its own (the engine does not merge neighbours), the Triton path is three
launches per flat buffer (``kernels/trust.py``) with :func:`trust_ratios` in
the middle, and the PyTorch path runs torch's foreach ops over whole
parameters (:class:`WholeParameters`), in float32 for float16/bfloat16.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tfuse import kernels
from tfuse._launch import launch
from tfuse.optim._update_buffers import FlatBuffers, RunTable
from tfuse.optim._update_families import UpdateFamily

TRUST_CHUNK = 128  # partial sums a trust-ratio program adds per iteration


def trust_ratios(table: RunTable, partials: torch.Tensor, rows: torch.Tensor, device: torch.device, **columns: Any):
    """``lr * trust`` per run (parameter) from the per-block partial sums ``partials`` of a per-parameter update:
    one launch of ``_trust_ratio_kernel`` (``columns``: its LAMB or LARS row columns)."""
    run_first, run_blocks, run_rows, _ = table.runs_of_blocks(device)
    scaled_lr = torch.empty(run_first.numel(), dtype=partials.dtype, device=device)
    launch(
        kernels._trust_ratio_kernel,
        (run_first.numel(),),
        (partials, run_first, run_blocks, run_rows, rows, scaled_lr),
        dict(CHUNK=TRUST_CHUNK, **columns),
        device,
    )
    return scaled_lr


def across_ranks(table: RunTable, run_sums: torch.Tensor, reduce: Any) -> torch.Tensor:
    """Each run's partial sums ``run_sums`` (runs, 2) summed over every rank holding part of its parameter: one
    ``reduce`` (an all-reduce) of a vector indexed by the step's parameters, the same length on every rank."""
    positions = torch.tensor(table.run_members, dtype=torch.int64, device=run_sums.device)
    every = torch.zeros(table.plan_members, 2, dtype=run_sums.dtype, device=run_sums.device)
    every.index_copy_(0, positions, run_sums)
    reduce(every)
    return every.index_select(0, positions)


def sharded_scaled_lr(table: RunTable, partials: torch.Tensor, reduce: Any, scaled_lr: Any) -> torch.Tensor:
    """``lr * trust`` per run on a shard: the runs' partial sums (kernel blocks in run order, summed per run in
    that order), summed across ranks, then ``scaled_lr(norms, run_rows)`` (the family's ratio, from the norms)."""
    _, run_blocks, run_rows, _ = table.runs_of_blocks(partials.device)
    run_sums = torch.segment_reduce(partials.view(-1, 2), "sum", lengths=run_blocks, axis=0)
    return scaled_lr(across_ranks(table, run_sums, reduce).sqrt(), run_rows)


class WholeParameters:
    """One row's parameters (whole runs ``spans`` of a flat buffer) as lists for torch's foreach ops: float32
    copies of float16/bfloat16 tensors (or the float32 masters), written back once computed."""

    def __init__(self, buffers: FlatBuffers, spans: list[tuple[int, int]]) -> None:
        self.buffers, self.spans = buffers, spans
        self.low = buffers.param.dtype in (torch.float16, torch.bfloat16)
        self.source = buffers.master if buffers.master is not None else buffers.param  # what is updated

    def views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [
            tensor[s:e].float() if self.low and tensor.dtype != torch.float32 else tensor[s:e] for s, e in self.spans
        ]

    def unscaled_grads(self, grad_scale: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the gradients as found, the gradients divided by GradScaler's scale)."""
        grads = self.views(self.buffers.grad)
        return grads, grads if grad_scale is None else torch._foreach_div(grads, grad_scale.to(grads[0].dtype))

    def write(self, targets: list[tuple[torch.Tensor, list, list]], found_inf: torch.Tensor | None) -> None:
        """Each (flat tensor, old values, new values) written, rounded to nearest even; where ``found_inf`` is
        set, the old values (the flag read on the device only). Then the parameters rounded from the masters."""
        for flat, olds, news in targets:
            for (s, e), old, new in zip(self.spans, olds, news):
                flat[s:e].copy_(new if found_inf is None else torch.where(found_inf != 0, old, new))
        if self.buffers.master is not None:
            for s, e in self.spans:
                self.buffers.param[s:e].copy_(self.buffers.master[s:e])


class PerParameterFamily(UpdateFamily):
    """A family whose update scales each parameter by a ratio of its norms (LAMB, LARS)."""

    native_low_precision = False
    per_parameter = True
    launches_per_buffer = 3
    # A shard owner updates its part of a parameter once the parameter's norms are summed across the ranks
    # (FlatBuffers.reduce_sums); a family that needs the whole parameter itself (Muon) is sharded by whole
    # parameters instead (whole_parameters: ShardedOptimizer lays its buffers out so).
    sums_across_ranks = True
    whole_parameters = False

    def torch_update(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf) -> None:
        by_row: dict[int, list[int]] = {}
        for index, (_, _, row) in enumerate(table.runs):
            by_row.setdefault(row, []).append(index)
        # Each row's update is a generator: it yields its runs' squared norms (runs, 2), takes back the norms of
        # the whole parameters (None: its runs are whole parameters), then finishes.
        steps = []
        for row, indices in by_row.items():
            whole = WholeParameters(buffers, [table.runs[i][:2] for i in indices])
            steps.append((indices, self.torch_rows(rows[row], whole, grad_scale, found_inf)))
        squares = [(indices, next(step)) for indices, step in steps]
        norms = None
        if buffers.reduce_sums is not None:
            run_sums = torch.cat([s for _, s in squares])
            order = torch.tensor([i for indices, _ in squares for i in indices], device=run_sums.device)
            ordered = torch.empty_like(run_sums).index_copy_(0, order, run_sums)
            norms = across_ranks(table, ordered, buffers.reduce_sums).sqrt()
        for indices, step in steps:
            with contextlib.suppress(StopIteration):
                step.send(None if norms is None else norms[indices])

    def torch_rows(self, hyper: Any, whole: WholeParameters, grad_scale, found_inf) -> Any:
        """One row's parameters on the PyTorch path, as a generator (see torch_update)."""
        raise NotImplementedError

    def torch_call(self, hyper, params, grads, states, grad_scale, found_inf=None):
        raise NotImplementedError(f"{self.name}'s PyTorch path is torch_update (whole parameters)")

    def torch_words(self, kernel: str) -> str:
        return "torch's foreach ops (_foreach_norm for the trust ratios, elementwise arithmetic)"

    def probe_sequences(self, kernel: str) -> list[list[Any]]:
        return []  # never probed: low precision always goes through float32 (native_low_precision)
