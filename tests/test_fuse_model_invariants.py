"""Every model the fusion tests build, fused in train and in eval mode, with and without example inputs:
every invariant of tests/fusion_invariants.py (the original untouched, the same keys and parameters in the
same order, checkpoints loading both ways, the same computation in both modes and across switches)."""

from __future__ import annotations

import pytest

import tfuse
import fusion_hazards as hazards
import fusion_models as models
from fusion_invariants import assert_fuse_invariants

MODELS = {
    "resnet": (models.ResNetish, (3, 3, 6, 6)),
    "mobilenet": (models.MobileNetish, (3, 3, 6, 6)),
    "mlp": (models.MLPBlock, (6, 16)),
    "reused": (models.Reused, (5, 4)),
    "untraceable": (models.Untraceable, (6, 4)),
    "mobilenet-lite": (models.MobileNetLite, (3, 4, 6, 6)),
    "efficientnet": (models.EfficientNetish, (2, 3, 8, 8)),
    "functional-depthwise": (models.FunctionalDepthwise, (2, 6, 5, 5)),
    "not-fusable": (models.NotFusable, (2, 4, 5, 5)),
    "untraceable-depthwise": (models.UntraceableDepthwise, (2, 4, 5, 5)),
    "norm-act": (hazards.NormActNet, (2, 3, 5, 5)),
    "drop-path": (hazards.DropPathBlock, (4, 6, 5, 5)),
    "aux-head": (hazards.AuxNet, (2, 3, 5, 5)),
    "out-of-order": (hazards.OutOfOrder, (5, 4)),
    "half-traceable": (hazards.HalfTraceable, (5, 4)),
    "shape-checked": (hazards.ShapeChecked, (5, 4)),
    "sliced": (hazards.Sliced, (5, 4)),
    "aliased": (hazards.Aliased, (2, 3, 5, 5)),
    "hooked": (hazards.Hooked, (2, 3, 5, 5)),
}


@pytest.mark.parametrize("example", [False, True], ids=["no-shapes", "example-inputs"])
@pytest.mark.parametrize("fuse_in", ["train", "eval"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fuse_model_keeps_every_invariant(name, fuse_in, example):
    make, shape = MODELS[name]
    with tfuse.use_backend("torch"):  # the rewrite is under test here; the kernels have their own tests
        assert_fuse_invariants(make, shape, fuse_in=fuse_in, example=example)
