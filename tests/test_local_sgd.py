"""tfuse.distributed.LocalSGD on real gloo process groups (2 and 3 ranks on localhost).

The scenarios (tests/local_sgd_scenarios.py) run inside spawned ranks; one
process group runs all of them once (a module fixture) and each test checks
its scenario's results against float64 references trained in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_helpers import assert_a_killed_rank_makes_the_others_raise, run_world, scenario
from local_sgd_scenarios import SUITE, killed_rank, run_suite

from tfuse.distributed import AdaptiveInterval, LocalSGD, OuterSGD, ShardedOptimizer

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64; only the summation order differs from the references


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    outcomes = run_world(run_suite, 2, timeout=240, pg_timeout_s=60, names=list(SUITE))
    return [outcome.unwrap() for outcome in outcomes]


@pytest.fixture(scope="module")
def world3(world2) -> list[dict]:  # (after world2: one process group at a time)
    outcomes = run_world(run_suite, 3, timeout=240, pg_timeout_s=60, names=["replicas", "outer"])
    return [outcome.unwrap() for outcome in outcomes]


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request) -> list[dict]:
    return request.getfixturevalue(f"world{request.param}")


def assert_trajectory(result: dict, **tolerance) -> None:
    for iteration, (mine, theirs) in enumerate(zip(result["trajectory"], result["expected"]), start=1):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, **tolerance, msg=lambda m, i=iteration: f"iteration {i}: {m}")


def test_sync_every_step_with_plain_sgd_is_synchronous_data_parallelism(world2):
    for result in scenario(world2, "every_step"):
        assert result["syncs"] == 3
        assert_trajectory(result, **TIGHT)


def test_between_syncs_each_rank_trains_alone_and_a_sync_averages_the_replicas(world):
    for result in scenario(world, "replicas"):
        assert_trajectory(result, **TIGHT)
        assert result["syncs"] == [0, 0, 1, 1, 1, 2]
        assert result["collectives_per_sync"] == 1  # one flat buffer, no module buffers
        # The flat buffer's trainable range once: the float64 parameters and their alignment gaps.
        assert result["bytes_per_sync"] == result["flat_numel"] * 8 < (result["numel"] + 3 * 32) * 8
        assert result["calls"] == [0, 0, 1, 0, 0, 1]  # nothing between syncs, one all-reduce per sync


def test_the_outer_nesterov_step_equals_the_float64_reference(world):
    for result in scenario(world, "outer"):
        assert_trajectory(result, **TIGHT)


def test_warmup_under_fused_data_parallel_then_local_steps_with_a_skipped_step_on_one_rank(world2):
    results = scenario(world2, "warmup")
    for result in results:
        assert_trajectory(result, **TIGHT)
        assert result["synced"] == [False, False, False, True, False, True]
        assert result["calls"][:2] == [1, 1]  # warm-up: the wrapper's one bucket all-reduce per backward
        assert result["calls"][2:] == [0, 1, 0, 1]  # then only the syncs
    assert [r["scale"] for r in results] == [2.0**10, 2.0**9]  # only the last rank's scaler saw the inf


def test_batch_norm_statistics_are_averaged_at_a_sync(world2):
    for result in scenario(world2, "buffers"):
        torch.testing.assert_close(result["mean"], result["expected_mean"], **TIGHT)
        torch.testing.assert_close(result["var"], result["expected_var"], **TIGHT)
        assert result["tracked"] == 1
        assert result["collectives_per_sync"] == 3  # parameters, averaged statistics, rank 0's counter


def test_a_checkpoint_taken_mid_interval_resumes_exactly(world2):
    for result in scenario(world2, "resume"):
        assert (result["iterations"], result["syncs"]) == (5, 1)
        for a, b in zip(result["resumed"], result["straight"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        no_iterations, short_snapshots, other_interval = result["refusals"]
        assert no_iterations is not None and "lacks iterations" in no_iterations
        assert short_snapshots is not None and "snapshots do not match" in short_snapshots
        assert other_interval is not None and "sync_every=4" in other_interval
        assert result["unchanged"]  # validated first: nothing was overwritten before the error


def test_the_adaptive_interval_measures_the_replicas_divergence_and_doubles_or_halves(world2):
    for result in scenario(world2, "adaptive"):
        doubling, halving = result["doubling"], result["halving"]
        assert doubling["synced_at"] == [1, 3, 7] and doubling["sync_every"] == 8  # 1 -> 2 -> 4 -> 8
        assert halving["synced_at"] == [4, 6, 7] and halving["sync_every"] == 1  # 4 -> 2 -> 1 -> 1
        for run in (doubling, halving):
            assert all(d > 0 for d in run["expected"])
            torch.testing.assert_close(torch.tensor(run["measured"]), torch.tensor(run["expected"]), rtol=1e-6, atol=0)


def test_syncs_follow_freezing_unfreezing_and_replaced_storage_with_fused_and_torch_inner_optimizers(world2):
    for result in scenario(world2, "layout_changes"):
        for name in ("fused", "torch"):
            run = result[name]
            assert run["syncs"] == 3, name
            for step, (ours, theirs) in enumerate(zip(run["trajectory"], run["expected"]), start=1):
                for mine, other in zip(ours, theirs):
                    torch.testing.assert_close(mine, other, **TIGHT, msg=lambda m, s=step, n=name: f"{n} {s}: {m}")
        assert "a parameter replaced by a new nn.Parameter" in result["replaced"]


def test_a_killed_rank_makes_the_others_raise():
    assert_a_killed_rank_makes_the_others_raise(killed_rank)


def test_bad_arguments_are_refused_naming_them():
    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1, got 0"):
        LocalSGD(layer, opt, sync_every=0)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0, got -1"):
        LocalSGD(layer, opt, sync_every=2, warmup_steps=-1)
    with pytest.raises(TypeError, match="outer_optimizer must be None or an OuterSGD, got dict"):
        LocalSGD(layer, opt, sync_every=2, outer_optimizer={"lr": 0.7})
    with pytest.raises(TypeError, match="adaptive must be None or an AdaptiveInterval, got int"):
        LocalSGD(layer, opt, sync_every=2, adaptive=4)
    with pytest.raises(ValueError, match="AdaptiveInterval: min_every 8 > max_every 4"):
        AdaptiveInterval(min_every=8, max_every=4)
    with pytest.raises(ValueError, match="AdaptiveInterval: target must be a positive finite number"):
        AdaptiveInterval(target=float("nan"))
    with pytest.raises(ValueError, match="buffers must be one of"):
        LocalSGD(layer, opt, sync_every=2, buffers="sum")
    with pytest.raises(ValueError, match="OuterSGD: lr must be a positive finite number"):
        OuterSGD(lr=0.0)
    with pytest.raises(ValueError, match="OuterSGD: momentum must be in"):
        OuterSGD(momentum=1.0)
    with pytest.raises(ValueError, match="nesterov=True needs a momentum"):
        OuterSGD(momentum=0.0, nesterov=True)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            LocalSGD(layer, opt, sync_every=2)
    sharded = ShardedOptimizer.__new__(ShardedOptimizer)  # the type is what is refused (no process group needed)
    with pytest.raises(ValueError, match="the optimizer is a ShardedOptimizer, which communicates at every step"):
        LocalSGD(layer, sharded, sync_every=2)
