"""tfuse.distributed.ShardedOptimizer on real gloo process groups (1, 2 and 3 ranks on localhost).

The scenarios (tests/sharded_scenarios.py) run inside spawned ranks; to keep
CI lean, one process group per world size runs all of them once (module
fixtures) and each test checks its scenario's results. Checkpoints travel
2 -> 3 -> 1 ranks through those fixtures. Every group is bounded by a timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_helpers import assert_a_killed_rank_makes_the_others_raise, run_world, scenario
from sharded_scenarios import CLIP, OPTIMIZERS, killed_rank, model, run_suite

from tfuse.distributed import ShardedOptimizer
from tfuse.optim import FusedAdam

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64; only the summation order differs from the references
EXACT = dict(rtol=0, atol=0)


def _suite(world: int, names: list[str], **kwargs) -> list[dict]:
    outcomes = run_world(run_suite, world, timeout=240, pg_timeout_s=60, names=names, **kwargs)
    return [outcome.unwrap() for outcome in outcomes]


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return _suite(2, ["momentum", "adam", "adamw", "adagrad", "lion", "lamb", "lars", "lamb_torch_path", "muon",
                      "adagrad_checkpoint", "adam_torch_path", "clip", "grad_scaler", "data_parallel",
                      "data_parallel_scaler", "masters", "memory", "save", "clip_idioms"])


@pytest.fixture(scope="module")
def world3(world2) -> list[dict]:
    saved = scenario(world2, "save")
    reload_from = {"consolidated": saved[0]["consolidated"], "sharded": [r["sharded"] for r in saved]}
    return _suite(3, ["momentum", "adam", "clip", "memory", "muon"], reload_from=reload_from)


@pytest.fixture(scope="module")
def world1(world2, world3) -> list[dict]:
    after = scenario(world3, "reload")[0]["after"]
    saved = scenario(world2, "save")
    return _suite(1, [], reload_from={"consolidated": after, "sharded": [r["sharded"] for r in saved]})


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request) -> list[dict]:
    return request.getfixturevalue(f"world{request.param}")


def assert_states_equal(actual: dict, expected: dict, **tolerance) -> None:
    """Two torch.optim-format ``state`` dicts: the same parameters, names and values, element by element."""
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert sorted(actual[key]) == sorted(expected[key]), key
        for name, value in expected[key].items():
            torch.testing.assert_close(actual[key][name], value, **tolerance, msg=f"parameter {key}, {name}")
            if value.dim():
                assert actual[key][name].shape == value.shape


# --------------------------------------------------------------------------- trajectories


@pytest.mark.parametrize("name", [*OPTIMIZERS, "adam_torch_path", "lamb_torch_path"])
def test_parameters_and_state_follow_torch_optim_on_the_whole_batch(world, name):
    if name not in world[0]:
        pytest.skip("run on 2 ranks only (CI time)")
    ranks = scenario(world, name)
    for result in ranks:
        for step, (sharded, reference) in enumerate(zip(result["params"], result["reference"])):
            for index, (a, e) in enumerate(zip(sharded, reference)):
                torch.testing.assert_close(a, e, **TIGHT, msg=f"step {step}, parameter {index}")
        torch.testing.assert_close(result["params"], ranks[0]["params"], **EXACT)  # replicas bit-identical
        assert result["straddles"] > 0  # some parameter is updated piecewise by two owners
        if name.endswith("torch_path"):
            assert result["launches"] == [0] * 3  # torch's fused kernels, no Triton launch
        elif result["updates_here"]:
            per_step = 2 if name in ("lamb", "lars") else 1  # LAMB, LARS: before and after the norms' all-reduce
            assert result["launches"] == [per_step] * 3  # the fused update launches over the shard per step
    first, last = ranks[0]["params"][0], ranks[0]["params"][-1]
    assert all(not torch.equal(a, b) for a, b in zip(first[:-2], last[:-2]))  # everything used trained
    assert torch.equal(first[-1], model()["unused"].bias.detach())  # the unused layer (None everywhere) did not
    assert ranks[1]["state"] is None  # consolidated on rank 0 only
    state, reference = ranks[0]["state"], ranks[0]["reference_state"]
    # Every parameter but the unused layer's two; Adagrad's state exists from its constructor on: all 12.
    assert len(state) == len(reference) == (12 if name == "adagrad" else 10)
    assert_states_equal(state, reference, **TIGHT)


@pytest.mark.parametrize("kind", ["loose", "data_parallel"])
def test_sharded_muon_equals_single_process_muon_and_splits_no_matrix(world, kind):
    """FusedMuon sharded by whole matrices (2 and 3 ranks) follows FusedMuon on one process over the whole batch
    (float64 iterations): parameters every step and the consolidated state; no parameter crosses a shard boundary;
    each rank holds part of the state; a consolidated state dict resumes in a new ShardedOptimizer bit for bit."""
    ranks = [result[kind] for result in scenario(world, "muon")]
    for result in ranks:
        for step, (sharded, reference) in enumerate(zip(result["params"], result["reference"])):
            for index, (a, e) in enumerate(zip(sharded, reference)):
                torch.testing.assert_close(a, e, **TIGHT, msg=f"step {step}, parameter {index}")
        torch.testing.assert_close(result["params"], ranks[0]["params"], **EXACT)  # replicas bit-identical
        assert result["straddles"] == 0  # every matrix whole in one shard
        if kind == "loose":
            torch.testing.assert_close(result["resumed"], result["continued"], **EXACT)
    first, last = ranks[0]["params"][0], ranks[0]["params"][-1]
    assert sum(not torch.equal(a, b) for a, b in zip(first, last)) >= len(first) - 2  # trained (not the unused)
    assert ranks[0]["buffers"] == (2 if kind == "loose" else 1)  # the kinds apart, or in the wrapper's buffer
    assert all(r["state_bytes"] < sum(r["state_bytes"] for r in ranks) for r in ranks)  # the state is split
    assert all(r["state"] is None for r in ranks[1:])
    state, reference = ranks[0]["state"], ranks[0]["reference_state"]
    assert any("momentum_buffer" in entry for entry in state.values()) and any("exp_avg" in e for e in state.values())
    assert_states_equal(state, reference, **TIGHT)


def test_sharded_adagrads_checkpoint_has_torchs_state_and_resumes_in_both(world2):
    """Adagrad's state exists from its constructor on (torch's rule), sharded too: the consolidated state dict
    of a fresh optimizer is torch's (step 0, the initial sums, every parameter); a trained one loads into a new
    ShardedOptimizer and into torch.optim.Adagrad, and all three go on alike."""
    ranks = scenario(world2, "adagrad_checkpoint")
    fresh = ranks[0]["fresh"]
    assert ranks[1]["fresh"] is None and len(fresh) == 12
    for entry in fresh.values():
        assert float(entry["step"]) == 0.0 and torch.all(entry["sum"] == 0.2)
    for result in ranks:
        for ours, again, theirs in zip(result["params"], result["again"], result["reference"]):
            torch.testing.assert_close(again, ours, **EXACT)
            torch.testing.assert_close(ours, theirs, **TIGHT)


def test_clip_grad_norm_on_the_shards_equals_torchs_on_the_whole_batch(world):
    ranks = scenario(world, "clip")
    for result in ranks:
        assert len(result["norms"]) == 3
        for sharded, reference in result["norms"]:
            torch.testing.assert_close(sharded, reference, **TIGHT)
            assert float(reference) > 0.05  # the clip really scaled the gradients
        for sharded, reference in zip(result["params"], result["reference"]):
            torch.testing.assert_close(sharded, reference, **TIGHT)
    assert_states_equal(ranks[0]["state"], ranks[0]["reference_state"], **TIGHT)


def test_an_inf_on_one_rank_makes_every_rank_skip_the_step_under_grad_scaler(world2):
    for result in scenario(world2, "grad_scaler"):
        assert result["skipped"] == [False, True, False]
        for sharded, reference in zip(result["params"], result["reference"]):
            torch.testing.assert_close(sharded, reference, **TIGHT)  # the scale is divided out exactly


def test_under_fused_data_parallel_backward_reduces_to_the_owners_with_no_all_reduce(world2):
    for result in scenario(world2, "data_parallel"):
        assert result["same_flat"]  # sharded over the wrapper's own flat buffers
        assert result["num_allreduce_calls"] == 0 and result["num_reduce_calls"] > result["n_buckets"] > 1
        for no_sync_synced, synced, reduces, all_reduce_sizes in result["counts"]:
            assert (no_sync_synced, synced) == (False, True)
            assert reduces == result["num_reduce_calls"]  # one per bucket and shard it meets, in backward
            assert all_reduce_sizes == [1]  # only the non-finite flag: no gradient is all-reduced
        for sharded, reference in zip(result["params"], result["reference"]):
            torch.testing.assert_close(sharded, reference, **TIGHT)
        assert "did not reduce the gradients" in result["unsynced_step"]
        assert "also holds" in result["subset"] and "trainable parameter" in result["subset"]
        assert result["after_delete"] == (result["n_buckets"], 0)  # the optimizer gone: all-reduce again



@pytest.mark.parametrize("wrapped", [True, False], ids=["data_parallel", "plain_model"])
def test_every_clipping_idiom_is_right_or_names_the_one_to_use(world2, wrapped):
    """DDP + torch's clip on the whole batch is the reference. Under FusedDataParallel each rank holds only its shard
    of the averaged gradient, so torch's per-rank norm must be refused at step (nothing stepped); the optimizer's
    method and tfuse's clip (which hands sharded parameters to it) are right with or without the wrapper."""
    for result in scenario(world2, "clip_idioms"):
        for idiom in ("optimizer_method", "tfuse_on_parameters", "tfuse_on_optimizer", "uniform_edit"):
            run = result[(idiom, wrapped)]
            assert run["error"] is None and run["steps"] == 3, (idiom, run["error"])
            if idiom != "uniform_edit":
                assert run["reference_norm"] > CLIP  # the reference really clipped
            for sharded, reference in zip(run["params"], run["reference"]):
                torch.testing.assert_close(sharded, reference, **TIGHT)
        torch_clip = result[("torch_on_parameters", wrapped)]
        if wrapped:
            assert torch_clip["steps"] == 0 and torch_clip["unchanged"]
            assert "optimizer.clip_grad_norm_" in torch_clip["error"] and "different factor" in torch_clip["error"]
        # (on a plain model torch's clip scales each rank's local gradients before the step averages them: a
        # different algorithm, which no check can see; the ShardedOptimizer docstring says so)
        assert "optimizer.clip_grad_norm_" in result["subset"] and "sharded" in result["subset"]

