"""Test set-up: Triton's interpreter on CPU-only machines, CUDA where present.

TRITON_INTERPRET must be set before triton is imported (Triton decides at
decoration time whether a kernel is compiled or interpreted), so this module
sets it before importing tfuse.
"""

from __future__ import annotations

import os
import random

import pytest

# Under pytest-xdist (-n auto: one worker per core), each worker and the processes it starts get their share of
# the cores for torch's intra-op threads. With more threads than that, a parallel region waits a scheduler tick
# for a thread whose core another worker holds: on 2 cores, the fusion-invariant tests of a ResNet ran 75 s on 2
# threads beside a busy worker, 3 s on one. A thread count set by the caller is kept.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
_THREADS = None
if _XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _THREADS = max(1, _cores // _XDIST_WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)  # for the processes the tests start

import torch  # noqa: E402  (after the thread count, so that torch's pool starts at its share)

if _THREADS is not None:
    torch.set_num_threads(_THREADS)

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import tfuse  # noqa: E402  (after the interpreter switch, on purpose)

# Importing tfuse with the interpreter on also skips the interpreter's unasserted int32 overflow checks (work it
# discards: values and checks unchanged; tfuse/_interpreter.py).

# The tests exercise the kernels at small shapes; on a GPU the size rule (tfuse._backend) would send those
# to the PyTorch path. tests/test_launch_seam.py tests the rule itself.
os.environ.setdefault("TFUSE_SMALL_OP_ELEMENTS", "0")

# With its index on CUDA: a tensor's device is always indexed (cuda:0), and torch.device("cuda") compares
# unequal to it, which made device checks in the tests fail on the GPU only.
DEVICE = torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")
SEED_ENV_VAR = "TFUSE_TEST_SEED"


@pytest.fixture
def device() -> torch.device:
    """Where the tests run: CUDA when present, else CPU through the interpreter."""
    return DEVICE


@pytest.fixture(autouse=True)
def fresh_random_seed(request: pytest.FixtureRequest) -> int:
    """Fresh random data each run; the seed is printed with any failure.

    Set TFUSE_TEST_SEED=N to replay a failing run.
    """
    seed = int(os.environ.get(SEED_ENV_VAR) or random.SystemRandom().randrange(2**31))
    torch.manual_seed(seed)
    request.node.tfuse_seed = seed
    return seed


@pytest.fixture(autouse=True)
def auto_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from automatic backend selection, whatever the caller's shell says."""
    monkeypatch.delenv(tfuse.BACKEND_ENV_VAR, raising=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "tfuse_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"{seed} (replay with {SEED_ENV_VAR}={seed})"))


def pytest_report_header(config: pytest.Config) -> str:
    import triton

    where = torch.cuda.get_device_name() if ON_CUDA else "CPU through Triton's interpreter"
    return f"tfuse tests on {where}; torch {torch.__version__}, triton {triton.__version__}"
