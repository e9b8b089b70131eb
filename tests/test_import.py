"""``import tfuse`` costs about what ``import torch`` does: it pulls in neither torch._dynamo nor Inductor (torch
imports those lazily, and registering tfuse's torch.library ops waits for dynamo) nor Triton (the kernels are
imported when first launched), and the ops are there once dynamo loads."""

from __future__ import annotations

import os
import sys

from helpers import run_command

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "triton")  # triton: imported by the first kernel launch


def _python(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TFUSE_BACKEND")}
    result = run_command([sys.executable, "-c", code], env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_import_tfuse_loads_neither_dynamo_nor_inductor_nor_triton_and_the_first_op_runs():
    loaded = _python(
        f"import sys, torch, tfuse; print(*[m for m in {HEAVY!r} if m in sys.modules] or ['none']); "
        "print(tfuse.add(torch.ones(3), torch.ones(3)).tolist(), 'triton' in sys.modules)"
    )
    assert loaded == ["none", "[2.0,", "2.0,", "2.0]", "True"]  # (the first op imports triton, if installed)


def test_the_ops_are_registered_when_dynamo_loads_before_or_after_tfuse_or_by_hand():
    # register_library() imports torch._dynamo first, whose import hook registers the ops: "by hand" is also
    # "dynamo imported after tfuse", in the same process.
    after = _python(
        "import torch, tfuse; tfuse.ops.register_library(); print(torch.ops.tfuse.add([torch.ones(2)] * 3)); "
        "import torch._dynamo; print(hasattr(torch.ops.tfuse, 'add_act'))"
    )
    before = _python("import torch, torch._dynamo; import tfuse; print(hasattr(torch.ops.tfuse, 'batch_norm_act'))")
    assert after == ["tensor([3.,", "3.])", "True"] and before == ["True"]