@pytest.mark.parametrize("mode", ["reduce", "all_reduce"])
def test_sharded_backward_with_gradient_merge_and_grad_scaler_skips_and_rescales_alike(world2, mode):
    results = [ranks[mode] for ranks in scenario(world2, "data_parallel_scaler")]
    for result in results:
        assert result["synced"] == [False, True] * 3
        assert result["skipped"] == [False, True, False]
        for sharded, reference in zip(result["params"], result["reference"]):
            torch.testing.assert_close(sharded, reference, **TIGHT)
        all_reduces, reduces = result["calls"]
        assert (all_reduces == 0) == (mode == "reduce") and (reduces == 0) == (mode == "all_reduce")
    assert results[0]["scales"] == results[1]["scales"] and results[0]["scales"][1] == results[0]["scales"][0] / 2


def test_float32_masters_of_bfloat16_parameters_are_sharded_and_follow_the_unsharded_optimizer(world2):
    results = scenario(world2, "masters")
    for result in results:
        for sharded, reference in zip(result["params"], result["reference"]):
            torch.testing.assert_close(sharded, reference, **EXACT)
        assert result["master_bytes"] * len(results) == result["padded_numel"] * 4  # a shard's masters each
        assert "cannot be pickled or deep-copied" in result["copy_error"] and "consolidated_state_dict" in result["copy_error"]
    assert sorted(results[0]["consolidated"]) == sorted(results[0]["reference_masters"])
    for index, master in results[0]["consolidated"].items():
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, results[0]["reference_masters"][index], **EXACT)


