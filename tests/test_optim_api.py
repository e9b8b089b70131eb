"""Fused optimizers as drop-ins for torch.optim: constructor signatures, torch's implementation
switches (foreach, fused, capturable, differentiable), argument errors, and what describe(),
repr() and the log say about the backend that serves the step."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import textwrap

import pytest
import torch
from torch import nn

import tfuse
from conftest import ON_CUDA
from optim_helpers import backward, make_pair, run_side_by_side, saved, torch_path_reference
from tfuse.optim import FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, FusedLion, FusedMomentum, FusedSGD
from tfuse.optim import _torch_probe

from helpers import run_command

PAIRS = [(FusedSGD, torch.optim.SGD), (FusedMomentum, torch.optim.SGD), (FusedAdam, torch.optim.Adam),
         (FusedAdamW, torch.optim.AdamW), (FusedAdagrad, torch.optim.Adagrad)]
TFUSE_ONLY = {"master_weights": False}  # keyword-only extras, with their defaults
DIFFERENT_DEFAULTS = {(FusedMomentum, "momentum"): 0.9}  # the point of FusedMomentum
OPTIMIZER_LOGGER = "tfuse.optim._flat_optimizer"


def flags_of(torch_cls) -> list[str]:
    return [name for name in ("foreach", "fused", "capturable", "differentiable")
            if name in inspect.signature(torch_cls).parameters]


# ---------------------------------------------------------------------------- signatures


@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS, ids=lambda c: c.__name__)
def test_constructor_signature_is_torchs(fused_cls, torch_cls):
    """Same parameters, kinds, defaults and positional order as torch 2.13's class; extras keyword-only."""
    ours = inspect.signature(fused_cls).parameters
    theirs = inspect.signature(torch_cls).parameters
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    for name, param in theirs.items():
        assert name in ours, f"{fused_cls.__name__} lacks torch's argument {name!r}"
        assert ours[name].kind is param.kind, name
        if name != "params":
            expected = DIFFERENT_DEFAULTS.get((fused_cls, name), param.default)
            assert ours[name].default == expected and type(ours[name].default) in (type(expected), float), name
    extras = {n: p.default for n, p in ours.items() if n not in theirs}
    # torch.optim.SGD has no capturable switch; tfuse's SGD takes one (device-side step, CUDA-graph capture).
    assert extras == TFUSE_ONLY | ({} if "capturable" in theirs else {"capturable": False})
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extras)


@pytest.mark.parametrize("fused_cls,torch_cls,args", [
    (FusedSGD, torch.optim.SGD, (0.05, 0.9, 0.0, 0.01, True)),
    (FusedMomentum, torch.optim.SGD, (0.05, 0.8, 0.2, 0.01)),
    (FusedAdam, torch.optim.Adam, (0.02, (0.8, 0.9), 1e-6, 0.1, True)),
    (FusedAdamW, torch.optim.AdamW, (0.02, (0.8, 0.9), 1e-6, 0.1, True)),
    (FusedAdagrad, torch.optim.Adagrad, (0.05, 0.1, 0.01, 0.2, 1e-8)),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_positional_arguments_bind_as_in_torch(fused_cls, torch_cls, args, device):
    model, reference = make_pair(device)
    fused, torch_opt = fused_cls(model.parameters(), *args), torch_cls(reference.parameters(), *args)
    ours, theirs = fused.param_groups[0], torch_opt.param_groups[0]
    for name, value in theirs.items():
        if name != "params":
            assert ours[name] == value, name
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)


# ---------------------------------------------------------------------------- implementation switches


def accepted_flag_sets(torch_cls) -> list[dict]:
    flags = flags_of(torch_cls)
    sets = [dict(foreach=foreach) for foreach in (None, False, True)]
    sets += [dict(fused=True), dict(fused=None, foreach=False), dict(fused=True, foreach=False)]
    sets += [dict(differentiable=False)] + ([dict(capturable=False)] if "capturable" in flags else [])
    return sets


@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS, ids=lambda c: c.__name__)
def test_torch_implementation_switches_are_accepted_and_change_nothing(fused_cls, torch_cls, device):
    """foreach (any value), fused=None/True: tfuse is always fused; the update is the same."""
    options = dict(lr=0.05, momentum=0.9) if torch_cls is torch.optim.SGD else dict(lr=1e-2)
    for flags in accepted_flag_sets(torch_cls):
        model, reference = make_pair(device)
        fused = fused_cls(model.parameters(), **options, **flags)
        for name, value in flags.items():
            assert fused.param_groups[0][name] is value  # recorded like torch records them
        torch_opt = torch_cls(reference.parameters(), **options, foreach=False)
        run_side_by_side(model, reference, fused, torch_opt, 2, device, torch.float32)
        with tfuse.count_launches() as launches:
            fused.step()
        assert launches.total == (1 if device.type == "cuda" or tfuse._backend.interpreter_active() else 0)


