"""Per-family GPU micro-benchmarks for tfuse: each op family at large, realistic shapes.

Times each op family at large, realistic shapes with CUDA events (triton.testing.do_bench, median),
turns the time into GB/s from the op's minimum byte count, sets it against a device copy measured in
the same run, checks the result against torch at the same shape, and breaks batch norm into its kernels
with torch.profiler. Prints one short table last; writes everything to $OUT/micro.json.

    python3 -m benchmarks.micro              # on a GPU machine, from the repository root (2-4 minutes)
    python3 -m benchmarks.micro --dry        # tiny shapes on the CPU, PyTorch path: checks the script itself
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--dry", action="store_true")
ap.add_argument("--only", default="", help="comma-separated family names")
ap.add_argument("--no-copy", action="store_true", help="skip the copy-bandwidth measurement")
ap.add_argument("--no-profile", action="store_true", help="skip torch.profiler (needed under ncu)")
ARGS = ap.parse_args()
DRY = ARGS.dry
if DRY:
    os.environ["TFUSE_BACKEND"] = "torch"
import triton  # noqa: E402
import triton.testing  # noqa: E402

import tfuse  # noqa: E402
from tfuse.nn import FusedBatchNormAct2d  # noqa: E402
from tfuse.optim import FusedAdam, FusedMomentum, clip_grad_norm_  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
OUT = os.environ.get("OUT", ".")
RESULTS: list[dict] = []
S = 64 if DRY else 1  # shrink factor for --dry


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, rep=60):
    if DEV.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def record(family, case, ms, nbytes, copy_gbps, **extra):
    gbps = nbytes / ms / 1e6
    row = dict(family=family, case=case, ms=round(ms, 4), mbytes=round(nbytes / 1e6, 1), gbps=round(gbps, 1),
               pct_copy=round(100 * gbps / copy_gbps, 1) if copy_gbps else None, **extra)
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def copy_bw():
    n = (1 << 28) // S  # 1 GiB of float32
    src = torch.empty(n, device=DEV).uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    gbps = 2 * nbytes(src) / ms / 1e6
    RESULTS.append(dict(family="copy", case="1 GiB fp32 copy", ms=round(ms, 4), gbps=round(gbps, 1)))
    print(json.dumps(RESULTS[-1]), flush=True)
    return gbps


def fam_add(cbw):
    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(100_000_000 // S, device=DEV, dtype=dtype) for _ in range(3)]
        out = tfuse.add(*xs)
        err = rel_err(out, sum(x.double() for x in xs))
        record("add", f"a+b+c 1e8 {dtype}", bench_ms(lambda: tfuse.add(*xs)), nbytes(*xs, out), cbw, rel_err=err)
        del xs, out
    for (c, hw) in ((64, 112), (1024, 14), (2048, 7)):
        x = torch.randn(256 // min(S, 64), c, hw, hw, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(c, 1, 1, device=DEV, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        out = tfuse.add(x, b, r)
        err = rel_err(out, x.double() + b.double() + r.double())
        record("add", f"NCHW x+bias[C,1,1]+res C={c} {hw}x{hw} bf16", bench_ms(lambda: tfuse.add(x, b, r)),
               nbytes(x, r, out), cbw, rel_err=err, eager_ms=round(bench_ms(lambda: x + b + r), 4))
        del x, b, r, out


def fam_add_act(cbw):
    cases = [("gelu", torch.bfloat16, (16384, 16384)), ("gelu_tanh", torch.bfloat16, (16384, 16384)),
             ("relu", torch.float32, (16384, 16384)), ("silu", torch.bfloat16, (8192, 8192))]
    ref = {"gelu": torch.nn.functional.gelu, "relu": torch.relu, "silu": torch.nn.functional.silu,
           "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh")}
    for act, dtype, shape in cases:
        shape = (shape[0] // S, shape[1] // S) if DRY else shape
        x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
        b = torch.randn(shape[1], device=DEV, dtype=dtype, requires_grad=True)
        dy = torch.randn(shape, device=DEV, dtype=dtype)
        y = tfuse.add_act(x, b, act=act)
        err = rel_err(y, ref[act](x.detach().float() + b.detach().float()))
        record("add_act", f"{act} [T,H]+[H] {shape} {dtype} fwd", bench_ms(lambda: tfuse.add_act(x.detach(), b.detach(), act=act)),
               2 * nbytes(x), cbw, rel_err=err,
               eager_ms=round(bench_ms(lambda: ref[act](x.detach() + b.detach())), 4))
        y = tfuse.add_act(x, b, act=act)
        ms_fb = bench_ms(lambda: torch.autograd.grad(tfuse.add_act(x, b, act=act), (x, b), dy))
        ms_f = bench_ms(lambda: tfuse.add_act(x, b, act=act))
        record("add_act", f"{act} [T,H]+[H] {shape} {dtype} bwd (fwd+bwd minus fwd)", max(ms_fb - ms_f, 1e-6),
               3 * nbytes(x), cbw, fwd_bwd_ms=round(ms_fb, 4))
        del x, b, dy, y
    x = torch.randn(256 // min(S, 64), 2048, 7, 7, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2048, 1, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    ms_f = bench_ms(lambda: tfuse.add_act(x, b, act="silu"))
    ms_fb = bench_ms(lambda: torch.autograd.grad(tfuse.add_act(x, b, act="silu"), (x, b), dy))
    record("add_act", "silu NCHW+[C,1,1] 256x2048x7x7 bf16 fwd", ms_f, 2 * nbytes(x), cbw)
    record("add_act", "silu NCHW+[C,1,1] 256x2048x7x7 bf16 bwd", max(ms_fb - ms_f, 1e-6), 3 * nbytes(x), cbw)


def bn_profile(layer, x, skip, dy):
    """Per-kernel device time (us) of one training forward+backward, from torch.profiler."""
    if DEV.type != "cuda" or ARGS.no_profile:
        return {}
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        torch.autograd.grad(layer(x, skip), (x,), dy)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(layer(x, skip), (x,), dy)
        sync()
    out = {}
    for ev in prof.key_averages():
        if ev.device_type is not None and "cuda" in str(ev.device_type).lower() and ev.count:
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            out[ev.key[:60]] = round(t / ev.count, 1)
    return out


def fam_bn(cbw):
    shapes = [((256, 64, 112, 112), False), ((256, 64, 112, 112), True), ((256, 1024, 14, 14), False),
              ((256, 2048, 7, 7), False), ((256, 2048, 7, 7), True), ((256, 256, 56, 56), False)]
    for shape, cl in shapes:
        if DRY:
            shape = (4, shape[1] // 16, max(shape[2] // 16, 2), max(shape[3] // 16, 2))
        fmt = torch.channels_last if cl else torch.contiguous_format
        x = torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(memory_format=fmt).requires_grad_()
        skip = torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(memory_format=fmt)
        dy = torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(memory_format=fmt)
        layer = FusedBatchNormAct2d(shape[1], act="relu").to(DEV, torch.bfloat16)
        ref = torch.nn.BatchNorm2d(shape[1]).to(DEV, torch.bfloat16)
        tag = f"{'x'.join(map(str, shape))} {'CL' if cl else 'NCHW'} bf16 +res relu"
        y = layer(x, skip)
        err = rel_err(y, torch.relu(ref(x.detach()).float() + skip.float()))
        size = nbytes(x)
        ms_f = bench_ms(lambda: layer(x, skip))
        ms_fb = bench_ms(lambda: torch.autograd.grad(layer(x, skip), (x,), dy))
        eager_f = bench_ms(lambda: torch.relu(ref(x) + skip))
        eager_fb = bench_ms(lambda: torch.autograd.grad(torch.relu(ref(x) + skip), (x,), dy))
        record("bn_act", f"{tag} train fwd", ms_f, 4 * size, cbw, rel_err=err, eager_ms=round(eager_f, 4))
        record("bn_act", f"{tag} train fwd+bwd", ms_fb, (4 + 7) * size, cbw, eager_ms=round(eager_fb, 4),
               kernels_us=bn_profile(layer, x, skip, dy))
        del x, skip, dy, y


def fam_optim(cbw):
    from benchmarks.optim import gpt2_small_shapes, resnet50_shapes
    cases = (("adam", torch.float32, False), ("momentum", torch.float32, False), ("adam", torch.bfloat16, True))
    for name, shapes in (("ResNet-50", resnet50_shapes()), ("GPT-2 small", gpt2_small_shapes())):
        if DRY:
            shapes = shapes[:6]
        for algo, dtype, master in cases:
            params = [torch.nn.Parameter((torch.randn(s, device=DEV) * 0.02).to(dtype)) for s in shapes]
            for p in params:
                p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(dtype)
            numel = sum(p.numel() for p in params)
            tparams = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
            for p, q in zip(tparams, params):
                p.grad = q.grad.detach().float().clone()
            opt = (FusedAdam(params, lr=1e-3, master_weights=master) if algo == "adam"
                   else FusedMomentum(params, lr=1e-3))
            topt = (torch.optim.Adam(tparams, lr=1e-3, foreach=False) if algo == "adam"
                    else torch.optim.SGD(tparams, lr=1e-3, momentum=0.9, foreach=False))
            for _ in range(3):  # correctness: three steps against torch's for-loop in float32
                opt.step()
                topt.step()
            err = rel_err(torch.cat([p.detach().float().flatten() for p in params]),
                          torch.cat([p.detach().flatten() for p in tparams]))
            ms = bench_ms(opt.step)
            if algo == "adam":
                tfused = torch.optim.Adam(tparams, lr=1e-3, fused=DEV.type == "cuda")
            else:
                tfused = torch.optim.SGD(tparams, lr=1e-3, momentum=0.9, fused=DEV.type == "cuda")
            tfused.step()
            tms = bench_ms(tfused.step)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                opt.step()
            host_ms = (time.perf_counter() - t0) / 20 * 1e3  # enqueue time (no sync inside unless AMP)
            sync()
            # Minimum bytes: param+grad read, param written, state read+written (+fp32 master read+written).
            esz = torch.tensor([], dtype=dtype).element_size()
            states = 2 if algo == "adam" else 1
            per = 3 * esz + 2 * 4 * states + (8 if master else 0)
            tag = f"{dtype}".replace("torch.", "") + (" +master" if master else "")
            record("optim", f"{name} {algo} {tag} ({numel / 1e6:.1f}M)", ms, per * numel, cbw, rel_err=err,
                   torch_fused_fp32_ms=round(tms, 4), host_enqueue_ms=round(host_ms, 3))
            del params, tparams, opt, topt, tfused


def fam_clip(cbw):
    from benchmarks.optim import gpt2_small_shapes, resnet50_shapes
    for name, shapes in (("ResNet-50", resnet50_shapes()), ("GPT-2 small", gpt2_small_shapes())):
        if DRY:
            shapes = shapes[:6]
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, device=DEV)) for s in shapes)
        flat = tfuse.flat.FlatParams(model.parameters())
        for p in flat.params:
            p.grad = flat.grad_view(p).normal_()
        numel = sum(p.numel() for p in flat.params)
        clip_grad_norm_(flat, 1e9)
        ms = bench_ms(lambda: clip_grad_norm_(flat, 1e9))
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            clip_grad_norm_(flat, 1e9)
        host_ms = (time.perf_counter() - t0) / 10 * 1e3
        sync()
        params = list(flat.params)  # torch's clip reads p.grad: the same flat views
        tms = bench_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9))
        record("clip", f"{name} clip_grad_norm_ fp32 ({numel / 1e6:.1f}M)", ms, 12 * numel, cbw,
               torch_ms=round(tms, 4), host_wall_ms_per_call=round(host_ms, 3))


def fam_launch(cbw):
    a, b = (torch.randn(10_000, device=DEV) for _ in range(2))
    sync()
    for label, fn in (("tfuse.add 1e4", lambda: tfuse.add(a, b)), ("torch a+b 1e4", lambda: a + b),
                      ("tfuse.add_act gelu 1e4", lambda: tfuse.add_act(a, b, act="gelu"))):
        fn(); sync()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        sync()
        RESULTS.append(dict(family="launch", case=label, us_per_call=round((time.perf_counter() - t0) / 200 * 1e6, 1)))
        print(json.dumps(RESULTS[-1]), flush=True)


def _host_profile(label, fn, calls):
    """Wall time per call with the device synchronised once at the end, and cProfile's top functions."""
    import cProfile
    import io
    import pstats

    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    us = (time.perf_counter() - t0) / calls * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    RESULTS.append(dict(family="host", case=label, us_per_call=round(us, 1)))
    print(json.dumps(RESULTS[-1]), flush=True)
    print(text.getvalue()[-3500:], flush=True)