def test_auto_modes_on_gloo_and_the_overrides(world2):
    assert scenario(world2, "adam")[0]["modes"] == ("reduce", "broadcast")
    assert scenario(world2, "momentum")[0]["modes"] == ("reduce_scatter", "broadcast")
    assert scenario(world2, "adamw")[0]["modes"] == ("all_reduce", "all_gather")  # both overridden


def test_state_bytes_per_rank_are_a_world_size_share(world):
    ranks = scenario(world, "memory")
    size = len(ranks)
    for result in ranks:
        assert result["sharded"] == 2 * result["shard_numel"] * 4  # exp_avg and exp_avg_sq of its shard, float32
        assert result["sharded"] <= result["unsharded"] / size * 1.05, (result, size)


# --------------------------------------------------------------------------- checkpoints


def test_every_adam_moment_survives_two_to_three_to_one_ranks(world2, world3, world1):
    saved = scenario(world2, "save")[0]["consolidated"]
    assert saved is not None and all("max_exp_avg_sq" in entry for entry in saved["state"].values())
    at3 = scenario(world3, "reload")
    assert_states_equal(at3[0]["again"]["state"], saved["state"], **EXACT)  # 2 -> 3: element by element
    after = at3[0]["after"]
    assert at3[0]["lr"] == 0.01  # hyperparameters come from the checkpoint, as in torch
    assert all(float(after["state"][k]["step"]) == float(saved["state"][k]["step"]) + 1 for k in saved["state"])
    at1 = scenario(world1, "reload")
    assert_states_equal(at1[0]["again"]["state"], after["state"], **EXACT)  # 3 -> 1