@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS, ids=lambda c: c.__name__)
def test_switches_tfuse_cannot_honour_are_refused_naming_the_argument(fused_cls, torch_cls, device):
    layer = nn.Linear(2, 2).to(device)
    refused = {"fused": False, "differentiable": True}  # (capturable=True is honoured: tests/test_compile.py)
    for name, value in refused.items():
        with pytest.raises(ValueError, match=rf"{fused_cls.__name__}: {name}={value} .*{torch_cls.__name__}"):
            fused_cls(layer.parameters(), lr=0.1, **{name: value})
        optimizer = fused_cls(layer.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=rf"{name}={value}"):
            optimizer.add_param_group({"params": nn.Linear(2, 2).to(device).parameters(), name: value})
        assert len(optimizer.param_groups) == 1
    # Both switches on: torch's own error, word for word.
    with pytest.raises(RuntimeError) as torchs:
        torch_cls(layer.parameters(), lr=0.1, fused=True, foreach=True)
    with pytest.raises(RuntimeError) as ours:
        fused_cls(layer.parameters(), lr=0.1, fused=True, foreach=True)
    assert str(ours.value) == str(torchs.value)
    with pytest.raises(TypeError, match="foreach must be None or a bool"):
        fused_cls(layer.parameters(), lr=0.1, foreach="yes")


@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS, ids=lambda c: c.__name__)
def test_state_dicts_with_torchs_switches_load_both_ways(fused_cls, torch_cls, device):
    """A checkpoint of torch's optimizer loads whatever implementation saved it (fused, capturable...);
    the switches stay the loading optimizer's own, hyperparameters and state come from the file."""
    options = dict(lr=0.05, momentum=0.9) if torch_cls is torch.optim.SGD else dict(lr=1e-2)
    model, reference = make_pair(device)
    # torch's fused implementation where it has one on the device (its foreach one for Adagrad on CUDA)
    torch_opt = torch_cls(reference.parameters(), **options, **torch_path_reference(torch_cls, device))
    for step in range(3):
        torch_opt.zero_grad()
        backward(reference, torch.randn(4, 5, device=device), step)
        torch_opt.step()
    state = saved(torch_opt.state_dict())
    for group in state["param_groups"]:
        group.update(fused=False, foreach=True, differentiable=True)
        if "capturable" in group:
            group["capturable"] = True
    model.load_state_dict(reference.state_dict())
    fused = fused_cls(model.parameters(), **options, foreach=False)
    fused.load_state_dict(state)
    group = fused.param_groups[0]
    assert group["fused"] is None and group["foreach"] is False and group["differentiable"] is False
    assert group.get("capturable", False) is False
    assert group["lr"] == options["lr"]
    for group in torch_opt.param_groups:
        group.update(fused=None, foreach=False)  # continue the trajectory with torch's for-loop
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)
    # ... and back: torch's optimizer takes tfuse's state dict (through a checkpoint file).
    again = torch_cls(make_pair(device)[1].parameters(), **options)
    again.load_state_dict(saved(fused.state_dict()))
    assert sorted(again.param_groups[0]) == sorted(torch_opt.param_groups[0])


# ---------------------------------------------------------------------------- argument errors


