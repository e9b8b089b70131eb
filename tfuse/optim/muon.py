"""FusedMuon: torch.optim.Muon over flat buffers, for 2-D and convolution weights, with an AdamW side group."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tfuse.flat import FlatParams
from tfuse.optim._checks import as_float, check_betas, check_capturable_flag, check_lr, check_non_negative
from tfuse.optim._flat_optimizer import FlatOptimizer
from tfuse.optim._muon_family import MUON, NS_COEFFICIENTS, MuonStep
from tfuse.optim._newton_schulz import matrix_shape
from tfuse.optim._update import ADAM, AdamStep
from tfuse.optim.adam import FusedAdam

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


class AdamWSideRule:
    """The update rule of FusedMuon's AdamW groups (``use_muon=False``): torch's AdamW from the group's
    ``lr``, ``betas``, ``eps`` and ``weight_decay``."""

    family = ADAM
    state_names = ("exp_avg", "exp_avg_sq")
    # As FusedMuon's: whichever kind's span stepper makes the buffer's state, Muon's momentum shares exp_avg.
    state_aliases: ClassVar[dict[str, str]] = {"momentum_buffer": "exp_avg"}

    @staticmethod
    def update_row(group: dict[str, Any], step: int, first: bool) -> AdamStep:
        adamw = {**group, "amsgrad": False, "maximize": False, "decoupled_weight_decay": True}
        return FusedAdam.update_row(adamw, step, first)

    def state_names_of(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self.state_names

    def pads_stay_zero(self) -> bool:
        return True

    def initial_state(self, name: str, group: dict[str, Any]) -> float:
        return 0.0


class FusedMuon(FlatOptimizer):
    """Muon (Keller Jordan's MomentUm Orthogonalized by Newton-Schulz) over flat buffers, as torch.optim.Muon
    computes it, for matrices and convolution weights, with the other parameters in AdamW groups.

    Per matrix parameter, with ``g`` its gradient and ``B`` its momentum::

        B = momentum * B + (1 - momentum) * g          (torch's lerp)
        U = (1 - momentum) * g + momentum * B if nesterov else B
        O = NewtonSchulz(U)    (ns_steps quintic iterations with ns_coefficients, in ns_dtype)
        p = p * (1 - lr * weight_decay) - lr * ratio * O

    Conventions, stated: the maths, defaults, hyperparameter checks and
    ``state_dict`` of ``torch.optim.Muon`` (state ``momentum_buffer``); the
    iterations run in bfloat16 by default, as torch's; a parameter with more
    than two dimensions (a convolution weight ``(out, in, kh, kw)``) is the
    matrix ``(out, in*kh*kw)``, and ``ratio`` is computed from that shape
    ``(A, B)``: ``sqrt(max(1, A/B))`` (``adjust_lr_fn=None`` or
    ``"original"``, Keller's) or ``0.2 * sqrt(max(A, B))``
    (``"match_rms_adamw"``, Moonshot's); weight decay is decoupled and
    scaled by the unadjusted ``lr``. On 2-D weights the update is
    torch.optim.Muon's: the same ops on the same values (on the CPU bit for
    bit, but where torch's mm and bmm round a tiny bfloat16 product
    differently, which moves entries of the update by a bfloat16 ulp).

    The other parameters go to AdamW groups of the same optimizer
    (``use_muon=False`` in their group; state ``step``, ``exp_avg``,
    ``exp_avg_sq``), as people use Muon: a group without ``use_muon`` is
    split, its matrices to Muon (with the group's options) and its other
    parameters (biases, norms) to AdamW with ``adamw_lr``, ``adamw_betas``,
    ``adamw_eps`` and ``adamw_weight_decay``; embeddings and output heads
    are matrices, so put them in a group with ``use_muon=False`` (where
    ``lr``, ``betas``, ``eps`` and ``weight_decay`` are AdamW's) to keep
    them off Muon. A group with ``use_muon=True`` takes matrices only.

    Each step is two Triton launches per flat buffer around the
    orthogonalisation, which runs as three batched matmuls per iteration per
    group of same-shaped matrices (torch.optim.Muon runs about 17 launches per
    parameter); AdamW groups take one launch per buffer. Without Triton,
    torch's foreach ops around the same batched orthogonalisation. The
    optimizer coalesces the two kinds into FlatParams of their own; where
    they already share one (``FusedDataParallel``, ``tfuse.setup``), they
    share its state: Muon's momentum lives in the elements of AdamW's
    ``exp_avg`` buffer that no AdamW parameter uses, so the state is two
    parameter-sized buffers (as AdamW's), with one set of masters.
    ``master_weights``, ``capturable`` and GradScaler work as for
    :class:`~tfuse.optim.FusedAdam`. Not in ``ShardedOptimizer`` yet.

    Args:
        params: parameters or parameter groups, or a :class:`~tfuse.flat.FlatParams`.
        lr: Muon's learning rate, a float or a 0-dim tensor.
        weight_decay: Muon's decoupled weight decay.
        momentum: the momentum factor.
        nesterov: Nesterov momentum.
        ns_coefficients: the quintic's ``(a, b, c)``.
        eps: the floor of the Frobenius norm the matrix is divided by first.
        ns_steps: Newton-Schulz iterations (fewer than 100).
        adjust_lr_fn: None, ``"original"`` or ``"match_rms_adamw"``.
        ns_dtype: what the iterations compute in (torch.bfloat16, torch.float32 or torch.float64).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW groups' options (Keller Jordan's
            ``MuonWithAuxAdam`` defaults).
        master_weights: float32 master copies for float16/bfloat16 parameters.
        capturable: keep the step on the device (CUDA graphs).

    Example:
        >>> import torch
        >>> from tfuse.optim import FusedMuon
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 10))
        >>> optimizer = FusedMuon(net.parameters(), lr=0.02)
        >>> [(len(g["params"]), g["use_muon"]) for g in optimizer.param_groups]  # weights; biases to AdamW
        [(2, True), (2, False)]
        >>> net(torch.randn(2, 3, 8, 8)).sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[net[0].weight]), sorted(optimizer.state[net[0].bias])
        (['momentum_buffer'], ['exp_avg', 'exp_avg_sq', 'step'])
    """

    family = MUON
    state_names = ("momentum_buffer", "exp_avg", "exp_avg_sq")  # Muon's, and the AdamW groups'
    torch_name = "torch.optim.Muon"
    structural_keys = ("use_muon",)
    state_aliases: ClassVar[dict[str, str]] = {"momentum_buffer": "exp_avg"}  # one buffer, each element's once

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float | torch.Tensor = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float = 0.0,
        master_weights: bool = False,
        capturable: bool = False,
    ) -> None:
        check_capturable_flag(type(self).__name__, capturable)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            differentiable=False,  # (torch.optim adds it to the defaults of every unpickled optimizer)
        )
        self._check_muon(defaults)
        self.adamw_options = dict(
            lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )  # fmt: skip
        self._check_adamw(self.adamw_options)
        super().__init__(params, defaults, master_weights, capturable=capturable)

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._side = AdamWSideRule()  # the AdamW groups' rule (held here: spans hold rules weakly)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.adamw_options = state.pop("adamw_options", {})
        super().__setstate__(state)

    def _raw_state(self) -> dict[str, Any]:
        return {**super()._raw_state(), "adamw_options": self.adamw_options}

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group as torch does; one without ``use_muon`` is split into its matrices (Muon) and its
        other parameters (AdamW, with the ``adamw_*`` options)."""
        for part in self._split(param_group):
            super().add_param_group(part)

    def _split(self, group: Any) -> list[dict[str, Any]]:
        if not isinstance(group, dict):
            return [group]  # torch's TypeError, in torch's words
        params = group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, FlatParams):
            params = list(params.params)
        elif isinstance(params, set):
            return [group]  # torch's TypeError (ordered collections only)
        params = list(params)
        if params and all(isinstance(p, tuple) and len(p) == 2 for p in params):  # named_parameters()
            group = {**group, "param_names": [name for name, _ in params]}
            params = [param for _, param in params]
        use_muon = group.get("use_muon")
        if use_muon is not None:
            if not use_muon:
                return [{**self.adamw_options, **group, "params": params, "use_muon": False}]
            return [{**group, "params": params, "use_muon": True}]
        names = group.get("param_names")
        matrices = [i for i, p in enumerate(params) if isinstance(p, torch.Tensor) and p.dim() >= 2]
        others = [i for i in range(len(params)) if i not in set(matrices)]
        parts = []
        for indices, options, flag in ((matrices, group, True), (others, self.adamw_options, False)):
            if not indices:
                continue
            part = {**options, "params": [params[i] for i in indices], "use_muon": flag}
            if flag is False:
                part.update({k: v for k, v in group.items() if k not in (*_ADAMW_KEYS, *self.defaults, "params")})
            if names is not None:
                part["param_names"] = [names[i] for i in indices]
            parts.append(part)
        return parts or [{**group, "params": params, "use_muon": True}]

    def check_group(self, group: dict[str, Any]) -> None:
        if not group.get("use_muon", True):
            self._check_adamw(group)
            return
        self._check_muon(group)
        for param in group.get("params", ()):
            if param.dim() < 2:
                raise ValueError(
                    "Muon only supports 2D parameters (and N-D ones as (size(0), -1) matrices) whereas we found a "
                    f"parameter with size: {param.size()}; put it in a group with use_muon=False (AdamW)"
                )
            matrix_shape(param)  # a layout Muon can read as a matrix

    @staticmethod
    def _check_muon(group: dict[str, Any]) -> None:
        """torch.optim.Muon's checks, in its words, and those torch makes only at the step."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not group["momentum"] >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
        if not group["weight_decay"] >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
        if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
        if not (isinstance(group["ns_steps"], int) and 0 <= group["ns_steps"] < 100):
            raise ValueError(
                f"Number of steps must be less than 100 for computational efficiency (ns_steps={group['ns_steps']})"
            )
        if len(group["ns_coefficients"]) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        if not group["eps"] >= 0.0:
            raise ValueError(f"Invalid epsilon value: {group['eps']}")
        if group.get("ns_dtype", torch.bfloat16) not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"ns_dtype must be a floating dtype, got {group['ns_dtype']!r}")

    def _check_adamw(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_non_negative(group["eps"], "epsilon")
        check_betas(type(self).__name__, group["betas"])
        check_non_negative(group["weight_decay"], "weight_decay")

    # ------------------------------------------------------------------ the update rules

    def _coalesce(self, loose: list[torch.Tensor]) -> list[FlatParams]:
        # Matrices and the rest in FlatParams of their own: each kind's state buffers cover its own kind only.
        side = {id(p) for g in self.param_groups if not g["use_muon"] for p in g["params"]}
        kinds = ([p for p in loose if id(p) not in side], [p for p in loose if id(p) in side])
        return [FlatParams(kind) for kind in kinds if kind]

    def rule_for(self, group: dict[str, Any]) -> Any:
        return self if group["use_muon"] else self._side

    def required_state(self, group: dict[str, Any]) -> set[str]:
        return {"momentum_buffer"} if group.get("use_muon", True) else {"step", "exp_avg", "exp_avg_sq"}

    def update_row(self, group: dict[str, Any], step: int, first: bool) -> MuonStep:
        return MuonStep(
            lr=as_float(group["lr"]),
            momentum=as_float(group["momentum"]),
            weight_decay=as_float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            ns_coefficients=tuple(as_float(c) for c in group["ns_coefficients"]),
            eps=as_float(group["eps"]),
            ns_steps=int(group["ns_steps"]),
            adjust_lr_fn=group["adjust_lr_fn"],
            ns_dtype=group.get("ns_dtype", torch.bfloat16),
        )
