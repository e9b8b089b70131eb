"""What LAMB and LARS share: updates scaled per parameter by a ratio of its norms (a trust ratio).

:class:`PerParameterFamily` is the base of such families: each parameter is a
run of its own (the engine does not merge neighbours), the Triton path is three
launches per flat buffer (``kernels/trust.py``) with :func:`trust_ratios` in
the middle, and the PyTorch path runs torch's foreach ops over whole
parameters (:class:`WholeParameters`), in float32 for float16/bfloat16.
"""

from __future__ import annotations

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
    # Why a shard owner cannot update part of a parameter (ShardedOptimizer's refusal says it).
    whole_parameter_reason = (
        "scales each parameter by a ratio of its norms, and a parameter split across two ranks' shards would need "
        "its norms from both"
    )

    def torch_update(self, buffers: FlatBuffers, table: RunTable, rows, grad_scale, found_inf) -> None:
        by_row: dict[int, list[tuple[int, int]]] = {}
        for start, end, row in table.runs:
            by_row.setdefault(row, []).append((start, end))
        for row, spans in by_row.items():
            self.torch_rows(rows[row], WholeParameters(buffers, spans), grad_scale, found_inf)

    def torch_rows(self, hyper: Any, whole: WholeParameters, grad_scale, found_inf) -> None:
        """One row's parameters on the PyTorch path."""
        raise NotImplementedError

    def torch_call(self, hyper, params, grads, states, grad_scale, found_inf=None):
        raise NotImplementedError(f"{self.name}'s PyTorch path is torch_update (whole parameters)")

    def torch_words(self, kernel: str) -> str:
        return "torch's foreach ops (_foreach_norm for the trust ratios, elementwise arithmetic)"

    def probe_sequences(self, kernel: str) -> list[list[Any]]:
        return []  # never probed: low precision always goes through float32 (native_low_precision)
