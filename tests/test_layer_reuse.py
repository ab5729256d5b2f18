"""fp4gen.nn.Linear and fp4gen.nn.GroupedLinear used as models use torch.nn.Linear: one layer called several times
before one backward (shared weights, a block applied twice), and activation checkpointing, which runs the forward
again inside backward (reentrant or not). Each must give, byte for byte, what plain calls give: the sum of the
calls' separate backward passes, and an uncheckpointed step (an fp32 GroupedLinear's bias gradient within its
unordered fp32 sums' rounding). Stochastic rounding restarts from the same state on both sides.
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fp4gen
from conftest import group_ends

IN, OUT, TOKENS = 64, 128, 48
RECIPES = {"default": fp4gen.Recipe(), "stochastic-1x16": fp4gen.Recipe(stochastic_rounding=True, weight_block=(1, 16))}


def assert_same_bias_gradient(got, want, grouped):
    """Byte for byte, but for an fp32 GroupedLinear's bias gradient, whose per-expert fp32 sums run in no fixed order
    on CUDA (index_add_): there within the sums' rounding, two units in the last place of fp32."""
    if not grouped or got.dtype != torch.float32:
        assert torch.equal(got, want)
        return
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * want.abs().max().item())


def _restart_rng(device):
    fp4gen.RNGState.default(device).reset(0)


def _twins(grouped, recipe, device, dtype):
    torch.manual_seed(7)
    kw = dict(recipe=RECIPES[recipe], device=device, dtype=dtype)
    layers = [fp4gen.nn.GroupedLinear(3, IN, OUT, bias=True, **kw) if grouped else fp4gen.nn.Linear(IN, OUT, **kw)
              for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    return layers


def _extra(grouped, device):
    if not grouped:
        return ()
    ends = group_ends([20, 0, TOKENS - 20])
    return (torch.tensor(ends, device=device) if device != "cpu" else ends,)


def check_two_calls_before_one_backward(grouped, recipe, device, dtype=torch.bfloat16):
    """y = layer(x1) + layer(x2), one backward: dX1, dX2, dW and db equal those of two separate backward passes
    (each quantizing its own dY, in the same order of draws), over three steps."""
    joint, separate = _twins(grouped, recipe, device, dtype)
    extra = _extra(grouped, device)
    for _ in range(3):
        x1, x2, dy1, dy2 = (torch.randn(TOKENS, n, device=device, dtype=dtype) for n in (IN, IN, OUT, OUT))
        got = [t.clone().requires_grad_(True) for t in (x1, x2)]
        want = [t.clone().requires_grad_(True) for t in (x1, x2)]
        for layer in (joint, separate):
            layer.weight.grad = layer.bias.grad = None
        _restart_rng(device)
        y1, y2 = joint(got[0], *extra), joint(got[1], *extra)
        torch.autograd.backward([y1, y2], [dy1, dy2])  # autograd runs y2's backward first, then y1's
        _restart_rng(device)
        w2 = separate(want[1], *extra)
        w2.backward(dy2)
        w1 = separate(want[0], *extra)
        w1.backward(dy1)
        assert torch.equal(y1, w1) and torch.equal(y2, w2)
        assert torch.equal(got[0].grad, want[0].grad) and torch.equal(got[1].grad, want[1].grad)
        assert torch.equal(joint.weight.grad, separate.weight.grad)
        assert_same_bias_gradient(joint.bias.grad, separate.bias.grad, grouped)


def check_activation_checkpointing(grouped, recipe, reentrant, device, dtype=torch.bfloat16):
    """A checkpointed call (forward run again in backward) gives the plain call's Y, dX, dW and db, over three
    steps."""
    ckpt, plain = _twins(grouped, recipe, device, dtype)
    extra = _extra(grouped, device)
    for _ in range(3):
        x, dy = (torch.randn(TOKENS, n, device=device, dtype=dtype) for n in (IN, OUT))
        results = []
        for layer, wrap in ((ckpt, True), (plain, False)):
            layer.weight.grad = layer.bias.grad = None
            xg = x.clone().requires_grad_(True)
            _restart_rng(device)
            y = checkpoint(layer, xg, *extra, use_reentrant=reentrant) if wrap else layer(xg, *extra)
            y.backward(dy)
            results.append((y, xg.grad, layer.weight.grad, layer.bias.grad))
        for got, want in zip(results[0][:3], results[1][:3]):
            assert torch.equal(got, want)
        assert_same_bias_gradient(results[0][3], results[1][3], grouped)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_two_calls_before_one_backward(grouped, recipe):
    check_two_calls_before_one_backward(grouped, recipe, "cpu")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_activation_checkpointing(grouped, recipe, reentrant):
    check_activation_checkpointing(grouped, recipe, reentrant, "cpu")
