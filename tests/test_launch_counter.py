"""tfuse.count_launches: totals, per-kernel counts, nesting, other threads."""

from __future__ import annotations

import threading

import torch

import tfuse


def _add_once(device):
    with tfuse.use_backend("triton"):
        tfuse.add(torch.ones(4, device=device), torch.ones(4, device=device))


def test_counts_total_and_by_kernel(device):
    with tfuse.count_launches() as launches:
        _add_once(device)
        _add_once(device)
    assert launches.total == 2
    assert dict(launches.by_kernel) == {"_add_fwd_kernel": 2}
    assert "total=2" in repr(launches)


def test_nested_blocks_each_count_their_own_span(device):
    with tfuse.count_launches() as outer:
        _add_once(device)
        with tfuse.count_launches() as inner:
            _add_once(device)
        _add_once(device)
    assert (outer.total, inner.total) == (3, 1)


def test_launches_after_the_block_are_not_counted(device):
    with tfuse.count_launches() as launches:
        pass
    _add_once(device)
    assert launches.total == 0 and not launches.by_kernel


def test_counts_launches_from_other_threads(device):
    with tfuse.count_launches() as launches:
        worker = threading.Thread(target=_add_once, args=(device,))
        worker.start()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert launches.total == 1


def test_batch_norm_launches_by_kernel(device):
    """Batch norm's passes (tfuse/ops/batch_norm.py): each reduction's last programs merge its partials, so no
    merge has a launch of its own. Training: 2 forward, 2 backward (1 without dx); eval: 1 and 1."""
    layer = tfuse.nn.FusedBatchNormAct2d(3, act="relu").to(device)
    x = torch.randn(2, 3, 4, 4, device=device, requires_grad=True)
    expected = {
        True: ({"_bn_stats_partial_kernel": 1, "_bn_act_fwd_kernel": 1},
               {"_bn_act_bwd_reduce_kernel": 1, "_bn_act_bwd_dx_kernel": 1}),
        False: ({"_bn_act_fwd_kernel": 1}, {"_bn_act_bwd_reduce_kernel": 1}),
    }
    with tfuse.use_backend("triton"):
        for training, (forward_kernels, backward_kernels) in expected.items():
            layer.train(training)
            with tfuse.count_launches() as forward:
                y = layer(x)
            with tfuse.count_launches() as backward:
                torch.autograd.grad(y, (x, layer.weight, layer.bias), torch.ones_like(y))
            assert (dict(forward.by_kernel), dict(backward.by_kernel)) == (forward_kernels, backward_kernels)
        layer.train()
        y = layer(x.detach())  # x needs no gradient: no dx pass
        with tfuse.count_launches() as weights_only:
            torch.autograd.grad(y, (layer.weight, layer.bias), torch.ones_like(y))
        assert dict(weights_only.by_kernel) == {"_bn_act_bwd_reduce_kernel": 1}
