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
