"""Repeated training steps give the same bits: fp4gen's kernels add in a fixed order (no atomics; split-K partial
sums in split order), so a Linear step repeats bit for bit as it is, and so does a bf16 or fp16 GroupedLinear step
(its bias gradient is one GEMM). An fp32 GroupedLinear sums its bias gradient with PyTorch's index_add_, whose
fp32 additions on CUDA run in no fixed order unless torch.use_deterministic_algorithms(True) is set; with it, that
step repeats bit for bit as well (and nothing fp4gen runs refuses that mode)."""
import pytest
import torch

import fp4gen
from conftest import group_ends

pytestmark = pytest.mark.gpu

TOKENS, IN, OUT = 4000, 256, 512  # enough rows per expert for the unordered fp32 sums to differ between runs
SIZES = [0, 3000, 13, 987]


def _steps(layer, x, dy, *extra):
    """Y, dX, dW, db of two training steps, each after restarting the random state (stochastic rounding)."""
    results = []
    for _ in range(2):
        fp4gen.RNGState.default("cuda").reset(0)
        layer.weight.grad = layer.bias.grad = None
        xg = x.clone().requires_grad_(True)
        layer(xg, *extra).backward(dy)
        results.append([xg.grad, layer.weight.grad, layer.bias.grad])
    return results


def _layer_and_inputs(grouped, dtype):
    torch.manual_seed(12)
    recipe = fp4gen.Recipe(stochastic_rounding=True)
    layer = (fp4gen.nn.GroupedLinear(len(SIZES), IN, OUT, bias=True, recipe=recipe, device="cuda", dtype=dtype)
             if grouped else fp4gen.nn.Linear(IN, OUT, recipe=recipe, device="cuda", dtype=dtype))
    x = torch.randn(TOKENS, IN, device="cuda", dtype=dtype)
    dy = torch.randn(TOKENS, OUT, device="cuda", dtype=dtype)
    extra = (torch.tensor(group_ends(SIZES), device="cuda"),) if grouped else ()
    return layer, x, dy, extra


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_linear_step_repeats_bit_for_bit(dtype):
    layer, x, dy, extra = _layer_and_inputs(False, dtype)
    first, second = _steps(layer, x, dy, *extra)
    for got, want in zip(first, second):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_grouped_step_repeats_bit_for_bit(dtype):
    # a 16-bit layer sums its bias gradient with one GEMM (a fixed order); an fp32 one with index_add_ (none)
    layer, x, dy, extra = _layer_and_inputs(True, dtype)
    first, second = _steps(layer, x, dy, *extra)
    compared = 2 if dtype == torch.float32 else 3
    for got, want in zip(first[:compared], second[:compared]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_a_step_repeats_bit_for_bit_under_deterministic_algorithms(grouped, dtype):
    layer, x, dy, extra = _layer_and_inputs(grouped, dtype)
    torch.use_deterministic_algorithms(True)
    try:
        first, second = _steps(layer, x, dy, *extra)
    finally:
        torch.use_deterministic_algorithms(False)
    for got, want in zip(first, second):
        assert torch.equal(got, want)
