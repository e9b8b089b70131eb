"""fuse_model on real model-zoo networks (torchvision, timm), for the GPU campaign (their images have both).

    python scripts/gpu/fuse_zoo.py          # prints one line per model: the report, and the largest difference
                                            # of outputs and input gradients against the original (train, eval)

Models are built without weights (random initialisation, no download), on
CUDA when present. Where torchvision or timm is missing it says so and exits 0.
"""

from __future__ import annotations

import copy
import sys

import torch

import tfuse


def zoo() -> list[tuple[str, torch.nn.Module, tuple[int, ...]]]:
    models = []
    try:
        import torchvision.models as tv

        for name in ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "regnet_y_400mf"):
            models.append((f"torchvision.{name}", getattr(tv, name)(weights=None), (4, 3, 64, 64)))
    except Exception as error:
        print(f"torchvision unavailable ({type(error).__name__}): skipped")
    try:
        import timm

        for name in ("resnet26d", "mobilenetv3_large_100", "convnext_nano", "vit_tiny_patch16_224"):
            shape = (2, 3, 224, 224) if name.startswith("vit") else (4, 3, 64, 64)
            models.append((f"timm.{name}", timm.create_model(name, pretrained=False), shape))
    except Exception as error:
        print(f"timm unavailable ({type(error).__name__}): skipped")
    return models


def largest_difference(original: torch.nn.Module, fused: torch.nn.Module, shape, device, train: bool) -> float:
    a, b = copy.deepcopy(original).train(train), copy.deepcopy(fused).train(train)
    x = torch.randn(shape, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    scale = ya.abs().max().clamp_min(1e-6)
    return max(float((ya - yb).abs().max() / scale), float((xa.grad - xb.grad).abs().max() / xa.grad.abs().max()))


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, model, shape in zoo():
        print(f"== {name}", flush=True)  # named first: a compiler crash prints pages of its own
        model = model.to(device)
        try:
            fused, report = tfuse.fuse_model(model, example_inputs=torch.randn(shape, device=device))
            train = largest_difference(model, fused, shape, device, True)
            evaluation = largest_difference(model, fused, shape, device, False)
            print(f"{name}: {report} | max relative difference train {train:.2e}, eval {evaluation:.2e}")
        except Exception as error:  # report and go on: one model's failure must not hide the others
            print(f"{name}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