def torch_error(factory) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        factory()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("fused_cls,torch_cls,options", [
    (FusedAdam, torch.optim.Adam, dict(betas=(0.9, torch.tensor(0.99)))),
    (FusedAdam, torch.optim.Adam, dict(betas=(0, 0.99))),
    (FusedAdam, torch.optim.Adam, dict(betas=(torch.tensor([0.9]), torch.tensor([[0.99, 0.9]])))),
    (FusedAdam, torch.optim.Adam, dict(lr=-1e-3, eps=-1.0)),  # the first bad one is named, as in torch
    (FusedAdam, torch.optim.Adam, dict(betas=(0.9, 1.0))),
    (FusedAdamW, torch.optim.AdamW, dict(lr=-0.1)),
    (FusedAdamW, torch.optim.AdamW, dict(eps=-1e-8)),
    (FusedAdamW, torch.optim.AdamW, dict(betas=(-0.1, 0.9))),
    (FusedSGD, torch.optim.SGD, dict(lr=-0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=torch.tensor([0.1, 0.2]))),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, weight_decay=torch.tensor(-1.0))),
    (FusedMomentum, torch.optim.SGD, dict(lr=0.1, momentum=-0.9)),
    (FusedMomentum, torch.optim.SGD, dict(lr=0.1, momentum=0.0, nesterov=True)),
    (FusedMomentum, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5, nesterov=True)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr=-0.1)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr_decay=-0.1)),
    (FusedAdagrad, torch.optim.Adagrad, dict(weight_decay=-0.1)),
    (FusedAdagrad, torch.optim.Adagrad, dict(initial_accumulator_value=-1.0)),
    (FusedAdagrad, torch.optim.Adagrad, dict(eps=-1e-10)),
], ids=str)
def test_bad_arguments_raise_torchs_error(fused_cls, torch_cls, options):
    layer = nn.Linear(2, 2)
    torch_options = dict(options)
    if fused_cls is FusedMomentum:
        torch_options.setdefault("momentum", 0.9)
    expected_type, expected = torch_error(lambda: torch_cls(layer.parameters(), **torch_options))
    with pytest.raises(expected_type) as info:
        fused_cls(layer.parameters(), **options)
    assert str(info.value) == expected


