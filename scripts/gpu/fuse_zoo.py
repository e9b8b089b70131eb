"""fuse_model on real networks (torchvision, timm) with the invariants of tests/fusion_invariants.py.

    python scripts/gpu/fuse_zoo.py                # every model; one line each: the report, or what failed
    python scripts/gpu/fuse_zoo.py resnet50 levit # only the models whose names contain these words

For each model, at random initialisation on small inputs, fused in train mode (with example inputs, so the
residual patterns fuse too) and in eval mode (without): the original
untouched (every tensor bitwise, no attribute added, no tracer Proxy left), the same state_dict keys and
parameters in the same order, checkpoints loading both ways, and the same outputs, input and parameter
gradients and buffers as the original in train and eval mode and across switches (float64; on a GPU with
tfuse's kernels, on a CPU with its PyTorch path). Where torchvision or timm is missing, or fails to import
(a torchvision built for another torch raises RuntimeError), it says so and goes on. No CI test needs it.

Beside a CPU torch, ``pip install --no-deps torchvision==0.28.0 timm`` imports once the two torchvision op
schemas its CUDA build expects are defined; this script defines them when the import asks for them.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from fusion_invariants import assert_fuse_invariants  # noqa: E402

TORCHVISION = ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "regnet_y_400mf",
               "googlenet", "convnext_tiny"]  # fmt: skip
TIMM = ["resnet26d", "efficientnet_b0", "mobilenetv3_large_100", "convnext_nano", "levit_128s", "mobilevit_xxs",
        "vit_tiny_patch16_224"]  # fmt: skip


def _torchvision():  # type: ignore[no-untyped-def]
    try:
        import torchvision.models as models
    except RuntimeError as error:  # a torchvision whose C++ ops this torch lacks: define their schemas, retry
        if "torchvision::" not in str(error):
            raise
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        for name in [m for m in list(sys.modules) if m.startswith("torchvision")]:
            del sys.modules[name]
        import torchvision.models as models
        _torchvision.library = library  # keep the definitions alive
    return models


def zoo(words: list[str]) -> list[tuple[str, object, tuple[int, ...]]]:
    """(name, constructor, input shape) of each model that imports."""
    found = []
    try:
        tv = _torchvision()
        found += [(f"torchvision.{n}", lambda n=n: getattr(tv, n)(weights=None), (2, 3, 64, 64)) for n in TORCHVISION]
    except Exception as error:  # noqa: BLE001 - any failure: say so and go on
        print(f"torchvision unavailable ({type(error).__name__}: {str(error).splitlines()[0][:120]}): skipped")
    try:
        import timm

        for name in TIMM:
            shape = (2, 3, 224, 224) if name.startswith(("vit", "levit")) else (2, 3, 64, 64)
            found.append((f"timm.{name}", lambda n=name: timm.create_model(n, pretrained=False), shape))
    except Exception as error:  # noqa: BLE001 - likewise
        print(f"timm unavailable ({type(error).__name__}: {str(error).splitlines()[0][:120]}): skipped")
    return [entry for entry in found if not words or any(w in entry[0] for w in words)]


def main(words: list[str]) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    failed = 0
    for name, make, shape in zoo(words):
        print(f"== {name}", flush=True)  # named first: a compiler crash prints pages of its own
        begin = time.perf_counter()
        try:
            for fuse_in, example in (("train", True), ("eval", False)):  # with shapes: the residual patterns too
                _, _, report = assert_fuse_invariants(
                    make, shape, fuse_in=fuse_in, example=example, rtol=1e-8, atol=1e-10,
                    prepare=lambda m: m.double().to(device), device=device,
                )
            print(f"{name}: ok in {time.perf_counter() - begin:.0f} s: {report}", flush=True)
        except Exception as error:  # noqa: BLE001 - report and go on: one model must not hide the others
            failed += 1
            where = traceback.extract_tb(error.__traceback__)[-1]
            print(f"{name}: FAILED {type(error).__name__}: {str(error).strip().splitlines()[0][:300]} "
                  f"({Path(where.filename).name}:{where.lineno})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
