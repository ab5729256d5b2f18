"""The generated dequantize kernels on a CUDA device equal the reference backend element for element."""
import pytest
import torch

import fp4gen

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _random_operand(rows, cols, row_scaled, seed, device="cuda", special_amax=True):
    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, device=device, generator=g)
    scale = torch.randint(0, 256, (rows, cols // 16), dtype=torch.uint8, device=device, generator=g)
    amax = torch.rand(rows if row_scaled else 1, device=device, generator=g) * 1000
    if special_amax and amax.numel() > 4:
        amax[:4] = torch.tensor([0.0, float("inf"), float("nan"), 1e-30], device=device)
    return fp4gen.NVFP4Data(data, scale.view(torch.float8_e4m3fn), amax)


def assert_same(out, ref):
    """Bitwise equal, except that NaN only has to be NaN at the same places (payloads may differ)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    bits = {2: torch.int16, 4: torch.int32}[out.element_size()]
    assert torch.equal(out[~nan].view(bits), ref[~nan].view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_scaled", [True, False])
@pytest.mark.parametrize("rows,cols", [(1, 16), (17, 48), (256, 16), (1000, 4096), (4099, 80)])
def test_dequantize_equals_reference_on_random_bytes(dtype, row_scaled, rows, cols):
    # every data byte and every scale byte (NaN 0x7F/0xFF, subnormals) occurs; amax 0, Inf, NaN, tiny
    op = _random_operand(rows, cols, row_scaled, seed=rows * cols)
    assert_same(fp4gen.dequantize(op, dtype), fp4gen.dequantize(op, dtype, backend="reference"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling,block", [("row", (1, 16)), ("tensor", (1, 16)), ("tensor", (16, 16))])
def test_dequantize_of_real_quantized_tensors(dtype, scaling, block):
    torch.manual_seed(0)
    x = torch.randn(512, 768, device="cuda") * torch.logspace(-4, 4, 768, device="cuda")
    q = fp4gen.quantize(x.to(torch.bfloat16), scaling=scaling, block=block, backend="reference")
    for op in (q.rowwise, q.columnwise):
        out = fp4gen.dequantize(op, dtype)
        assert_same(out, fp4gen.dequantize(op, dtype, backend="reference"))


def test_dequantize_row_strided_operand():
    # a view of every other row: row strides larger than the row, still aligned
    big = _random_operand(64, 128, True, seed=1)
    op = fp4gen.NVFP4Data(big.data[::2], big.scale[::2], big.amax[::2].clone())
    assert op.data.stride(0) == 128
    assert_same(fp4gen.dequantize(op, torch.bfloat16), fp4gen.dequantize(op, torch.bfloat16, backend="reference"))


def test_misaligned_data_is_a_clear_error():
    big = _random_operand(16, 64, False, seed=2)
    flat = torch.zeros(16 * 32 + 16, dtype=torch.uint8, device="cuda")
    shifted = flat[1:1 + 16 * 32].view(16, 32)  # base address off by one byte
    op = fp4gen.NVFP4Data(shifted, big.scale, big.amax)
    with pytest.raises(ValueError, match="4-byte aligned"):
        fp4gen.dequantize(op, torch.bfloat16)


def test_empty_operand():
    op = fp4gen.NVFP4Data(torch.empty(0, 8, dtype=torch.uint8, device="cuda"),
                          torch.empty(0, 1, dtype=torch.float8_e4m3fn, device="cuda"),
                          torch.ones(1, device="cuda"))
    assert fp4gen.dequantize(op, torch.float32).shape == (0, 16)


def test_more_than_2_pow_31_elements():
    rows, cols = (1 << 17) + 3, 1 << 14  # 2^31 + 3 * 2^14 elements: indices past int32
    op = _random_operand(rows, cols, True, seed=3, special_amax=False)
    out = fp4gen.dequantize(op, torch.bfloat16)
    for r0 in (0, rows - 5):  # first rows and the rows past element 2^31
        part = fp4gen.NVFP4Data(op.data[r0:r0 + 5], op.scale[r0:r0 + 5], op.amax[r0:r0 + 5])
        assert_same(out[r0:r0 + 5], fp4gen.dequantize(part, torch.bfloat16, backend="reference"))


def test_cuda_graph_capture_and_replay_with_new_input():
    op = _random_operand(256, 512, True, seed=4)
    static = fp4gen.NVFP4Data(op.data.clone(), op.scale.clone(), op.amax.clone())
    fp4gen.dequantize(static, torch.bfloat16)  # warm up (loads the library) outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = fp4gen.dequantize(static, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (5, 6):
        new = _random_operand(256, 512, True, seed=seed)
        static.data.copy_(new.data), static.scale.copy_(new.scale), static.amax.copy_(new.amax)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, fp4gen.dequantize(new, torch.bfloat16, backend="reference"))


def test_two_streams_at_once():
    ops = [_random_operand(2048, 4096, True, seed=s) for s in (7, 8)]
    streams = [torch.cuda.Stream() for _ in ops]
    outs = []
    torch.cuda.synchronize()
    for op, stream in zip(ops, streams):
        with torch.cuda.stream(stream):
            outs.append(fp4gen.dequantize(op, torch.float32))
    torch.cuda.synchronize()
    for op, out in zip(ops, outs):
        assert_same(out, fp4gen.dequantize(op, torch.float32, backend="reference"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_scaled", [True, False])
def test_dequantize_near_flt_max_stays_finite_and_equals_reference(dtype, row_scaled):
    # amaxes where fl(sdec * amax) overflows for the larger scales: both backends take the float64 path there
    op = _random_operand(512, 256, row_scaled, seed=7, special_amax=False)
    g = torch.Generator(device="cuda").manual_seed(8)
    amax = 3.4028234663852886e38 * (1 - torch.rand(op.amax.shape, device="cuda", generator=g) * 0.999)
    op = fp4gen.NVFP4Data(op.data, op.scale, amax)
    out = fp4gen.dequantize(op, dtype)
    assert_same(out, fp4gen.dequantize(op, dtype, backend="reference"))
    if dtype == torch.float32:  # finite wherever the scale byte is not NaN
        finite_scale = ~torch.isnan(op.scale.float()).repeat_interleave(16, dim=1)
        assert torch.isfinite(out[finite_scale]).all()
