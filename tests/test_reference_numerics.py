"""Reference numerics against facts of the NVFP4 specification (docs/numerics.md) and against float64 arithmetic."""
import math

import pytest
import torch

import fp4gen
from fp4gen import reference

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_rounding_ties_and_saturation():
    # spec 1.1: ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; saturation to 6
    y = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e30, float("inf")])
    expect = [0x0, 0x1, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x7, 0x7, 0x7]
    assert reference.e2m1_encode(y).tolist() == expect


def test_e2m1_sign_and_special_values():
    y = torch.tensor([-0.1, -0.0, -6.0, -float("inf"), float("nan"), -3.0])
    # negative values that round to zero keep the sign (0x8); -0.0 is not < 0 (code 0); NaN -> +6
    assert reference.e2m1_encode(y).tolist() == [0x8, 0x0, 0xF, 0xF, 0x7, 0xD]


def test_global_encode_scale_special_cases():
    amax = torch.tensor([0.0, float("inf"), 1e-45, 2688.0, 1.0])
    s = reference.global_encode_scale(amax)
    assert s[0] == 1.0 and s[1] == 1.0  # amax 0 and +Inf give 1
    assert s[2] == torch.finfo(torch.float32).max  # tiny amax overflows, capped at FLT_MAX
    assert s[3] == 1.0 and s[4] == 2688.0


def test_dequantize_follows_spec_formula():
    # codes 2 (1.0) and 7 (6.0) in one byte; scale 2.0; amax 1344: fs = fl(fl(2*1344) * fl(1/2688)) = 1
    data = torch.full((1, 8), 0x72, dtype=torch.uint8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = fp4gen.dequantize(fp4gen.NVFP4Data(data, scale, torch.tensor([1344.0])), dtype=torch.float32)
    assert out[0, :2].tolist() == [1.0, 6.0]
    # per-row amax: row 1 uses its own amax
    data2 = torch.full((2, 8), 0x72, dtype=torch.uint8)
    scale2 = torch.tensor([[2.0], [2.0]]).to(torch.float8_e4m3fn)
    out2 = fp4gen.dequantize(fp4gen.NVFP4Data(data2, scale2, torch.tensor([1344.0, 2688.0])), torch.float32)
    assert out2[:, :2].tolist() == [[1.0, 6.0], [2.0, 12.0]]


@pytest.mark.parametrize("amax", [3.4028234663852886e38, 3.4028232635611926e38, 2.0e38, 1.0e37, 7.6e35])
def test_dequantize_stays_finite_where_the_true_value_is_finite(amax):
    # fl(sdec * amax) overflows for row 0 (scale 448), so upstream's order gives inf there; fp4gen takes that
    # block's factor as fl(fl(amax * fl(1/2688)) * sdec) instead. Row 1 (scale 1) keeps upstream's order.
    codes = torch.arange(16, dtype=torch.uint8)
    data = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8).repeat(2, 1)
    scale = torch.tensor([[448.0], [1.0]]).to(torch.float8_e4m3fn)
    op = fp4gen.NVFP4Data(data, scale, torch.tensor([amax, amax]))
    out = fp4gen.dequantize(op, dtype=torch.float32)
    assert torch.isfinite(out).all()
    values = torch.tensor(E2M1 + [-v for v in E2M1])
    a, f = torch.tensor(amax), torch.tensor(1.0) / torch.tensor(2688.0)
    assert torch.isinf(torch.tensor(448.0) * a)  # the case this test is about
    assert torch.equal(out[0], values * ((a * f) * torch.tensor(448.0)))
    assert torch.equal(out[1], values * ((torch.tensor(1.0) * a) * f))
    # close to the true value e2m1 * sdec * amax / 2688, computed in float64
    true = values.double() * 448.0 * amax / 2688.0
    assert torch.allclose(out[0].double(), true, rtol=3e-7, atol=0)
    # in a 16-bit output a value beyond the format's range is inf, as any cast gives
    assert torch.equal(fp4gen.dequantize(op, dtype=torch.bfloat16)[0], out[0].to(torch.bfloat16))


def test_dequantize_is_finite_for_every_scale_and_the_largest_amaxes():
    # the alternative order never overflows: all 126 finite nonzero E4M3 scales x the 4096 largest floats
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    top = (torch.tensor(0x7F7FFFFF, dtype=torch.int32) - torch.arange(4096, dtype=torch.int32)).view(torch.float32)
    amax = top.repeat_interleave(scales.numel())
    scale = scales.repeat(top.numel()).reshape(-1, 1).to(torch.float8_e4m3fn)
    data = torch.full((amax.numel(), 8), 0x77, dtype=torch.uint8)  # +6, the largest code, everywhere
    out = fp4gen.dequantize(fp4gen.NVFP4Data(data, scale, amax), dtype=torch.float32)
    assert torch.isfinite(out).all()


