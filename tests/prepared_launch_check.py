"""Run without TRITON_INTERPRET (by tests/test_launch_seam.py): tfuse's prepared launches against a stub driver.

Triton's launch path exists only for compiled kernels, which need a GPU to
run; here compilation and the driver are stubbed (as the host census does),
and the stub records what each launch was given. Checks, printing ``ok``:

* the first launch of a specialisation goes through Triton (binding,
  specialisation, the kernel cache); a repeat is a prepared launch, handed
  the repeat's own tensors (new data pointers);
* a changed dtype, an unaligned view, an integer that becomes 1 or a
  multiple of 16, a tuple of another length, None for a tensor: Triton's
  path again (a new specialisation), with the right arguments; an
  unaligned tensor's launch is prepared for unaligned pointers only;
* launches on another device index do not reuse a prepared launch;
* a LaunchPlan held by an op behaves the same; counting and watching still see every launch.
"""

import collections
import os
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks import host  # noqa: E402
from tfuse import _launch  # noqa: E402


@triton.jit
def _scale_kernel(x, pair, n, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass


launched: list[tuple] = []  # what the stub launcher was handed: (grid, args)
bound = collections.Counter()  # launches that went through Triton's own path


class RecordingKernel(host._StubKernel):
    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
        launched.append(((gx, gy, gz), args, self))


real_run = _scale_kernel.run


def counting_run(*args, **kwargs):
    bound["triton"] += 1
    return real_run(*args, **kwargs)


_scale_kernel.run = counting_run
meta = dict(BLOCK=64, num_warps=4)
device = torch.device("cpu")


def go(x, pair, n, alpha=0.5, index=None):
    before = bound["triton"]
    dev = device if index is None else torch.device("cpu", index)
    _launch.launch(_scale_kernel, (3, 2), (x, pair, n, alpha), meta, dev)
    grid, args, _ = launched[-1]
    assert grid == (3, 2, 1), grid
    assert args[0] is x and args[1] is pair and args[2] == n, "the launch was handed other arguments"
    assert args[4:] == (64, True), f"constexprs passed after the runtime arguments: {args[4:]}"
    return "triton" if bound["triton"] > before else "prepared"


with host.triton_path("stub", count=False):
    import triton.runtime.jit as jit

    stub_compile = jit.JITFunction._do_compile

    def recording_compile(self, key, *rest):
        kernel = self.device_caches[rest[1]][0][key] = RecordingKernel(_launch.kernel_name(self))
        return kernel

    jit.JITFunction._do_compile = recording_compile
    try:
        a, b = torch.zeros(64), torch.zeros(64)
        assert go(a, (a, b), 100) == "triton"
        c, d = torch.ones(64), torch.ones(64)
        assert go(c, (c, d), 100) == "prepared"  # same specialisation, other tensors
        assert go(c, (c, d), 101) == "prepared"  # an integer of the same class
        aligned_kernel = launched[-1][2]
        assert go(c.double(), (c, d), 100) == "triton"  # another dtype
        assert go(c.double(), (c, d), 100) == "prepared"  # ... prepared in its turn
        assert go(c[1:], (c, d), 100) == "triton"  # an unaligned view: Triton compiles it apart
        unaligned_kernel = launched[-1][2]
        assert unaligned_kernel is not aligned_kernel
        assert go(c[2:], (c, d), 100) == "prepared" and launched[-1][2] is unaligned_kernel  # unaligned pointers
        assert go(c, (c, d), 100) == "prepared" and launched[-1][2] is aligned_kernel  # aligned: the aligned kernel
        assert go(c, (c, d[1:]), 100) == "triton"  # inside a tuple
        assert go(c, (c, d), 1) == "triton"  # an integer that became 1
        assert go(c, (c, d), 96) == "triton"  # ... a multiple of 16
        assert go(c, (c, d), 2**40) == "triton"  # ... 64-bit
        assert go(c, (c, d), 100, alpha=2) == "triton"  # a float argument passed as an int
        before = bound["triton"]
        try:
            go(c, (c, None), 100)  # None where a tensor was: Triton's path (which may refuse it)
        except Exception:
            pass
        assert bound["triton"] == before + 1
        assert go(c, (c, d), 100, index=1) == "triton"  # another device
        plan = _launch.LaunchPlan(_scale_kernel, (3, 2), meta)
        before = bound["triton"]
        plan((c, (c, d), 100, 0.5), device)
        plan((a, (a, b), 100, 0.5), device)
        assert bound["triton"] == before + 1 and launched[-1][1][0] is a
        seen = []
        with _launch.count_launches() as counted, _launch.watch_launches(lambda *launch: seen.append(launch)):
            go(c, (c, d), 100)
            plan((a, (a, b), 100, 0.5), device)
        assert counted.total == 2 and len(seen) == 2
        with _launch.watch_launches(lambda *launch: None, run=False):
            count = len(launched)
            _launch.launch(_scale_kernel, (3, 2), (c, (c, d), 100, 0.5), meta, device)
            assert len(launched) == count, "run=False launched"
    finally:
        jit.JITFunction._do_compile = stub_compile
print("ok")