def fam_host(cbw):
    """Host time per call of small ops, where launch overhead, not bandwidth, decides."""

    @triton.jit
    def _noop_kernel(x_ptr, n, BLOCK: triton.language.constexpr):
        offs = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
        triton.language.store(x_ptr + offs, 1.0, mask=offs < n)

    a = torch.randn(1024, device=DEV)
    if DEV.type == "cuda":
        _host_profile("bare triton launch, 3 args", lambda: _noop_kernel[(1,)](a, 1024, BLOCK=1024), 500)
    b = torch.randn(1024, device=DEV)
    _host_profile("tfuse.add 1e3", lambda: tfuse.add(a, b), 500)
    layer = FusedBatchNormAct2d(64, act="relu").to(DEV)
    x = torch.randn(8, 64, 7, 7, device=DEV, requires_grad=True)
    skip = torch.randn_like(x)
    dy = torch.randn_like(x)
    _host_profile("FusedBatchNormAct2d 8x64x7x7 fwd+bwd", lambda: torch.autograd.grad(layer(x, skip), (x,), dy), 200)
    from benchmarks.optim import resnet50_shapes
    params = [torch.nn.Parameter(torch.randn(s, device=DEV)) for s in resnet50_shapes()[: 6 if DRY else None]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = FusedAdam(params, lr=1e-5)
    _host_profile("FusedAdam.step ResNet-50 set", opt.step, 100)
    flat = opt.param_groups and params
    _host_profile("clip_grad_norm_ ResNet-50 set", lambda: clip_grad_norm_(flat, 1e9), 30)


FAMILIES = dict(host=fam_host, launch=fam_launch, add=fam_add, add_act=fam_add_act, bn=fam_bn, optim=fam_optim, clip=fam_clip)


def main():
    head = dict(torch=torch.__version__, triton=triton.__version__,
                device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (dry run)")
    print(json.dumps(head), flush=True)
    cbw = None if ARGS.no_copy else copy_bw()
    chosen = [f for f in ARGS.only.split(",") if f] or [f for f in FAMILIES if f != "host"]
    for fam in chosen:
        t0 = time.perf_counter()
        try:
            FAMILIES[fam](cbw)
        except Exception:  # noqa: BLE001 - report and go on with the next family
            RESULTS.append(dict(family=fam, error=traceback.format_exc()[-2000:]))
            print(RESULTS[-1]["error"], file=sys.stderr, flush=True)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        print(f"# {fam} done in {time.perf_counter() - t0:.1f}s", flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "micro.json"), "w") as f:
        json.dump(dict(head=head, copy_gbps=cbw, results=RESULTS), f, indent=1)
    print("\nfamily   | case | ms | GB/s | % copy | extra")
    for r in RESULTS:
        if "gbps" in r and r["family"] != "copy":
            extra = {k: v for k, v in r.items() if k in ("eager_ms", "torch_fused_fp32_ms", "torch_ms", "host_wall_ms_per_call", "rel_err")}
            print(f"{r['family']:8} | {r['case'][:58]:58} | {r['ms']:8.4f} | {r['gbps']:7.1f} | {r['pct_copy']}% | {extra}")
        elif "us_per_call" in r:
            print(f"{r['family']:8} | {r['case']} | {r['us_per_call']} us/call")
        elif "error" in r:
            print(f"{r['family']:8} | ERROR (see stderr)")


if __name__ == "__main__":
    main()
