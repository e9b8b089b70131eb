"""tfuse.setup: fuse, wrap for data parallelism, build the optimizer over the flat buffers, say what it did."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import tfuse
from tfuse.nn import FusedLinear

from dist_helpers import run_world, scenario
from setup_scenarios import SUITE, net, run_suite

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

TIGHT = dict(rtol=1e-9, atol=1e-11)  # float64; the summation order differs from the whole-batch reference


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    outcomes = run_world(run_suite, 2, timeout=300, pg_timeout_s=60, names=list(SUITE))
    return [outcome.unwrap() for outcome in outcomes]


def test_one_process_gives_the_fused_model_and_optimizer_and_logs_what_it_did(caplog):
    with caplog.at_level(logging.INFO, logger="tfuse.fusion.setup_training"):
        setup = tfuse.setup(net(), "adamw", lr=1e-3)
    model, optimizer = setup
    assert isinstance(model.get_submodule("0"), FusedLinear) and model.get_submodule("0").act == "gelu"
    assert type(optimizer).__name__ == "FusedAdamW" and optimizer.param_groups[0]["lr"] == 1e-3
    assert setup.report.counts() == {"Linear+GELU": 1, "Linear+SiLU": 1}
    assert setup.local_sgd is None
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [f"tfuse.setup: {line}" for line in setup.summary]
    assert setup.summary[0] == "fusion: fused 1 Linear+GELU, 1 Linear+SiLU (torch.fx)"
    assert setup.summary[1] == "gradient tensors: 6 (435 elements)"
    assert setup.summary[2].startswith("optimizer: FusedAdamW: 6 parameters (435 elements) in 1 flat buffer")


def test_torch_optimizers_and_a_tfuse_class_are_accepted():
    _, optimizer = tfuse.setup(net(), "momentum", tfuse.FusionStrategy(fuse_all_optimizer_ops=False), lr=0.1)
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["momentum"] == 0.9
    _, optimizer = tfuse.setup(net(), tfuse.optim.FusedSGD, lr=0.1)
    assert type(optimizer) is tfuse.optim.FusedSGD
    for name, cls in [("adagrad", tfuse.optim.FusedAdagrad), ("lion", tfuse.optim.FusedLion),
                      ("lamb", tfuse.optim.FusedLAMB), ("lars", tfuse.optim.FusedLARS), ("muon", tfuse.optim.FusedMuon)]:
        _, optimizer = tfuse.setup(net(), name, lr=0.01)
        assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == 0.01
    _, optimizer = tfuse.setup(net(), "adagrad", tfuse.FusionStrategy(fuse_all_optimizer_ops=False), lr=0.1)
    assert type(optimizer) is torch.optim.Adagrad
    with pytest.raises(ValueError, match="optimizer 'lion' with fuse_all_optimizer_ops=False .* torch.optim has none"):
        tfuse.setup(net(), "lion", tfuse.FusionStrategy(fuse_all_optimizer_ops=False), lr=0.1)


def test_bad_arguments_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'; expected one of adamw, adam, sgd, momentum, "
                                         "adagrad, lion, lamb, lars, muon"):
        tfuse.setup(net(), "rmsprop", lr=0.1)
    with pytest.raises(TypeError, match="optimizer must be one of 'adamw', .* got <class 'torch.optim.adam.Adam'>"):
        tfuse.setup(net(), torch.optim.Adam, lr=0.1)
    with pytest.raises(RuntimeError, match="sharding and LocalSGD need torch.distributed initialised"):
        tfuse.setup(net(), "adamw", tfuse.FusionStrategy(sharding="optimizer"), lr=0.1)
    with pytest.raises(RuntimeError, match="gradient_merge_steps > 1 merges gradients before their all-reduce"):
        tfuse.setup(net(), "adamw", tfuse.FusionStrategy(gradient_merge_steps=2), lr=0.1)
    with pytest.raises(ValueError, match="sharding must be 'none' or 'optimizer', got 'zero3'"):
        tfuse.FusionStrategy(sharding="zero3")
    with pytest.raises(ValueError, match="sharding='optimizer' and local_sgd_every exclude each other"):
        tfuse.FusionStrategy(sharding="optimizer", local_sgd_every=4)
    with pytest.raises(ValueError, match="fuse_grad_size_in_mb must be a positive number or None, got 0"):
        tfuse.FusionStrategy(fuse_grad_size_in_mb=0)
    with pytest.raises(ValueError, match="gradient_merge_steps must be an int >= 1, got 0"):
        tfuse.FusionStrategy(gradient_merge_steps=0)
    with pytest.raises(TypeError, match="strategy must be a tfuse.FusionStrategy, got dict"):
        tfuse.setup(net(), "adamw", {"fuse_bn_act": True}, lr=0.1)


def test_data_parallel_training_equals_the_whole_batch_in_one_process(world2):
    for result in scenario(world2, "default"):
        assert result["model"] == "FusedDataParallel" and result["optimizer"] == "FusedAdamW"
        assert result["fused"] == {"Linear+GELU": 1, "Linear+SiLU": 1}
        assert result["allreduce_calls"] == 1 and result["shares_buffers"]
        assert any(line.startswith("all-reduce: 6 gradient tensors -> 1 all-reduce call(s) per step over 2 ranks")
                   for line in result["summary"])
        for ours, theirs in zip(result["params"], result["reference"]):
            torch.testing.assert_close(ours, theirs, **TIGHT)


def test_strategy_knobs_reach_the_wrapper(world2):
    for result in scenario(world2, "knobs"):
        assert result["bucket_mb"] is None and result["max_params"] == 2 and result["merge"] == 2
        assert result["buckets"] == 3  # 6 gradient tensors, at most 2 per bucket
        assert any("-> 3 all-reduce call(s)" in line for line in result["summary"])


def test_sharded_optimizer_option(world2):
    for result in scenario(world2, "sharded"):
        assert result["is_sharded"]
        for ours, theirs in zip(result["params"], result["reference"]):
            torch.testing.assert_close(ours, theirs, **TIGHT)


def test_local_sgd_option(world2):
    for result in scenario(world2, "local_sgd"):
        assert result["differ_before"] and result["equal_after"] and result["syncs"] == 1


def test_torch_ddp_and_torch_optimizer_option(world2):
    for result in scenario(world2, "torch_ddp"):
        assert result["model"] == "DistributedDataParallel" and result["optimizer"] == "torch.optim.adamw.AdamW"
        for ours, theirs in zip(result["params"], result["reference"]):
            torch.testing.assert_close(ours, theirs, **TIGHT)


def test_tune_buckets_measures_every_candidate_and_agrees_across_ranks(world2):
    ranks = scenario(world2, "tune")
    for result in ranks:
        settings = [(mb, cap, calls) for mb, cap, calls, _ in result["rows"]]
        # 1e-4 MB caps each bucket at one parameter's gradient or less: one call per gradient tensor.
        assert settings == [(1e-4, None, 6), (None, None, 1), (None, 2, 3)]
        assert result["same"] == [(), ((64, None),), ()]  # one bucket either way: timed once, shown in that row
        assert "same buckets: 64, None" in result["text"]
        verdict = result["text"].splitlines()[-1]
        assert ("no measurable difference" in verdict) == (not result["measurable"])
        no_params, no_target = result["errors"]
        assert no_params is not None and "has no parameters" in no_params
        assert no_target is not None and "(inputs, target) pair" in no_target and "length 1" in no_target
        assert all(ms > 0 for *_, ms in result["rows"])
        fastest = min(result["rows"], key=lambda row: row[3])
        assert result["best"] == fastest[:2]
        assert "| bucket_mb | max_params_per_bucket | all-reduce calls | ms / step | vs best |" in result["text"]
        assert "Recommended: FusionStrategy(fuse_grad_size_in_mb=" in result["text"]
        assert result["untouched"] and all(result["grads"])  # the user's model is neither trained nor wrapped
    assert len({str(r["best"]) for r in ranks}) == 1  # the slowest rank's time per step: one answer


def test_tune_buckets_needs_a_process_group():
    with pytest.raises(RuntimeError, match="tune_buckets: torch.distributed is not initialized"):
        tfuse.tune_buckets(net(), torch.nn.functional.mse_loss, (torch.randn(2, 6).double(), torch.randn(2, 3).double()))


def test_tune_buckets_says_when_the_difference_is_not_measurable():
    from tfuse.fusion.tune import BucketTiming, BucketTuning

    fast = BucketTiming(1, None, 4, median_ms=10.0, q1_ms=9.5, q3_ms=10.5)
    close = BucketTiming(4, None, 2, median_ms=10.4, q1_ms=10.2, q3_ms=10.9)  # its q1 inside fast's range
    far = BucketTiming(None, None, 1, median_ms=14.0, q1_ms=13.0, q3_ms=15.0)
    overlapping = BucketTuning([fast, close, far], fast, world_size=2, steps=10)
    assert not overlapping.measurable and "no measurable difference" in str(overlapping)
    clear = BucketTuning([fast, far], fast, world_size=2, steps=10)
    assert clear.measurable and str(clear).splitlines()[-1].startswith("Recommended: FusionStrategy(")
    assert "no measurable" not in str(clear)
    alone = BucketTuning([fast], fast, world_size=2, steps=10)
    assert "the setting does not matter here" in str(alone)
