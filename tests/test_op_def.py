"""One op definition builds both the eager autograd Function and the torch.library op.

tfuse's ops are each written once (:class:`tfuse.ops._library.OpDef`: body,
setup_context, backward). These tests check the builder itself on a small op
with a list of tensors (the eager Function flattens it; backward sees it as
the schema has it), and that tfuse's own ops give the same values and
gradients by their eager Function and by ``torch.ops.tfuse.*``, each checked
against torch.
"""

from __future__ import annotations

import pytest
import torch

import tfuse
from tfuse.ops import _library
from tfuse.ops._activations import Activation
from tfuse.ops._library import OpDef, tfuse_op

SEEN_FLAGS: list = []


def _scaled_sum_setup(ctx, inputs, output, scale_hint=None):
    tensors, scale = inputs
    ctx.scale = scale
    ctx.shapes = [t.shape for t in tensors]
    ctx.hint = scale_hint


def _scaled_sum_backward(ctx, grad):
    SEEN_FLAGS.append((ctx.needs_input_grad, ctx.hint))
    needed = ctx.needs_input_grad[0]
    return [grad.sum_to_size(shape) * ctx.scale if need else None for shape, need in zip(ctx.shapes, needed)], None


@tfuse_op("tfuse::test_scaled_sum", setup_context=_scaled_sum_setup, backward=_scaled_sum_backward)
def scaled_sum(tensors: list[torch.Tensor], scale: float, *, scale_hint: str | None = None) -> torch.Tensor:
    out = tensors[0] * scale
    for t in tensors[1:]:
        out = out + t * scale
    return out


@pytest.fixture(scope="module", autouse=True)
def _registered():
    _library.register_library()


def test_one_definition_gives_the_eager_function_and_the_registered_op():
    a, b, c = torch.randn(3, 4, requires_grad=True), torch.randn(4), torch.randn(1, 4, requires_grad=True)
    SEEN_FLAGS.clear()
    eager = scaled_sum.apply([a, b, c], 0.5, scale_hint="eager")
    eager_grads = torch.autograd.grad(eager.sum(), [a, c])
    registered = torch.ops.tfuse.test_scaled_sum([a, b, c], 0.5)
    registered_grads = torch.autograd.grad(registered.sum(), [a, c])
    reference = (a + b + c) * 0.5
    torch.testing.assert_close(eager, reference)
    torch.testing.assert_close(registered, reference)
    for ours, theirs in zip((*eager_grads, *registered_grads), torch.autograd.grad(reference.sum(), [a, c]) * 2):
        torch.testing.assert_close(ours, theirs)
    # The same backward, seeing needs_input_grad shaped like the schema on both paths; the eager extra
    # reaches setup_context on the eager path only.
    (eager_flags, eager_hint), (registered_flags, registered_hint) = SEEN_FLAGS
    assert [list(eager_flags[0]), eager_flags[1]] == [[True, False, True], False]
    assert [list(registered_flags[0]), registered_flags[1]] == [[True, False, True], False]
    assert (eager_hint, registered_hint) == ("eager", None)
    assert scaled_sum.function.__name__ == "TestScaledSum"


def test_eager_extras_stay_out_of_the_schema():
    schemas = {
        "add": torch.ops.tfuse.add.default._schema,
        "add_act": torch.ops.tfuse.add_act.default._schema,
        "batch_norm_act": torch.ops.tfuse.batch_norm_act.default._schema,
        "test_scaled_sum": torch.ops.tfuse.test_scaled_sum.default._schema,
    }
    for name, schema in schemas.items():
        names = [argument.name for argument in schema.arguments]
        assert not {"spec", "plan", "backend", "shape", "dtype", "scale_hint"} & set(names), (name, names)
    assert [a.name for a in schemas["add_act"].arguments] == ["tensors", "act", "negative_slope"]


def test_bad_definitions_are_refused():
    def body(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
        return xs[0]

    with pytest.raises(TypeError, match="at most one list of tensors"):
        OpDef("tfuse::test_two_lists", body, setup_context=_scaled_sum_setup, backward=_scaled_sum_backward)
    with pytest.raises(TypeError, match="give both setup_context and backward"):
        OpDef("tfuse::test_half", scaled_sum.body, setup_context=_scaled_sum_setup)


def _grads(y: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple:
    return torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tfuse_ops_agree_eager_and_registered(backend, monkeypatch, device):
    """Each op's eager Function (the public function's path) and its registered op give torch's values
    and gradients: add, add_act with a broadcast bias, batch norm + residual + relu in training."""
    monkeypatch.setenv("TFUSE_BACKEND", backend)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, device=device, requires_grad=True)
    skip = torch.randn_like(x, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn_like(x)

    cases = []
    cases.append((tfuse.add(x, bias), torch.ops.tfuse.add([x, bias]), x + bias, [x, bias]))
    gelu = int(Activation.from_name("gelu"))
    cases.append((
        tfuse.add_act(x, bias, act="gelu"),
        torch.ops.tfuse.add_act([x, bias], gelu, 0.01),
        torch.nn.functional.gelu(x + bias),
        [x, bias],
    ))
    weight = torch.rand(3, dtype=torch.float64, device=device, requires_grad=True)
    shift = torch.randn(3, dtype=torch.float64, device=device, requires_grad=True)
    mean, var = torch.zeros(3, dtype=torch.float64, device=device), torch.ones(3, dtype=torch.float64, device=device)
    relu = int(Activation.from_name("relu"))
    eager_bn = tfuse.functional.batch_norm_act(
        x, mean.clone(), var.clone(), weight, shift, training=True, residual=skip
    )
    registered_bn = torch.ops.tfuse.batch_norm_act(x, weight, shift, skip, mean, var, True, 0.1, 1e-5, relu, 0.01)[0]
    reference_bn = torch.relu(torch.nn.functional.batch_norm(x, None, None, weight, shift, True) + skip)
    cases.append((eager_bn, registered_bn, reference_bn, [x, weight, shift, skip]))

    for eager, registered, reference, inputs in cases:
        torch.testing.assert_close(eager, reference, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(registered, reference, rtol=1e-10, atol=1e-12)
        expected = _grads(reference, inputs, dy)
        for ours in (_grads(eager, inputs, dy), _grads(registered, inputs, dy)):
            for got, want in zip(ours, expected):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
