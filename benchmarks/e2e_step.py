"""One training step, built the way each system's user builds it, and how the end-to-end benchmark times it.

A step is ``zero_grad``, forward under autocast, cross-entropy loss,
backward, gradient clipping to norm 1, optimizer step; it returns the loss
(a tensor: nothing in a step reads it on the host). Variants:

* ``eager``: the model's nn layers, ``torch.optim.SGD(fused=True)`` (AdamW for
  GPT-2), ``torch.nn.utils.clip_grad_norm_``;
* ``tfuse``: ``tfuse.setup`` on a copy of the same model (``fuse_model`` with
  the batch as example input, ``FusedMomentum``/``FusedAdamW`` over the flat
  buffers), ``tfuse.optim.clip_grad_norm_`` of the optimizer;
* ``eager + CUDA graph`` / ``tfuse + CUDA graph``: the same steps captured
  whole in one CUDA graph by ``tfuse.capture_step`` (capturable optimizers,
  gradients zeroed in place) and replayed;
* ``torch.compile``: the eager variant with ``torch.compile(model)``.

Example:
    >>> import torch
    >>> from benchmarks.e2e_models import build
    >>> from benchmarks.e2e_step import Workload, make_variant
    >>> load = Workload(build("resnet50", "tiny"), batch=2, layout="nchw", device=torch.device("cpu"))
    >>> variant = make_variant("eager", load, load.make_base())
    >>> len(variant.losses)
    2
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .e2e_models import ModelSpec

VARIANTS = ("eager", "tfuse", "eager + CUDA graph", "tfuse + CUDA graph", "torch.compile")
GRAPH_VARIANTS = ("eager + CUDA graph", "tfuse + CUDA graph")
LR, MOMENTUM, WEIGHT_DECAY, CLIP_NORM = 0.02, 0.9, 1e-4, 1.0
ADAM_LR = 3e-4
WARMUP_STEPS = 3  # the first two steps' losses are the agreement check; the third settles allocator and caches


@dataclasses.dataclass
class Workload:
    """A model, a batch size and a memory layout on a device: what every variant of one table row group shares."""

    spec: ModelSpec
    batch: int
    layout: str  # "channels_last", "nchw" or "tokens"
    device: torch.device
    amp_dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def __post_init__(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self.inputs, self.targets = self.spec.batch(self.batch, self.device, generator)
        if self.layout == "channels_last":
            self.inputs = self.inputs.contiguous(memory_format=torch.channels_last)

    def make_base(self) -> nn.Module:
        """The model every variant starts from (seeded init, on the device, in the layout)."""
        torch.manual_seed(self.seed)
        model = self.spec.make().to(self.device)
        if self.layout == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        return model.train()

    def loss(self, model: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        low_precision = self.amp_dtype != torch.float32  # (float32: no autocast, as a check of the maths)
        with torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=False, enabled=low_precision):
            logits = model(self.inputs)
        return F.cross_entropy(logits.float().flatten(0, -2), self.targets.flatten())

    @property
    def samples(self) -> int:
        """Images, or tokens, per step."""
        return self.inputs.numel() if self.spec.tokens else self.batch


@dataclasses.dataclass
class Variant:
    """A variant ready to time: its step, the losses of its first two steps, what building it cost."""

    name: str
    step: Callable[[], torch.Tensor]
    losses: list[float]
    setup_s: float
    peak_mb: float | None = None
    triton_launches: int | None = None
    note: str = ""
    keep: Any = None  # objects the step needs alive (graph, optimizer)


def make_variant(name: str, load: Workload, base: nn.Module) -> Variant:
    """Builds variant ``name`` from a copy of ``base`` and runs its warm-up steps (compiles, captures)."""
    if name not in VARIANTS:
        raise ValueError(f"e2e: unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
    on_gpu = load.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    graphed = name in GRAPH_VARIANTS
    if graphed and not on_gpu:
        raise RuntimeError("e2e: CUDA graph variants need a GPU")
    step, keep, note = _build_step(name, load, copy.deepcopy(base), graphed)
    losses: list[float] = []
    launches = None
    if graphed:
        replay, keep, launches = _capture(step, losses, load.seed, keep)
        step = replay
    else:
        for index in range(WARMUP_STEPS):
            torch.manual_seed(load.seed + index)  # the same dropout masks in every variant's checked steps
            loss = step()
            if index < 2:
                losses.append(float(loss))
        launches = _triton_launches(step)
    if on_gpu:
        torch.cuda.synchronize()
    variant = Variant(name, step, losses, time.perf_counter() - start, note=note, keep=keep, triton_launches=launches)
    if on_gpu:
        variant.peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    return variant


StepFn = Callable[[], torch.Tensor]


def _build_step(name: str, load: Workload, model: nn.Module, graphed: bool) -> tuple[StepFn, Any, str]:
    adam = load.spec.tokens
    lr: float | torch.Tensor = torch.tensor(ADAM_LR if adam else LR, device=load.device) if graphed else (
        ADAM_LR if adam else LR)
    if name.startswith("tfuse"):
        import tfuse

        kwargs: dict[str, Any] = dict(lr=lr, weight_decay=0.01 if adam else WEIGHT_DECAY)
        if not adam:
            kwargs["momentum"] = MOMENTUM
        if graphed:
            kwargs["capturable"] = True
        made = tfuse.setup(model, "adamw" if adam else "momentum", example_inputs=(load.inputs,), **kwargs)
        fused, optimizer = made.model, made.optimizer

        def clip() -> None:
            tfuse.optim.clip_grad_norm_(optimizer, CLIP_NORM)

        forward: Callable[[torch.Tensor], torch.Tensor] = fused
        note = str(made.report)
    else:
        params = list(model.parameters())
        if adam:
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True, capturable=graphed)
        else:
            optimizer = torch.optim.SGD(params, lr=lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, fused=True)

        def clip() -> None:
            torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)

        forward = torch.compile(model) if name == "torch.compile" else model
        note = ""

    def step() -> torch.Tensor:
        # A graph replays into the same gradient tensors, so they are zeroed in place there; otherwise the
        # user's default (set_to_none=True).
        optimizer.zero_grad(set_to_none=not graphed)
        loss = load.loss(forward)
        loss.backward()
        clip()
        optimizer.step()
        # Detached: a step must not keep its autograd graph alive into the next one (a graph held across the
        # warm-up and the capture makes autograd synchronise streams inside the capture).
        return loss.detach()

    return step, (model, optimizer), note


def _capture(step: StepFn, losses: list[float], seed: int, keep: Any) -> tuple[StepFn, Any, int | None]:
    """The step captured in one CUDA graph by ``tfuse.capture_step`` (its ``WARMUP_STEPS`` warm-up steps on a side
    stream compile kernels and create state; the first two give the checked losses)."""
    import tfuse

    warmed = 0
    launches: list[int] = []

    def warm_up_or_capture() -> torch.Tensor:
        nonlocal warmed
        if torch.cuda.is_current_stream_capturing():
            with tfuse.count_launches() as counted:
                loss = step()
            launches.append(counted.total)
            return loss
        torch.manual_seed(seed + warmed)  # the same dropout masks in every variant's checked steps
        loss = step()
        if warmed < 2:
            losses.append(float(loss))  # a sync, in the first warm-up steps only (the last one is checked for syncs)
        warmed += 1
        return loss

    model, optimizer = keep
    captured = tfuse.capture_step(warm_up_or_capture, optimizers=optimizer, models=model, warmup=WARMUP_STEPS)
    captured()  # once, synchronised, so that a fault in the graph shows here, in this variant's row
    torch.cuda.synchronize()
    return captured, captured, launches[0]


def _triton_launches(step: Callable[[], torch.Tensor]) -> int:
    import tfuse

    with tfuse.count_launches() as launches:
        step()
    return launches.total


# ------------------------------------------------------------------------------------------------ timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(variants: dict[str, Variant], device: torch.device, rounds: int, steps: int) -> dict[str, list[float]]:
    """Wall time per step of ``steps`` back-to-back steps, per round; rounds interleave the variants, each round
    starting from the next one."""
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step = variants[name].step
            sync(device)
            begin = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
            samples[name].append((time.perf_counter() - begin) * 1e3 / steps)
    return samples


def host_ms(variant: Variant, device: torch.device, steps: int) -> list[float]:
    """Host time of single steps started on an idle GPU: the time until the step's Python returns (the GPU
    runs ahead, so this is what the host spends issuing the step, unless the step waits for the device)."""
    samples = []
    for _ in range(steps):
        sync(device)
        begin = time.perf_counter()
        variant.step()
        samples.append((time.perf_counter() - begin) * 1e3)
    sync(device)
    return samples


def device_profile(variant: Variant, device: torch.device) -> tuple[float | None, int | None]:
    """(device ms, kernels) of one step: the sum of the GPU activities the profiler records, and their count."""
    if device.type != "cuda":
        return None, None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        variant.step()
        sync(device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events:
        return None, None
    return sum(e.time_range.elapsed_us() for e in events) / 1e3, len(events)


def summary(samples: list[float]) -> dict[str, float]:
    """Median, minimum and maximum."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}