@pytest.mark.parametrize("options,words", [
    (dict(lr=-0.1), "Invalid learning rate: -0.1"),
    (dict(betas=(1.5, 0.9)), "Invalid beta parameter at index 0: 1.5"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
    (dict(betas=(0.9,)), "betas must be a pair (beta1, beta2)"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (dict(differentiable=True), "differentiable=True is not supported"),
    (dict(capturable=1), "capturable must be a bool"),
], ids=str)
def test_lions_bad_arguments_are_refused_in_torchs_words(options, words):
    """Lion has no torch class: its errors use the words torch's optimizers use for the same mistakes."""
    with pytest.raises((ValueError, TypeError)) as info:
        FusedLion(nn.Linear(2, 2).parameters(), **options)
    assert words in str(info.value)


@pytest.mark.parametrize("options,words", [
    (dict(lr=-0.1), "Invalid learning rate: -0.1"),
    (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0: 1.0"),
    (dict(eps=-1e-6), "Invalid epsilon value: -1e-06"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (dict(fused=False), "fused=False asks for one of torch's non-fused implementations"),
], ids=str)
def test_lambs_bad_arguments_are_refused_in_torchs_words(options, words):
    with pytest.raises(ValueError) as info:
        FusedLAMB(nn.Linear(2, 2).parameters(), **options)
    assert words in str(info.value)


def test_lars_bad_arguments_are_refused_in_torchs_words():
    for options, words in [(dict(lr=-1.0), "Invalid learning rate: -1.0"), (dict(momentum=-0.9), "Invalid momentum"),
                           (dict(trust_coefficient=-1e-3), "Invalid trust_coefficient value: -0.001"),
                           (dict(momentum=0.0, nesterov=True), "Nesterov momentum requires a momentum")]:
        with pytest.raises(ValueError, match=words):
            FusedLARS(nn.Linear(2, 2).parameters(), **options)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedLARS], ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_lamb_and_lars_take_three_launches_per_flat_buffer_and_say_so(cls, backend, device):
    """Per-parameter trust ratios, whatever the number of parameters and groups: moments and partial sums, the
    ratios, the update; none on the PyTorch path."""
    model, _ = make_pair(device)
    extra = nn.Linear(3, 4).to(device=device, dtype=torch.float64)  # a second flat buffer
    optimizer = cls([{"params": model.parameters()}, {"params": extra.parameters(), "weight_decay": 0.0}])
    backward(model, torch.randn(4, 5, device=device), 0)
    extra(torch.randn(2, 3, device=device, dtype=torch.float64)).sum().backward()
    with tfuse.use_backend(backend):
        text = optimizer.describe()
        with tfuse.count_launches() as launches:
            optimizer.step()
    if backend == "triton":
        first, last = ("_lamb_moments_kernel", "_lamb_update_kernel") if cls is FusedLAMB else (
            "_lars_norms_kernel", "_lars_update_kernel")
        assert launches.by_kernel == {first: 2, "_trust_ratio_kernel": 2, last: 2}
        assert "6 Triton launches per step" in text and "(3 launches per flat buffer)" in text
    else:
        assert launches.total == 0 and "PyTorch path (torch's foreach ops (_foreach_norm" in text


def test_lions_signature_and_describe(device):
    """Positional as the paper's hyperparameters (lr, betas, weight_decay), the rest keyword-only; describe()
    names the kernel, or torch's foreach ops on the PyTorch path."""
    parameters = inspect.signature(FusedLion).parameters
    assert [n for n, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "params", "lr", "betas", "weight_decay"]
    assert (parameters["lr"].default, parameters["betas"].default) == (1e-4, (0.9, 0.99))
    layer = nn.Linear(3, 2, device=device)
    optimizer = FusedLion(layer.parameters())
    with tfuse.use_backend("triton"):
        assert "Triton kernel _lion_kernel" in optimizer.describe()
    with tfuse.use_backend("torch"):
        assert "PyTorch path (torch's foreach ops" in optimizer.describe()
    half = FusedLion(nn.Linear(3, 2, device=device, dtype=torch.bfloat16).parameters())
    with tfuse.use_backend("torch"):
        assert "on float32 copies rounded to bfloat16, as the Triton kernel computes" in half.describe()


def test_tensor_betas_work_like_torchs(device):
    model, reference = make_pair(device)
    betas = (torch.tensor([0.8]), torch.tensor(0.95))
    fused = FusedAdam(model.parameters(), lr=1e-2, betas=betas)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, betas=betas, foreach=False)
    run_side_by_side(model, reference, fused, torch_opt, 3, device, torch.float32)


def test_master_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="master_weights must be a bool"):
        FusedAdam(nn.Linear(2, 2).parameters(), master_weights="yes")


# ---------------------------------------------------------------------------- which backend serves the step


@pytest.mark.parametrize("fused_cls,kernel,torch_kernel", [
    (FusedAdam, "_adam_kernel", "_fused_adam_"), (FusedAdamW, "_adam_kernel", "_fused_adamw_"),
    (FusedMomentum, "_sgd_kernel", "_fused_sgd_"), (FusedAdagrad, "_adagrad_kernel", "_fused_adagrad_"),
])
def test_describe_and_repr_say_which_backend_serves_the_step(fused_cls, kernel, torch_kernel, device):
    model, _ = make_pair(device)
    extra = nn.Linear(3, 4).to(device=device, dtype=torch.float64)  # a second flat buffer
    optimizer = fused_cls([{"params": model.parameters()}, {"params": extra.parameters()}], lr=1e-2)
    backward(model, torch.randn(4, 5, device=device), 0)
    extra(torch.randn(2, 3, device=device, dtype=torch.float64)).sum().backward()
    for backend in ("triton", "torch"):
        with tfuse.use_backend(backend):
            text, shown = optimizer.describe(), repr(optimizer)
            with tfuse.count_launches() as launches:
                optimizer.step()
        assert text.startswith(f"{fused_cls.__name__}: 9 parameters (")
        assert "in 2 flat buffers" in text
        step_line = shown.splitlines()[1]
        assert shown.splitlines()[0] == f"{fused_cls.__name__} (" and step_line.startswith("Step: ")
        assert step_line[len("Step: "):] in text and "Parameter Group 1" in shown  # torch's repr follows
        if backend == "triton":
            assert launches.total == 2
            assert "2 Triton launches per step" in text and f"Triton kernel {kernel}" in text
            assert "PyTorch" not in text
        else:
            assert launches.total == 0
            assert "0 Triton launches per step" in text and f"PyTorch path (torch.{torch_kernel}" in text
            assert "no Triton kernel runs" in text and "Triton kernel _" not in text


def test_describe_names_the_float32_route_for_low_precision(monkeypatch, device):
    model = make_pair(device)[0].to(torch.bfloat16)
    with tfuse.use_backend("torch"):
        masters = FusedAdamW(model.parameters(), master_weights=True)
        assert "torch._fused_adamw_ on the float32 master weights" in masters.describe()
        monkeypatch.setattr(_torch_probe, "_NATIVE_OK", {("_fused_sgd_", torch.bfloat16, device.type): False,
                                                          ("_fused_adam_", torch.bfloat16, device.type): True})
        other = make_pair(device)[0].to(torch.bfloat16)
        assert "on float32 copies rounded to bfloat16" in FusedSGD(other.parameters(), lr=0.1).describe()
        native = make_pair(device)[0].to(torch.bfloat16)
        text = FusedAdam(native.parameters()).describe()
        assert "PyTorch path (torch._fused_adam_;" in text and "float32" not in text


def test_the_first_step_logs_its_backend_once(caplog, device):
    model, _ = make_pair(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    caplog.set_level(logging.INFO, logger=OPTIMIZER_LOGGER)
    for backend in ("torch", "torch", "triton", "torch", "triton"):
        backward(model, torch.randn(4, 5, device=device), 0)
        with tfuse.use_backend(backend):
            optimizer.step()
    messages = [r.getMessage() for r in caplog.records if r.name == OPTIMIZER_LOGGER and "is updated by" in r.getMessage()]
    assert len(messages) == 2, messages  # once per backend that served a step
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == OPTIMIZER_LOGGER)
    assert "FusedAdam: the" in messages[0] and "PyTorch path (torch._fused_adam_" in messages[0]
    assert "Triton kernel _adam_kernel" in messages[1]


@pytest.mark.skipif(ON_CUDA, reason="the CPU-without-interpreter case")
def test_on_a_cpu_without_the_interpreter_describe_and_the_log_say_pytorch_path():
    """The case of the issue: no TRITON_INTERPRET, CPU tensors. No Triton kernel runs, and
    describe(), repr() and the first step's log say so; float16 SGD still updates."""
    script = textwrap.dedent("""
        import logging, torch, tfuse
        from tfuse.optim import FusedMomentum
        logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
        assert not tfuse._backend.interpreter_active()
        p = torch.nn.Parameter(torch.ones(64, dtype=torch.float16))
        o = FusedMomentum([p], lr=0.1)
        print("DESCRIBE", o.describe())
        print("REPR", repr(o).splitlines()[1])
        p.grad = torch.ones_like(p)
        with tfuse.count_launches() as launches:
            o.step()
            o.step()
        print("LAUNCHES", launches.total, "VALUE", round(p[0].item(), 3))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", tfuse.BACKEND_ENV_VAR)}
    result = run_command([sys.executable, "-c", script], env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    lines = {line.split(" ", 1)[0]: line for line in out.splitlines() if line.split(" ", 1)[0] in ("DESCRIBE", "REPR")}
    for key in ("DESCRIBE", "REPR"):
        assert "0 Triton launches per step" in lines[key] and "PyTorch path (torch._fused_sgd_" in lines[key], lines[key]
    assert "LAUNCHES 0 VALUE 0.71\n" in out  # 1 - 0.1, then 0.9 - 0.1 * 1.9 (torch.optim.SGD: 0.71)
    log = [line for line in out.splitlines() if line.startswith(f"LOG {OPTIMIZER_LOGGER} FusedMomentum: ")]
    assert len(log) == 1, out  # once, at the first step
    assert "the cpu float16 flat buffer (1 parameters) is updated by the PyTorch path" in log[0]
    assert log[0].endswith("[CPU tensors without TRITON_INTERPRET=1]")
