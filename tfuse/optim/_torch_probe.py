"""The low-precision probe of torch's fused kernels: whether one computes float16/bfloat16 right.

torch's fused CPU kernels are not trusted blindly for float16/bfloat16:
torch 2.13's ``_fused_sgd_`` leaves low-precision parameters unchanged (its
vectorized loop never stores them). :func:`native_low_precision_ok` runs a
small probe of torch's kernel against the same kernel on float32 copies, once
per process and (kernel, dtype, device type), and remembers the verdict.
"""

from __future__ import annotations

import logging

import torch

from tfuse.optim._update_families import UpdateFamily

# The logger the probe has always logged under (it began in tfuse.optim._update).
logger = logging.getLogger("tfuse.optim._update")

# (torch kernel name, dtype, device type) -> whether torch's fused kernel computes that dtype right.
_NATIVE_OK: dict[tuple[str, torch.dtype, str], bool] = {}


def native_low_precision_ok(family: UpdateFamily, kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's fused ``kernel`` updates ``dtype`` tensors on ``device``'s type correctly.

    Checked once per process and (kernel, dtype, device type): a few steps of
    the option sets of ``family.probe_sequences(kernel)`` on a 331-element
    tensor (vector bodies of every CPU ISA and a tail), with and without a grad
    scale, against the same kernel on float32 copies rounded back to ``dtype``.
    Parameters, state and unscaled gradients must agree within 2 units in the
    last place. torch 2.13's ``_fused_sgd_`` fails it on CPU for float16 and
    bfloat16: it leaves the parameters unchanged.
    """
    if device.type == "meta":
        return True  # nothing is computed on the meta device
    key = (kernel, dtype, device.type)
    ok = _NATIVE_OK.get(key)
    if ok is None:
        with torch.no_grad():
            ok = _probe(family, kernel, dtype, device)
        _NATIVE_OK[key] = ok
        if not ok:
            logger.info(
                "tfuse: torch.%s gives wrong results for %s tensors on %s (torch %s); tfuse computes these "
                "updates on float32 copies and rounds them instead",
                kernel,
                str(dtype).replace("torch.", ""),
                device.type,
                torch.__version__,
            )
    return ok


def _probe(family: UpdateFamily, kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
    generator = torch.Generator().manual_seed(0)  # never the global generator: the user's randomness stays theirs
    n = 331
    finfo = torch.finfo(dtype)

    def random(scale: float = 1.0, positive: bool = False) -> torch.Tensor:
        values = torch.randn(n, generator=generator) * scale
        return (values.abs() if positive else values).to(device=device, dtype=dtype)

    def agree(native: torch.Tensor, reference: torch.Tensor) -> bool:
        return bool(torch.isclose(native.float(), reference.float(), rtol=2 * finfo.eps, atol=finfo.tiny).all())

    for sequence in family.probe_sequences(kernel):
        for grad_scale in (None, torch.tensor(8.0, device=device)):
            names = sequence[0].state_names
            param = random()
            states = {name: random(0.1, positive=True) for name in names}
            for hyper in sequence:
                grad = random(1.0 if grad_scale is None else 8.0)
                native = [param.clone()], [grad.clone()], {k: [v.clone()] for k, v in states.items()}
                family.torch_call(hyper, *native, grad_scale)
                upcast = [param.float()], [grad.float()], {k: [v.float()] for k, v in states.items()}
                family.torch_call(hyper, *upcast, grad_scale)
                param, grad = upcast[0][0].to(dtype), upcast[1][0].to(dtype)
                states = {k: v[0].to(dtype) for k, v in upcast[2].items()}
                if not agree(native[0][0], param) or (grad_scale is not None and not agree(native[1][0], grad)):
                    return False
                if not all(agree(native[2][k][0], states[k]) for k in names):
                    return False
    return True
