"""Column sums from the amax pass (a gradient's bias gradient, db = dY summed over rows): on every tensor-scaled
path (the amax pass, the Hadamard amax pass, the option kernels' amax passes), against a float64 sum; in x's own
dtype, the fp32 sums rounded once (as torch's conversion rounds them), bit for bit."""
import pytest
import torch

import fp4gen
from fp4gen.api import quantize_checked
from fp4gen.options import QuantizeOptions

pytestmark = pytest.mark.gpu

# (label, dtype, options, block): the amax pass (to nearest; stochastic rounding), the transform's amax pass
# (tensor kernel, 16-bit and fp32: fp32 takes the option kernels), 16x16 blocks, fp32 through the amax pass
PATHS = [
    ("amax", torch.bfloat16, dict(), (1, 16)),
    ("amax fp16", torch.float16, dict(), (1, 16)),
    ("amax sr", torch.bfloat16, dict(rounding="stochastic"), (1, 16)),
    ("amax 16x16", torch.bfloat16, dict(), (16, 16)),
    ("amax fp32 sr", torch.float32, dict(rounding="stochastic"), (1, 16)),
    ("hadamard", torch.bfloat16, dict(hadamard=True), (1, 16)),
    ("hadamard sr", torch.bfloat16, dict(hadamard=True, rounding="stochastic"), (1, 16)),
    ("hadamard fp32", torch.float32, dict(hadamard=True), (1, 16)),
]


def _options(kw: dict, device) -> QuantizeOptions:
    rng = fp4gen.RNGState(3, device=device) if kw.get("rounding") == "stochastic" else None
    return QuantizeOptions(kw.get("rounding", "nearest"), rng, kw.get("hadamard", False), None)


def _quantize(x, kw, block, column_sums):
    return quantize_checked(x, "tensor", block, True, True, _options(kw, x.device), column_sums=column_sums)


def _assert_sums_close(got: torch.Tensor, x: torch.Tensor):
    # fp32 accumulation of n terms: within n * 2^-24 * sum|x| of the exact sum (leaving out one 64-row slice
    # would be off by about 8 here)
    exact = x.double().sum(0)
    bound = x.shape[0] * 2.0**-24 * x.double().abs().sum(0) + 1e-30
    assert got.dtype == torch.float32 and got.shape == (x.shape[1],)
    assert torch.all((got.double() - exact).abs() <= bound), (got.double() - exact).abs().max().item()


@pytest.mark.parametrize("label,dtype,kw,block", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("rows,cols", [(16, 16), (80, 272), (1008, 4112), (4096, 2048)])
def test_column_sums_match_float64_and_leave_the_copies_alone(label, dtype, kw, block, rows, cols):
    torch.manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda").to(dtype)
    row, col, sums = _quantize(x, kw, block, torch.float32)
    _assert_sums_close(sums, x)
    plain_row, plain_col = _quantize(x, kw, block, None)  # same random state: the same bytes
    for got, want in ((row, plain_row), (col, plain_col)):
        assert torch.equal(got.data, want.data) and torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
        assert torch.equal(got.amax, want.amax)
    again = _quantize(x, kw, block, torch.float32)[2]
    assert torch.equal(again.view(torch.int32), sums.view(torch.int32)), "column sums must not depend on timing"
    in_x_dtype = _quantize(x, kw, block, dtype)
    _assert_same_bits(in_x_dtype[2], sums.to(dtype))
    assert torch.equal(in_x_dtype[0].data, row.data) and torch.equal(in_x_dtype[1].data, col.data)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = torch.int32 if got.element_size() == 4 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("label,dtype,kw,block", PATHS, ids=[p[0] for p in PATHS])
def test_column_sums_propagate_nan_and_of_no_rows_are_zero(label, dtype, kw, block):
    x = torch.randn(64, 160, device="cuda").to(dtype)
    x[5, 17] = float("nan")
    sums = _quantize(x, kw, block, torch.float32)[2]
    assert torch.isnan(sums[17]) and torch.isfinite(torch.cat([sums[:17], sums[18:]])).all()
    _assert_same_bits(_quantize(x, kw, block, dtype)[2], sums.to(dtype))  # NaN's bits too
    empty = torch.empty(0, 160, device="cuda", dtype=dtype)
    for sums_dtype in (torch.float32, dtype):
        _assert_same_bits(_quantize(empty, kw, block, sums_dtype)[2], torch.zeros(160, device="cuda", dtype=sums_dtype))


def test_column_sums_in_x_dtype_round_to_nearest_even_and_overflow_as_torch():
    # fp32 sums between two values of x's dtype, on ties (to even), and past fp16's largest finite value: the same
    # bits as torch's conversion of the fp32 sums
    cols = 64
    j = torch.arange(cols, device="cuda", dtype=torch.float32)
    for dtype, base, step in ((torch.bfloat16, 1.0, 2.0**-9), (torch.float16, 1024.0, 0.25)):
        x = torch.zeros(32, cols, device="cuda", dtype=torch.float32)
        x[0], x[1] = base, j * step  # x's dtype steps by 4 * step at base: j % 4 == 2 are ties
        if dtype == torch.float16:
            x[2:4, -8:] = 40000.0  # 80000 (and more): infinity in fp16
        x = x.to(dtype)
        fp32 = _quantize(x, {}, (1, 16), torch.float32)[2]
        assert torch.equal(fp32[:cols - 8], base + j[:cols - 8] * step)  # exact in fp32
        _assert_same_bits(_quantize(x, {}, (1, 16), dtype)[2], fp32.to(dtype))
        if dtype == torch.float16:
            assert torch.isinf(fp32.to(dtype)[-8:]).all()


def test_column_sums_need_tensor_scaling():
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tensor scaling"):
        quantize_checked(x, "row", (1, 16), True, True, QuantizeOptions(), column_sums=torch.float32)
    with pytest.raises(ValueError, match="neither torch.float32 nor"):
        quantize_checked(x, "tensor", (1, 16), True, True, QuantizeOptions(), column_sums=torch.float16)


@pytest.mark.parametrize("gradient_scaling", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_bias_gradient(gradient_scaling, dtype):
    # tensor-scaled gradients take db from dY's amax pass, row-scaled ones from a sum of their own: either way
    # dY summed over the tokens, rounded once to the bias's dtype
    torch.manual_seed(0)
    recipe = fp4gen.Recipe(gradient_scaling=gradient_scaling)
    layer = fp4gen.nn.Linear(256, 192, bias=True, recipe=recipe, device="cuda", dtype=dtype)
    x = torch.randn(1008, 256, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(1008, 192, device="cuda", dtype=dtype)
    layer(x).backward(dy)
    exact = dy.double().sum(0)
    bound = 1008 * 2.0**-24 * dy.double().abs().sum(0) + exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 0)
    assert layer.bias.grad.dtype == dtype
    assert torch.all((layer.bias.grad.double() - exact).abs() <= bound)
