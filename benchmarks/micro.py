"""Per-family GPU micro-benchmark: every op family at large, realistic shapes, in one short run.

For each case it reports the median device time (``triton.testing.do_bench``),
GB/s over the op's minimum byte count (each input read once, each output
written once), that as a percentage of a device copy measured in the same run,
a correctness check against torch at the same shape, and the eager-PyTorch
time of the same computation. Batch norm and the optimizers are broken down per kernel with
``torch.profiler``; the ``host`` family measures host time per call, which
``do_bench`` hides when it is shorter than its cache flush.

Run from the repository root::

    python -m benchmarks.micro                         # GPU: every family, 2-4 minutes
    python -m benchmarks.micro --only host,clip        # some families
    python -m benchmarks.micro --dry                   # CPU: tiny shapes, PyTorch path; checks the script
    python -m benchmarks.micro --render micro.json --out benchmarks/results/micro-h100.md

Writes ``$OUT/micro.json`` (or ``--json PATH``; with neither, into a new temporary folder, named in the
output); exits 1 if a correctness check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

# Correctness: relative error ||out - ref|| / ||ref|| against a float64 (or float32 torch) reference.
REL_ERR_LIMIT = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


@dataclasses.dataclass
class Run:
    """What every family gets: device, shrink factor for dry runs, copy bandwidth, and the result rows."""

    device: torch.device
    dry: bool
    profile: bool
    copy_gbps: float | None = None
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def median_ms(self, fn: Callable[[], Any], rep_ms: int = 60) -> float:
        """Median device time of ``fn``; wall time of a few calls on the CPU."""
        if self.device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=15, rep=rep_ms, return_mode="median"))
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def record(self, family: str, case: str, ms: float, nbytes: int | None = None, *, dtype: torch.dtype | None = None,
               rel_err: float | None = None, limit: float | None = None, **extra: Any) -> dict[str, Any]:
        """Adds a row: time, GB/s over ``nbytes``, % of the copy, and the correctness verdict.

        The verdict compares ``rel_err`` with ``limit`` (default: the dtype's entry of REL_ERR_LIMIT).
        """
        row: dict[str, Any] = dict(family=family, case=case, ms=round(ms, 4))
        if nbytes is not None:
            gbps = nbytes / ms / 1e6
            row.update(mbytes=round(nbytes / 1e6, 1), gbps=round(gbps, 1))
            if self.copy_gbps:
                row["pct_copy"] = round(100 * gbps / self.copy_gbps, 1)
        if rel_err is not None:
            row["rel_err"] = float(f"{rel_err:.3g}")
            row["ok"] = bool(rel_err <= (limit if limit is not None else REL_ERR_LIMIT[dtype or torch.float32]))
        row.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in extra.items()})
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        return row


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _shrink(shape: tuple[int, ...], run: Run, floor: int = 2) -> tuple[int, ...]:
    """Dry runs: every dimension divided by 16 (at least ``floor``), so the script's logic runs in seconds."""
    return tuple(max(floor, d // 16) for d in shape) if run.dry else shape


# --------------------------------------------------------------------------- families


def fam_copy(run: Run) -> None:
    """Device copy bandwidth (bytes read + written), the reference for every % column."""
    n = (1 << 28) if not run.dry else (1 << 20)
    src = torch.empty(n, device=run.device).uniform_()
    dst = torch.empty_like(src)
    ms = run.median_ms(lambda: dst.copy_(src))
    run.copy_gbps = 2 * nbytes(src) / ms / 1e6
    run.record("copy", f"{nbytes(src) >> 20} MiB float32 copy", ms, 2 * nbytes(src))


def fam_add(run: Run) -> None:
    import tfuse

    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(100_000_000 if not run.dry else 100_000, device=run.device, dtype=dtype) for _ in range(3)]
        out = tfuse.add(*xs)
        err = rel_err(out, sum(x.double() for x in xs))
        run.record("add", f"a+b+c 1e8 {_name(dtype)}", run.median_ms(lambda: tfuse.add(*xs)), nbytes(*xs, out),
                   dtype=dtype, rel_err=err, eager_ms=run.median_ms(lambda: xs[0] + xs[1] + xs[2]))
        del xs, out
    for c, hw in ((64, 112), (1024, 14), (2048, 7)):
        n, c = (256, c) if not run.dry else (2, c // 16)
        x = torch.randn(n, c, hw, hw, device=run.device, dtype=torch.bfloat16)
        bias = torch.randn(c, 1, 1, device=run.device, dtype=torch.bfloat16)
        res = torch.randn_like(x)
        out = tfuse.add(x, bias, res)
        err = rel_err(out, x.double() + bias.double() + res.double())
        run.record("add", f"NCHW x+bias[C,1,1]+res {n}x{c}x{hw}x{hw} bf16", run.median_ms(lambda: tfuse.add(x, bias, res)),
                   nbytes(x, res, out), dtype=torch.bfloat16, rel_err=err, eager_ms=run.median_ms(lambda: x + bias + res))
        del x, bias, res, out


def _torch_act(act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.nn.functional as F

    return {"gelu": F.gelu, "relu": torch.relu, "silu": F.silu,
            "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[act]


def fam_add_act(run: Run) -> None:
    import tfuse

    cases = [("gelu", torch.bfloat16, (16384, 16384), "row"), ("gelu_tanh", torch.bfloat16, (16384, 16384), "row"),
             ("relu", torch.float32, (16384, 16384), "row"), ("silu", torch.bfloat16, (8192, 8192), "row"),
             ("silu", torch.bfloat16, (256, 2048, 7, 7), "channel")]
    for act, dtype, shape, pattern in cases:
        shape = _shrink(shape, run, floor=4)
        ref_act = _torch_act(act)
        x = torch.randn(shape, device=run.device, dtype=dtype, requires_grad=True)
        bias_shape = (shape[-1],) if pattern == "row" else (shape[1], 1, 1)
        bias = torch.randn(bias_shape, device=run.device, dtype=dtype, requires_grad=True)
        dy = torch.randn(shape, device=run.device, dtype=dtype)
        tag = f"{act} {'x'.join(map(str, shape))} + {'[H]' if pattern == 'row' else '[C,1,1]'} {_name(dtype)}"
        y = tfuse.add_act(x, bias, act=act)
        err = rel_err(y, ref_act(x.detach().double() + bias.detach().double()))
        xd, bd = x.detach(), bias.detach()
        fwd_ms = run.median_ms(lambda: tfuse.add_act(xd, bd, act=act))
        run.record("add_act", f"{tag} fwd", fwd_ms, 2 * nbytes(x), dtype=dtype, rel_err=err,
                   eager_ms=run.median_ms(lambda: ref_act(xd + bd)))
        (dx,) = torch.autograd.grad(tfuse.add_act(x, bias, act=act), (x,), dy)
        zr = (xd.double() + bd.double()).requires_grad_()
        (dx_ref,) = torch.autograd.grad(ref_act(zr), (zr,), dy.double())
        fwd_bwd_ms = run.median_ms(lambda: torch.autograd.grad(tfuse.add_act(x, bias, act=act), (x, bias), dy))
        eager_fb = run.median_ms(lambda: torch.autograd.grad(ref_act(x + bias), (x, bias), dy))
        # Backward's minimum: read dy and x (to recompute the derivative), write dx.
        run.record("add_act", f"{tag} fwd+bwd", fwd_bwd_ms, 5 * nbytes(x), dtype=dtype, rel_err=rel_err(dx, dx_ref),
                   eager_ms=eager_fb)
        del x, bias, dy, y, dx, zr, dx_ref


def _kernel_times(run: Run, fn: Callable[[], Any]) -> dict[str, float]:
    """Device time (us) per kernel name over one call of ``fn``, from torch.profiler."""
    if run.device.type != "cuda" or not run.profile:
        return {}
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    run.sync()
    calls = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        run.sync()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.count:
            times[event.key[:60]] = round(device_us / calls, 1)
    return times


def fam_bn(run: Run) -> None:
    from tfuse.nn import FusedBatchNormAct2d

    cases = [((256, 64, 112, 112), False, torch.bfloat16), ((256, 64, 112, 112), True, torch.bfloat16),
             ((256, 256, 56, 56), False, torch.bfloat16), ((256, 1024, 14, 14), False, torch.bfloat16),
             ((256, 2048, 7, 7), False, torch.bfloat16), ((256, 2048, 7, 7), True, torch.bfloat16),
             ((256, 2048, 7, 7), False, torch.float32)]
    for shape, channels_last, dtype in cases:
        if run.dry:
            shape = (4, shape[1] // 16, max(2, shape[2] // 16), max(2, shape[3] // 16))
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(shape, device=run.device, dtype=dtype).to(memory_format=fmt).requires_grad_()
        skip = torch.randn(shape, device=run.device, dtype=dtype).to(memory_format=fmt)
        dy = torch.randn(shape, device=run.device, dtype=dtype).to(memory_format=fmt)
        fused = FusedBatchNormAct2d(shape[1], act="relu").to(run.device, dtype)
        eager = torch.nn.BatchNorm2d(shape[1]).to(run.device, dtype)
        tag = f"{'x'.join(map(str, shape))} {'CL' if channels_last else 'NCHW'} {_name(dtype)} +res relu"
        y = fused(x, skip)
        ref = torch.relu(torch.nn.functional.batch_norm(x.detach().double(), None, None, training=True) + skip.double())
        size = nbytes(x)
        fwd_ms = run.median_ms(lambda: fused(x, skip))
        run.record("bn_act", f"{tag} train fwd", fwd_ms, 4 * size, dtype=dtype, rel_err=rel_err(y, ref),
                   eager_ms=run.median_ms(lambda: torch.relu(eager(x) + skip)))
        step = lambda: torch.autograd.grad(fused(x, skip), (x,), dy)  # noqa: E731
        (dx,) = step()
        xr = x.detach().double().requires_grad_()
        yr = torch.relu(torch.nn.functional.batch_norm(xr, None, None, training=True) + skip.double())
        (dx_ref,) = torch.autograd.grad(yr, (xr,), dy.double())
        # Batch norm's input gradient cancels (dy minus its projections), so in 16-bit its error grows as the
        # channel gets smaller; the check is "no worse than eager PyTorch in the same dtype, or the dtype's limit".
        (dx_eager,) = torch.autograd.grad(torch.relu(eager(x) + skip), (x,), dy)
        dx_limit = max(REL_ERR_LIMIT[dtype], 1.5 * rel_err(dx_eager, dx_ref))
        # Training fwd+bwd minimum: read x twice (statistics, normalise), skip, write y; backward reads x, dy
        # twice (reduce, then dx) and writes dx and d(skip): 11 tensor passes.
        run.record("bn_act", f"{tag} train fwd+bwd", run.median_ms(step), 11 * size, dtype=dtype,
                   rel_err=rel_err(dx, dx_ref), limit=dx_limit,
                   eager_ms=run.median_ms(lambda: torch.autograd.grad(torch.relu(eager(x) + skip), (x,), dy)),
                   kernels_us=_kernel_times(run, step))
        del x, skip, dy, y, ref, dx, xr, yr, dx_ref, dx_eager


def _model_shapes(run: Run) -> list[tuple[str, list[tuple[int, ...]]]]:
    from benchmarks.optim import gpt2_small_shapes, resnet50_shapes

    models = [("ResNet-50", resnet50_shapes()), ("GPT-2 small", gpt2_small_shapes())]
    if run.dry:
        models = [(name, [_shrink(s, run, floor=1) for s in shapes[:12]]) for name, shapes in models]
    return models


def _lion_reference_step(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> None:
    """Lion (Chen et al. 2023, Algorithm 2) per tensor, betas (0.9, 0.99): torch has none to compare with."""
    with torch.no_grad():
        for p in params:
            m = p.__dict__.setdefault("_lion_m", torch.zeros_like(p))
            direction = m * 0.9 + p.grad * 0.1
            p.mul_(1 - lr * weight_decay).add_(torch.sign(direction), alpha=-lr)
            m.mul_(0.99).add_(p.grad, alpha=0.01)


def _lamb_reference_step(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> None:
    """LAMB (You et al. 2019, Algorithm 2) per tensor, betas (0.9, 0.999), eps 1e-6, bias correction."""
    with torch.no_grad():
        for p in params:
            state = p.__dict__.setdefault("_lamb", {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "t": 0})
            state["t"] += 1
            state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
            state["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
            u = (state["m"] / (1 - 0.9 ** state["t"])) / ((state["v"] / (1 - 0.999 ** state["t"])).sqrt() + 1e-6)
            u += weight_decay * p
            w_norm, u_norm = p.norm(), u.norm()
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            p.sub_(u * (lr * ratio))


def _lars_reference_step(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> None:
    """LARS (You et al. 2017, Algorithm 1; MLPerf's form), momentum 0.9, eta 0.001, per tensor."""
    with torch.no_grad():
        for p in params:
            velocity = p.__dict__.setdefault("_lars_v", torch.zeros_like(p))
            w_norm, g_norm = p.norm(), p.grad.norm()
            ratio = torch.where((w_norm > 0) & (g_norm > 0), 0.001 * w_norm / (g_norm + weight_decay * w_norm),
                                torch.ones_like(w_norm))
            velocity.mul_(0.9).add_((p.grad + weight_decay * p) * (lr * ratio))
            p.sub_(velocity)


class _MuonReference:
    """torch's Muon maths one matrix at a time (torch.optim's functional ``muon`` on each weight's (size(0), -1)
    matrix, convolution weights included) and torch's AdamW (lr 3e-4, betas (0.9, 0.95), eps 1e-10) for the other
    parameters: what FusedMuon computes, as a per-parameter loop."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        self.lr, self.matrices = lr, [p for p in params if p.dim() >= 2]
        self.buffers = [torch.zeros(p.shape[0], p.numel() // p.shape[0], device=p.device) for p in self.matrices]
        others = [p for p in params if p.dim() < 2]
        self.adamw = torch.optim.AdamW(others, lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0) if others else None

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim._muon import muon

        for param, buffer in zip(self.matrices, self.buffers):
            matrix = param.reshape(buffer.shape).clone()
            muon([matrix], [param.grad.reshape(buffer.shape)], [buffer], lr=self.lr, weight_decay=0.1, momentum=0.95,
                 nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None,
                 has_complex=False)
            param.copy_(matrix.view(param.shape))
        if self.adamw is not None:
            self.adamw.step()


def _torch_fastest(cls: type, params: list, options: dict, device: torch.device) -> torch.optim.Optimizer:
    """torch's optimizer over ``params``, stepped once: fused=True on CUDA, or foreach=True where torch has no
    fused CUDA kernel for the class (Adagrad); torch's default elsewhere."""
    from benchmarks.optim import torch_has_fused

    if device.type != "cuda":
        flags = {}
    else:
        flags = dict(fused=True) if torch_has_fused(cls, device) else dict(foreach=True)
    optimizer = cls(params, **options, **flags)
    optimizer.step()
    return optimizer


def _torch_muon_step(params: list[torch.nn.Parameter]) -> Callable[[], None] | None:
    """torch.optim.Muon over the matrices and torch's fused AdamW over the rest (None: torch's Muon refuses
    weights with more than two dimensions)."""
    if any(p.dim() > 2 for p in params):
        return None
    muon = torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.02)
    others = [p for p in params if p.dim() < 2]
    fused = dict(fused=True) if params[0].device.type == "cuda" else {}
    adamw = torch.optim.AdamW(others, lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0, **fused) if others else None

    def step() -> None:
        muon.step()
        if adamw is not None:
            adamw.step()

    return step


def _muon_limit(params: list[torch.Tensor], steps: int, lr: float) -> float:
    """The relative error two correct Muon implementations may reach: their bfloat16 Newton-Schulz iterations may
    round a few entries of O an ulp apart (torch's CPU mm and bmm do, on some tiny matrices), so each step may move
    an element by up to lr * ratio * 2**-4 (tests/optim_helpers.muon_ns_slack); a wrong update moves it by about
    lr * ratio, 16x more."""
    import math

    bound = 0.0
    for p in (p for p in params if p.dim() >= 2):
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        bound += p.numel() * (steps * lr * math.sqrt(max(1.0, rows / cols)) * 2**-4) ** 2
    total = math.sqrt(sum(float(p.detach().double().square().sum()) for p in params))
    return math.sqrt(bound) / max(total, 1e-30)


def fam_optim(run: Run) -> None:
    from tfuse.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedLARS, FusedLion, FusedMomentum, FusedMuon

    # name -> (tfuse optimizer, torch.optim class and options or None, state tensors per parameter)
    algorithms = {
        "adam": (lambda ps, m: FusedAdam(ps, lr=1e-3, master_weights=m), (torch.optim.Adam, dict(lr=1e-3)), 2),
        "momentum": (lambda ps, m: FusedMomentum(ps, lr=1e-3, master_weights=m),
                     (torch.optim.SGD, dict(lr=1e-3, momentum=0.9)), 1),
        "adagrad": (lambda ps, m: FusedAdagrad(ps, lr=1e-3, master_weights=m), (torch.optim.Adagrad, dict(lr=1e-3)), 1),
        "lion": (lambda ps, m: FusedLion(ps, lr=1e-4, weight_decay=0.1, master_weights=m), None, 1),
        "lamb": (lambda ps, m: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, master_weights=m), None, 2),
        "lars": (lambda ps, m: FusedLARS(ps, lr=1.0, weight_decay=5e-5, master_weights=m), None, 1),
        "muon": (lambda ps, m: FusedMuon(ps, lr=0.02, master_weights=m), None, 1),
    }
    cases = (("adam", torch.float32, False), ("momentum", torch.float32, False), ("adam", torch.bfloat16, True),
             ("adagrad", torch.float32, False), ("lion", torch.float32, False), ("lamb", torch.float32, False),
             ("lars", torch.float32, False), ("muon", torch.float32, False))
    for model, shapes in _model_shapes(run):
        for algo, dtype, master in cases:
            make, torch_class, states = algorithms[algo]
            params = [torch.nn.Parameter((torch.randn(s, device=run.device) * 0.02).to(dtype)) for s in shapes]
            for p in params:
                p.grad = (torch.randn(p.shape, device=run.device) * 1e-3).to(dtype)
            numel = sum(p.numel() for p in params)
            reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
            for r, p in zip(reference, params):
                r.grad = p.grad.detach().float().clone()
            opt = make(params, master)
            ref_opt = None if torch_class is None else torch_class[0](reference, **torch_class[1], foreach=False)
            muon_reference = _MuonReference(reference, 0.02) if algo == "muon" else None
            for _ in range(3):
                opt.step()
                if muon_reference is not None:
                    muon_reference.step()
                elif ref_opt is None and algo == "lion":
                    _lion_reference_step(reference, 1e-4, 0.1)
                elif ref_opt is None and algo == "lamb":
                    _lamb_reference_step(reference, 1e-3, 0.01)
                elif ref_opt is None:
                    _lars_reference_step(reference, 1.0, 5e-5)
                else:
                    ref_opt.step()
            err = rel_err(torch.cat([p.detach().float().flatten() for p in params]),
                          torch.cat([r.detach().flatten() for r in reference]))
            ms = run.median_ms(opt.step)
            torch_ms = None
            torch_muon = _torch_muon_step(reference) if algo == "muon" else None
            if torch_muon is not None:  # torch's Muon loop (bfloat16 iterations, as FusedMuon's) and fused AdamW
                torch_muon()
                torch_ms = run.median_ms(torch_muon)
            if torch_class is not None:
                torch_fused = _torch_fastest(torch_class[0], reference, torch_class[1], run.device)
                torch_ms = run.median_ms(torch_fused.step)
                del torch_fused
            host_ms = _host_ms(run, opt.step, 20)
            kernels_us = _kernel_times(run, opt.step)  # device time alone, whatever the host costs
            # Minimum bytes: param and grad read, param written; each state tensor (float32) read and
            # written; float32 master weights read and written.
            per_element = 3 * params[0].element_size() + 8 * states + (8 if master else 0)
            tag = _name(dtype) + (" +master" if master else "")
            limit = _muon_limit(reference, 3, 0.02) if algo == "muon" else None
            run.record("optim", f"{model} {algo} {tag} ({numel / 1e6:.1f}M)", ms, per_element * numel, dtype=dtype,
                       rel_err=err, limit=limit, torch_fused_fp32_ms=torch_ms, host_ms=host_ms, kernels_us=kernels_us)
            del params, reference, opt, ref_opt


def fam_clip(run: Run) -> None:
    import tfuse
    from tfuse.optim import clip_grad_norm_

    for model, shapes in _model_shapes(run):
        params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, device=run.device)) for s in shapes)
        flat = tfuse.flat.FlatParams(params.parameters())
        for p in flat.params:
            p.grad = flat.grad_view(p).normal_()
        grads = [p.grad for p in flat.params]
        expected = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
        norm = clip_grad_norm_(flat, 1e9)
        numel = sum(p.numel() for p in flat.params)
        ms = run.median_ms(lambda: clip_grad_norm_(flat, 1e9))
        torch_ms = run.median_ms(lambda: torch.nn.utils.clip_grad_norm_(list(flat.params), 1e9))
        # Minimum: read every gradient for the norm, then read and write it to scale.
        run.record("clip", f"{model} clip_grad_norm_ fp32 ({numel / 1e6:.1f}M)", ms, 12 * numel,
                   rel_err=rel_err(norm.reshape(1), expected.reshape(1)), torch_ms=torch_ms,
                   host_ms=_host_ms(run, lambda: clip_grad_norm_(flat, 1e9), 10))
        del params, flat, grads


def _host_ms(run: Run, fn: Callable[[], Any], calls: int) -> float:
    """Host (wall) time per call, the device synchronised once after all calls."""
    fn()
    run.sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    run.sync()
    return (time.perf_counter() - start) / calls * 1e3


def _host_profile(run: Run, label: str, fn: Callable[[], Any], calls: int) -> None:
    """Host time per call, and cProfile's top functions by own time (printed)."""
    import cProfile
    import io
    import pstats

    us = _host_ms(run, fn, calls) * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    run.sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    run.record("host", label, us / 1e3, us_per_call=round(us, 1))
    print(text.getvalue()[-3500:], flush=True)


def fam_host(run: Run) -> None:
    """Host time per call where launch overhead, not bandwidth, decides (small tensors)."""
    import triton
    import triton.language as tl

    import tfuse
    from tfuse.nn import FusedBatchNormAct2d
    from tfuse.optim import FusedAdam, clip_grad_norm_

    a = torch.randn(1024, device=run.device)
    b = torch.randn(1024, device=run.device)
    if run.device.type == "cuda":
        @triton.jit
        def _store_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + offsets, 1.0, mask=offsets < n)

        _host_profile(run, "bare Triton launch, 3 arguments", lambda: _store_one_kernel[(1,)](a, 1024, BLOCK=1024), 500)
        _host_profile(run, "torch a + b, 1024 elements", lambda: a + b, 500)
    _host_profile(run, "tfuse.add(a, b), 1024 elements", lambda: tfuse.add(a, b), 500)
    layer = FusedBatchNormAct2d(64, act="relu").to(run.device)
    x = torch.randn(8, 64, 7, 7, device=run.device, requires_grad=True)
    skip, dy = torch.randn_like(x), torch.randn_like(x)
    _host_profile(run, "FusedBatchNormAct2d 8x64x7x7 fwd+bwd", lambda: torch.autograd.grad(layer(x, skip), (x,), dy), 200)
    eager = torch.nn.BatchNorm2d(64).to(run.device)
    _host_profile(run, "eager BatchNorm2d+add+ReLU 8x64x7x7 fwd+bwd",
                  lambda: torch.autograd.grad(torch.relu(eager(x) + skip), (x,), dy), 200)
    (_, shapes), _ = _model_shapes(run)
    params = [torch.nn.Parameter(torch.randn(s, device=run.device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = FusedAdam(params, lr=1e-6)
    _host_profile(run, f"FusedAdam.step, ResNet-50 set ({len(params)} tensors)", opt.step, 100)
    _host_profile(run, f"clip_grad_norm_, ResNet-50 set ({len(params)} tensors)", lambda: clip_grad_norm_(params, 1e9), 30)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


FAMILIES: dict[str, Callable[[Run], None]] = dict(
    add=fam_add, add_act=fam_add_act, bn=fam_bn, optim=fam_optim, clip=fam_clip, host=fam_host,
)


# --------------------------------------------------------------------------- output


def render_markdown(data: dict[str, Any]) -> str:
    """The table of a ``micro.json``: one row per case, batch norm's kernel breakdown below it."""
    head = data["head"]
    lines = [
        "# Per-family micro-benchmark (`python -m benchmarks.micro`)", "",
        f"Machine: {head['device']}; torch {head['torch']}, triton {head['triton']}, Python {head.get('python', '?')}; "
        f"measured {head.get('date', '?')}." + (f" {head['note']}" if head.get("note") else ""), "",
        f"- Copy bandwidth measured in the same run: {data['copy_gbps']:.0f} GB/s (read + write)."
        if data.get("copy_gbps") else "- Copy bandwidth: not measured in this run.",
        "- ms: median device time (triton.testing.do_bench); GB/s over the op's minimum bytes; eager: the same "
        "computation in eager PyTorch; rel. error against a float64 (or float32 torch.optim) reference.",
        "- host ms: wall time per call with one synchronisation after many calls (what a training loop sees "
        "when the host, not the GPU, is the bottleneck).", "",
        "| family | case | ms | GB/s | % of copy | eager ms | vs eager | host ms | rel. error | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    breakdowns = []
    for row in data["results"]:
        if "error" in row:
            lines.append(f"| {row['family']} | ERROR: {row['error'].strip().splitlines()[-1][:120]} |||||||||")
            continue
        if row["family"] == "copy":
            continue
        eager = row.get("eager_ms") or row.get("torch_fused_fp32_ms") or row.get("torch_ms")
        host = row.get("host_ms")
        if row["family"] == "host":  # host time only: no device time to show
            device_ms, host = "-", row["us_per_call"] / 1e3
        else:
            device_ms = f"{row['ms']:.4f}"
        lines.append("| " + " | ".join([
            row["family"], row["case"], device_ms, _fmt(row.get("gbps"), "{:.0f}"),
            _fmt(row.get("pct_copy"), "{:.0f}%"), _fmt(eager, "{:.4f}"),
            f"{eager / row['ms']:.2f}x" if eager and row.get("ms") else "-", _fmt(host, "{:.3f}"),
            _fmt(row.get("rel_err"), "{:.2e}"), {True: "yes", False: "**NO**"}.get(row.get("ok"), "-"),
        ]) + " |")
        if row.get("kernels_us"):
            breakdowns.append((row["case"], row["kernels_us"]))
    if breakdowns:
        lines += ["", "Device time per kernel in one call (us, torch.profiler): batch norm's training forward+backward, "
                  "an optimizer step.", ""]
        for case, kernels in breakdowns:
            parts = ", ".join(f"{name.split('<')[0].strip()} {us}" for name, us in kernels.items())
            lines.append(f"- {case}: {parts}")
    lines += ["", "For torch.optim rows, 'eager ms' is torch's fused=True optimizer in float32 (foreach=True where "
              "torch has no fused kernel for the device: Adagrad on CUDA); for clip, "
              "torch.nn.utils.clip_grad_norm_.", ""]
    return "\n".join(lines)


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (PyTorch path): checks the script")
    parser.add_argument("--only", default="", help=f"comma-separated families of {', '.join(FAMILIES)} "
                        "(default: all)")
    parser.add_argument("--no-profile", action="store_true", help="skip torch.profiler (needed under ncu)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results (default: $OUT/micro.json)")
    parser.add_argument("--render", type=Path, default=None, help="print/write the markdown table of a micro.json")
    parser.add_argument("--out", type=Path, default=None, help="with --render: write the table here")
    return parser.parse_args(argv)


def main(argv: Iterable[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.render:
        table = render_markdown(json.loads(args.render.read_text()))
        if args.out:
            args.out.write_text(table)
        else:
            print(table)
        return 0
    if args.dry:
        os.environ["TFUSE_BACKEND"] = "torch"  # before tfuse is imported: the CPU path, no interpreter
    elif not torch.cuda.is_available():
        print("benchmarks.micro: no GPU here; use --dry to check the script on the CPU", file=sys.stderr)
        return 2
    import platform

    import triton

    device = torch.device("cpu" if args.dry else "cuda")
    run = Run(device=device, dry=args.dry, profile=not args.no_profile)
    head = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"),
                device=torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run: PyTorch path, tiny shapes)")
    print(json.dumps(head), flush=True)
    chosen = [f for f in args.only.split(",") if f] or list(FAMILIES)
    unknown = sorted(set(chosen) - set(FAMILIES))
    if unknown:
        print(f"benchmarks.micro: unknown families {unknown}; choose from {list(FAMILIES)}", file=sys.stderr)
        return 2
    if any(f != "host" for f in chosen):
        fam_copy(run)
    for family in chosen:
        start = time.perf_counter()
        try:
            FAMILIES[family](run)
        except Exception:  # noqa: BLE001 - report it and go on: one family's failure must not hide the others
            run.rows.append(dict(family=family, error=traceback.format_exc()[-2000:]))
            print(run.rows[-1]["error"], file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"# {family} done in {time.perf_counter() - start:.1f}s", flush=True)
    data = dict(head=head, copy_gbps=run.copy_gbps, results=run.rows)
    # Without --json or $OUT: a new folder, so that a run never drops files into the working directory.
    folder = os.environ.get("OUT") or tempfile.mkdtemp(prefix="tfuse-micro-")
    path = args.json or Path(folder) / "micro.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"# wrote {path}", flush=True)
    print()
    print(render_markdown(data))
    failed = [r for r in run.rows if r.get("ok") is False or "error" in r]
    if failed:
        print(f"benchmarks.micro: {len(failed)} case(s) failed their correctness check or raised", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
