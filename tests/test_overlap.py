"""FusedDataParallel.overlap_step on real gloo process groups: the optimizer stepped bucket by bucket during
backward ends bit for bit where the plain step does (float64), for every fused family, with LR schedules,
gradient accumulation, frozen and unused parameters; GradScaler turns it off, edits of the gradients after
backward are refused. One process group of 2 ranks runs every scenario (and one of 3 ranks the trajectories
of one family); each is bounded by a timeout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_world, scenario
from overlap_scenarios import FAMILIES, run_suite

from tfuse.distributed import FusedDataParallel
from tfuse.optim import FusedAdam

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

TRAJECTORIES = [f"trajectory_{name}" for name in FAMILIES] + ["trajectory_unused"]


def _suite(world: int, names: list[str]) -> list[dict]:
    return [o.unwrap() for o in run_world(run_suite, world, timeout=240, pg_timeout_s=60, names=names)]


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return _suite(2, [*TRAJECTORIES, "accumulation", "grad_scaler", "clipping", "misuse", "sharded",
                      "sharded_scaler"])


@pytest.fixture(scope="module")
def world3() -> list[dict]:
    return _suite(3, ["trajectory_adam"])


@pytest.mark.parametrize("name", TRAJECTORIES)
def test_the_overlapped_step_equals_the_plain_step_bit_for_bit(world2, name):
    for result in scenario(world2, name):
        assert result["params"] and result["state"]
        assert result["mode"] == "on" and result["communication"] == ["overlapped", "all_reduce"]
        # The first iteration is stepped plainly (it decides); every later backward stepped every bucket.
        assert result["stepped_in_backward"] == [False] + [True] * 3
        assert result["buckets"][1:] == [result["total_buckets"]] * 3 and result["total_buckets"] >= 3
        # The plain run follows torch.optim on the whole batch (Muon: within its bfloat16 iterations' rounding,
        # tests/optim_helpers.muon_ns_slack: lr 0.02 * ratio sqrt(8/5) * 2**-4 per step, 4 steps).
        assert result["reference_gap"] < (4 * 0.02 * math.sqrt(8 / 5) * 2**-4 if name == "trajectory_muon" else 1e-12)


def test_three_ranks(world3):
    for result in scenario(world3, "trajectory_adam"):
        assert result["params"] and result["state"] and result["stepped_in_backward"][1:] == [True] * 3


def test_accumulation_steps_only_on_the_synchronizing_pass(world2):
    for result in scenario(world2, "accumulation"):
        for how in ("no_sync", "merge"):
            assert result[how]["params"] and result[how]["state"] and result[how]["untouched"], how
        assert result["no_sync"]["local"] == "local" and result["merge"]["local"] == "overlapped"


def test_a_grad_scaler_turns_the_overlap_off_and_skips_alike(world2):
    results = scenario(world2, "grad_scaler")
    for result in results:
        assert result["mode"] == "off" and result["params"] and result["state"]
        assert result["communication"] == "all_reduce"
        assert result["scales"][0] == result["scales"][1] == 2.0**9  # the one skipped step halved the scale
    assert results[0]["scales"] == results[1]["scales"]


def test_a_global_norm_clip_is_refused(world2):
    for result in scenario(world2, "clipping"):
        assert "clip_grad_norm_" in result["first"] and "Nothing was stepped" in result["first"]
        assert result["unchanged"] and result["mode"] == "on"
        assert "already ran" in result["later"]


def test_misuse_raises_naming_the_problem(world2):
    for result in scenario(world2, "misuse"):
        assert "second synchronizing backward pass before optimizer.step()" in result["twice"]
        assert "GradScaler drives this step" in result["late"]
        assert result["untouched"] and result["mode"] == "off"  # the optimizer was deleted: backward steps nothing


def test_sharded_owners_step_their_shard_of_each_bucket_during_backward(world2):
    results = scenario(world2, "sharded")
    for result in results:
        for family in ("adam", "momentum", "muon", "lamb", "lars"):
            assert result[family]["params"] and result[family]["state"], family
            assert result[family]["communication"] == "sharded", family
            assert result[family]["stepped_in_backward"] == [False] + [True] * 3, family
        # LAMB's and LARS's norms are summed across the ranks as they step: their buckets step when backward ends
        assert result["lamb"]["while_running"] == result["lars"]["while_running"] == [0] * 4
    for family in ("adam", "momentum", "muon", "lamb", "lars"):  # the gathers brought every rank the same parameters
        for a, b in zip(results[0][family]["values"], results[1][family]["values"]):
            assert torch.equal(a, b)


def test_sharded_under_a_grad_scaler_turns_the_overlap_off_and_skips_alike(world2):
    for result in scenario(world2, "sharded_scaler"):
        assert result["mode"] == "off" and result["params"]
        assert result["scales"][0] == result["scales"][1] == 2.0**9  # the one skipped step halved both


def test_bad_arguments_are_refused(monkeypatch):
    layer = torch.nn.Linear(2, 2)
    wrapped = object.__new__(FusedDataParallel)  # (no process group here: the checks come before any collective)
    torch.nn.Module.__init__(wrapped)
    with pytest.raises(TypeError, match="overlap_step: optimizer must be a tfuse fused optimizer"):
        FusedDataParallel.overlap_step(_Stub(), torch.optim.SGD(layer.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="capturable optimizer"):
        FusedDataParallel.overlap_step(_Stub(), FusedAdam(layer.parameters(), capturable=True))
    with pytest.raises(ValueError, match="holds none of this wrapper's parameters"):
        FusedDataParallel.overlap_step(_Stub(), FusedAdam(layer.parameters()))


class _Stub:
    """Just enough of a wrapper for overlap_step's argument checks."""

    class _reducer:  # noqa: N801
        overlap = None
        sharded_by = None

    flat = object()