def test_dequantize_keeps_upstream_order_without_overflow():
    # amax 1e30 with scale 448: fl(448 * 1e30) is finite, so the factor is fl(fl(sdec * amax) * fl(1/2688))
    data = torch.full((1, 8), 0x72, dtype=torch.uint8)
    scale = torch.tensor([[448.0]]).to(torch.float8_e4m3fn)
    amax = torch.tensor([1e30])
    out = fp4gen.dequantize(fp4gen.NVFP4Data(data, scale, amax), dtype=torch.float32)
    f = torch.tensor(1.0) / torch.tensor(2688.0)
    factor = (torch.tensor(448.0) * amax[0]) * f
    assert out[0, 0] == factor and out[0, 1] == torch.tensor(6.0) * factor


def test_inf_amax_dequantizes_as_upstream():
    data = torch.full((1, 8), 0x72, dtype=torch.uint8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = fp4gen.dequantize(fp4gen.NVFP4Data(data, scale, torch.tensor([float("inf")])), dtype=torch.float32)
    assert torch.isinf(out[0, :2]).all()


def _dequantize_f64(op):
    """Independent float64 decode: e2m1 * scale * amax / 2688."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    codes = torch.stack((op.data & 0xF, op.data >> 4), -1).reshape(op.shape[0], -1).long()
    vals = lut[codes].reshape(op.shape[0], -1, 16) * op.scale.double().unsqueeze(-1)
    return vals.reshape(op.shape) * op.amax.double().reshape(-1, 1) / 2688.0


@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_roundtrip_error_is_nvfp4_sized(scaling, dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 128).to(dtype)
    q = fp4gen.quantize(x, scaling=scaling)
    for op, ref in ((q.rowwise, x), (q.columnwise, x.t())):
        y = fp4gen.dequantize(op, dtype=torch.float32)
        # the fp32 decode (fl(fl(s * amax) * fl(1/2688)), spec 2.4) is within a few ulps of exact
        exact = _dequantize_f64(op)
        assert ((y.double() - exact).abs() <= 4e-7 * exact.abs()).all()
        rel = (y - ref.float()).norm() / ref.float().norm()
        assert 0.05 < rel < 0.15  # 4-bit values: about 10% relative error, never exact, never wild


def test_row_scaled_columnwise_is_rowwise_of_transpose():
    torch.manual_seed(1)
    x = torch.randn(48, 96, dtype=torch.bfloat16) * torch.logspace(-3, 3, 96).to(torch.bfloat16)
    q = fp4gen.quantize(x, scaling="row")
    qt = fp4gen.quantize(x.t().contiguous(), scaling="row", columnwise=False)
    assert torch.equal(q.columnwise.data, qt.rowwise.data)
    assert torch.equal(q.columnwise.scale.view(torch.uint8), qt.rowwise.scale.view(torch.uint8))
    assert torch.equal(q.columnwise.amax, x.float().abs().amax(0))


def test_16x16_columnwise_is_transpose_of_rowwise():
    torch.manual_seed(2)
    x = torch.randn(32, 64)
    q = fp4gen.quantize(x, scaling="tensor", block=(16, 16))
    codes = reference.unpack_nibbles(q.rowwise.data)
    assert torch.equal(reference.unpack_nibbles(q.columnwise.data), codes.t())
    assert torch.equal(q.rowwise.scale.float()[::16, ::1].repeat_interleave(16, 0), q.rowwise.scale.float())


def test_nd_input_flattens_to_rows():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 16, 32)
    q = fp4gen.quantize(x)
    q2 = fp4gen.quantize(x.reshape(-1, 32))
    assert q.shape == (2, 3, 16, 32)
    assert torch.equal(q.rowwise.data, q2.rowwise.data) and torch.equal(q.columnwise.data, q2.columnwise.data)


def test_non_contiguous_input_gives_same_bytes():
    torch.manual_seed(4)
    x = torch.randn(64, 32)
    q = fp4gen.quantize(x.t())  # a transposed view [32, 64]
    q2 = fp4gen.quantize(x.t().contiguous())
    assert torch.equal(q.rowwise.data, q2.rowwise.data) and torch.equal(q.rowwise.amax, q2.rowwise.amax)


def test_nan_propagates_to_its_row_and_column_only():
    torch.manual_seed(5)
    x = torch.randn(32, 64)
    x[3, 17] = float("nan")
    q = fp4gen.quantize(x, scaling="row")
    amax_r, amax_c = q.rowwise.amax, q.columnwise.amax
    assert torch.isnan(amax_r[3]) and not torch.isnan(amax_r[torch.arange(32) != 3]).any()
    assert torch.isnan(amax_c[17]) and not torch.isnan(amax_c[torch.arange(64) != 17]).any()
    y = fp4gen.dequantize(q.rowwise, torch.float32)
    assert torch.isnan(y[3]).all() and not torch.isnan(y[torch.arange(32) != 3]).any()
    # the other rows are quantized exactly as if the NaN row were absent
    clean = fp4gen.quantize(x[4:20], scaling="row", columnwise=False)
    assert torch.equal(q.rowwise.data[4:20], clean.rowwise.data)


def test_nan_makes_tensor_amax_nan():
    x = torch.randn(16, 32)
    x[0, 0] = float("nan")
    q = fp4gen.quantize(x, scaling="tensor")
    assert torch.isnan(q.rowwise.amax).all() and torch.isnan(q.columnwise.amax).all()
    assert torch.isnan(fp4gen.dequantize(q.rowwise, torch.float32)).all()


def test_inf_follows_upstream():
    x = torch.ones(16, 16)
    x[0, 5] = float("inf")
    q = fp4gen.quantize(x, scaling="tensor", columnwise=False)
    assert q.rowwise.amax.item() == math.inf
    codes = reference.unpack_nibbles(q.rowwise.data)
    assert codes[0, 5] == 0x7  # the Inf element saturates to +6
    assert q.rowwise.scale.float()[0, 0] == 448.0  # E4M3(min(Inf, FLT_MAX)) = 448
    # with S_enc = 1 the other elements of the Inf block are scaled by 1/448 and round to 0
    assert codes[0, 0] == 0
    # row 1 has no Inf: S_enc = 1, scale E4M3(1/6) = 0.171875, so 1.0 encodes as 5.82 -> code 0x7
    assert q.rowwise.scale.float()[1, 0] == 0.171875 and codes[1, 0] == 0x7


def test_empty_input():
    q = fp4gen.quantize(torch.zeros(0, 32), scaling="row", columnwise=True)
    assert q.rowwise.data.shape == (0, 16) and q.rowwise.amax.shape == (0,)
    assert q.columnwise.data.shape == (32, 0) and q.columnwise.amax.tolist() == [0.0] * 32
    q = fp4gen.quantize(torch.zeros(2, 16, 0), scaling="tensor")  # K = 0
    assert q.rowwise.data.shape == (32, 0) and q.rowwise.amax.tolist() == [0.0]
    assert q.columnwise.data.shape == (0, 16)


def _random_operand(rows, cols, row_scaled, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 10
    return fp4gen.quantize(x, scaling="row" if row_scaled else "tensor", columnwise=False).rowwise


@pytest.mark.parametrize("a_rows,b_rows", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-6)])
@pytest.mark.parametrize("m,n,k", [(1, 7, 16), (33, 17, 80), (128, 96, 256)])
def test_gemm_matches_float64_product_of_dequantized(a_rows, b_rows, out_dtype, tol, m, n, k):
    a = _random_operand(m, k, a_rows, 10 + m)
    b = _random_operand(n, k, b_rows, 20 + n)
    ref = _dequantize_f64(a) @ _dequantize_f64(b).t()
    d = fp4gen.gemm(a, b, out_dtype=out_dtype)
    assert d.dtype == out_dtype and d.shape == (m, n)
    assert (d.double() - ref).norm() / ref.norm() < tol


def test_gemm_accumulate_adds_into_out():
    a = _random_operand(32, 64, True, 1)
    b = _random_operand(48, 64, False, 2)
    base = torch.randn(32, 48)
    out = base.clone()
    res = fp4gen.gemm(a, b, out=out, accumulate=True)
    assert res is out
    ref = _dequantize_f64(a) @ _dequantize_f64(b).t() + base.double()
    assert (out.double() - ref).norm() / ref.norm() < 1e-6


def test_gemm_nan_row_stays_nan():
    x = torch.randn(16, 32)
    x[2, 0] = float("nan")
    a = fp4gen.quantize(x, scaling="row", columnwise=False).rowwise
    b = _random_operand(8, 32, False, 3)
    d = fp4gen.gemm(a, b, out_dtype=torch.float32)
    assert torch.isnan(d[2]).all() and not torch.isnan(d[torch.arange(16) != 2]).any()


def test_gemm_bias_is_added_in_fp32_before_the_one_rounding():
    torch.manual_seed(3)
    a = fp4gen.quantize(torch.randn(8, 64), scaling="row", columnwise=False).rowwise
    b = fp4gen.quantize(torch.randn(24, 64), scaling="tensor", columnwise=False).rowwise
    bias = torch.randn(24)
    plain = fp4gen.gemm(a, b, out_dtype=torch.float32)
    with_bias = fp4gen.gemm(a, b, out_dtype=torch.float32, bias=bias)
    assert torch.equal(with_bias, plain + bias)  # one fp32 addition
    rounded = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, bias=bias.bfloat16())
    assert torch.equal(rounded, (plain + bias.bfloat16().float()).bfloat16())
    out = torch.randn(8, 24)
    expected = (out + (plain + bias)).clone()
    assert torch.equal(fp4gen.gemm(a, b, out=out, accumulate=True, bias=bias), expected)
    with pytest.raises(ValueError, match=r"bias has shape \(23,\); for b \[24, 64\] it must be \[24\]"):
        fp4gen.gemm(a, b, bias=bias[:23])
    with pytest.raises(TypeError, match="bias.dtype is torch.int64"):
        fp4gen.gemm(a, b, bias=torch.zeros(24, dtype=torch.int64))