def test_a_consolidated_state_dict_loads_into_fused_adam_and_torch_adam(world3):
    after = scenario(world3, "reload")[0]["after"]
    for cls in (FusedAdam, torch.optim.Adam):
        net = model()
        opt = cls(net.parameters(), lr=0.5, amsgrad=True)
        opt.load_state_dict(after)
        state = opt.state_dict()["state"]
        assert_states_equal({k: {n: v for n, v in e.items()} for k, e in state.items()}, after["state"], **EXACT)


def test_a_sharded_state_dict_at_another_world_size_or_layout_fails_on_every_rank(world3, world1):
    for ranks, size in ((world3, 3), (world1, 1)):
        for result in scenario(ranks, "reload"):
            assert result["error"] is not None
            assert f"saved with world_size 2, this optimizer has world_size {size}" in result["error"]
            assert "consolidated" in result["error"]
    for result in scenario(world3, "reload"):
        assert result["layout_error"] is not None and "has another" in result["layout_error"]


def test_another_optimizers_state_is_refused_at_load_on_every_rank(world3):
    for result in scenario(world3, "reload"):
        error = result["family_error"]
        assert error is not None and error.startswith("ShardedOptimizer.load_state_dict") and "'momentum_buffer'" in error
        assert result["family_unchanged"]


# --------------------------------------------------------------------------- faults and bad input


def test_a_killed_rank_makes_the_others_raise():
    assert_a_killed_rank_makes_the_others_raise(killed_rank)


def test_bad_arguments_are_refused_naming_them():
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="optimizer_class must be a tfuse fused optimizer class"):
        ShardedOptimizer(layer.parameters(), torch.optim.Adam)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup or None, got int"):
        ShardedOptimizer(layer.parameters(), FusedAdam, process_group=3)
    with pytest.raises(ValueError, match="reduce must be one of .*got 'scatter'"):
        ShardedOptimizer(layer.parameters(), FusedAdam, reduce="scatter")
    with pytest.raises(ValueError, match="gather must be one of .*got 'gossip'"):
        ShardedOptimizer(layer.parameters(), FusedAdam, gather="gossip")
    with pytest.raises(ValueError, match="capturable=True is not supported"):
        ShardedOptimizer(layer.parameters(), FusedAdam, capturable=True)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            ShardedOptimizer(layer.parameters(), FusedAdam)
