"""fp4gen.grouped_gemm on the CUDA backend against a float64 reference of the dequantized operands (through
the reference backend), for fprop, dgrad and wgrad over uniform, skewed, empty and single-group routings and
every scale combination; plus accumulation, bias, NaN, CUDA-graph replay under new routing and no host
synchronization."""
import pytest
import torch

import fp4gen
from conftest import group_ends, relative_error, run_without_host_sync

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["tma cooperative", "tma pingpong", "wgmma"])
def family(request, monkeypatch):
    """Every test runs once on each grouped GEMM family (gemm_grouped_tma in each of its schedules,
    gemm_grouped_wgmma), whatever the dispatcher's rule would take for its shapes."""
    from fp4gen.cuda import grouped
    threshold = float("inf") if request.param == "wgmma" else 0
    monkeypatch.setattr(grouped, "TMA_MIN_ROWS_PER_GROUP", {"along M": threshold, "along K": threshold})
    if request.param != "wgmma":
        values = grouped.TMA_PINGPONG if request.param == "tma pingpong" else grouped.TMA_COOPERATIVE
        monkeypatch.setattr(grouped, "tma_variant", lambda rows_per_group, along_k: values)
    return request.param

ROUTINGS = {
    "uniform": [64, 64, 64, 64],
    "skewed": [0, 3, 0, 150, 17, 0, 1, 21],
    "one-takes-all": [0, 0, 197, 0],
    "single": [77],
    "tiny-groups": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
}


def operands(routing, k=192, n=128, x_scaling="row", w_block=(16, 16), seed=0):
    torch.manual_seed(seed)
    sizes = ROUTINGS[routing]
    ends = group_ends(sizes)
    t, e = ends[-1], len(sizes)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * torch.rand(t, 1, device="cuda") * 3
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * torch.rand(e, 1, 1, device="cuda")
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(ends, device="cuda")
    gx = fp4gen.quantize_grouped(x, offsets, scaling=x_scaling, hadamard=True)
    gw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=w_block)
    gdy = fp4gen.quantize_grouped(dy, offsets, scaling="tensor", hadamard=True)
    return offsets, gx, gw, gdy


def on_cpu(copy: fp4gen.GroupedNVFP4Data) -> fp4gen.GroupedNVFP4Data:
    move = (lambda t: None if t is None else t.cpu())
    return fp4gen.GroupedNVFP4Data(copy.data.cpu(), copy.scale.cpu(), copy.amax.cpu(), copy.layout, copy.row_scaled,
                                   move(copy.offsets), move(copy.padded_offsets), copy.e4m3_max)


def check(a, b, offsets, out_dtype, **kwargs):
    got = fp4gen.grouped_gemm(a, b, offsets, out_dtype=out_dtype, **kwargs)
    cpu_kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    want = fp4gen.grouped_gemm(on_cpu(a), on_cpu(b), offsets.cpu(), out_dtype=torch.float32, backend="reference",
                               **cpu_kwargs)
    assert got.shape == want.shape and got.dtype == out_dtype
    assert torch.isfinite(got).all()
    tolerance = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
    assert relative_error(got, want) < tolerance
    return got, want


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("x_scaling", ["row", "tensor"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fprop_dgrad_wgrad_equal_reference(routing, x_scaling, out_dtype):
    offsets, gx, gw, gdy = operands(routing, x_scaling=x_scaling)
    check(gx.rowwise, gw.rowwise, offsets, out_dtype)  # fprop: X W_g^T
    check(gdy.rowwise, gw.columnwise, offsets, out_dtype)  # dgrad: dY W_g
    got, _ = check(gdy.columnwise, gx.columnwise, offsets, out_dtype)  # wgrad: dY_g^T X_g
    for g, size in enumerate(ROUTINGS[routing]):
        if size == 0:
            assert not got[g].any(), "an expert without tokens gets a zero gradient"


@pytest.mark.parametrize("w_block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("k,n", [(64, 64), (320, 208), (1024, 96), (4160, 80)])
def test_shapes_and_weight_blocks(w_block, k, n):
    """k = 4160: rows of 260 blocks, which the fp16 copies split between two CTAs."""
    offsets, gx, gw, gdy = operands("skewed", k=k, n=n, w_block=w_block, seed=1)
    check(gx.rowwise, gw.rowwise, offsets, torch.bfloat16)
    check(gdy.columnwise, gx.columnwise, offsets, torch.float32)


def test_row_scaled_gradients_and_stacked_row_scaled_weights():
    torch.manual_seed(2)
    ends = group_ends(ROUTINGS["skewed"])
    offsets = torch.tensor(ends, device="cuda")
    x = torch.randn(ends[-1], 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(ends[-1], 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(ends), 64, 128, device="cuda", dtype=torch.bfloat16)
    gx = fp4gen.quantize_grouped(x, offsets, scaling="row")
    gdy = fp4gen.quantize_grouped(dy, offsets, scaling="row")
    gw = fp4gen.quantize_grouped(w, None, scaling="row")
    check(gx.rowwise, gw.rowwise, offsets, torch.bfloat16)
    check(gdy.columnwise, gx.columnwise, offsets, torch.float32)


def test_wgrad_accumulates_into_main_grad_and_fprop_adds_bias():
    offsets, gx, gw, gdy = operands("skewed", seed=3)
    e, n, k = gw.rowwise.data.shape[0], gw.rowwise.data.shape[1], 2 * gw.rowwise.data.shape[2]
    main_grad = torch.randn(e, n, k, device="cuda")
    before = main_grad.clone()
    got = fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, offsets, out=main_grad, accumulate=True)
    assert got is main_grad
    want = fp4gen.grouped_gemm(on_cpu(gdy.columnwise), on_cpu(gx.columnwise), offsets.cpu(), out_dtype=torch.float32,
                               backend="reference")
    assert relative_error(main_grad - before, want) < 1e-5
    assert torch.equal(main_grad[0], before[0]) and torch.equal(main_grad[2], before[2])  # empty experts
    bias = torch.randn(e, n, device="cuda")
    check(gx.rowwise, gw.rowwise, offsets, torch.bfloat16, bias=bias)


def test_nan_token_stays_in_its_rows_and_expert():
    torch.manual_seed(4)
    ends = group_ends([20, 30, 14])
    offsets = torch.tensor(ends, device="cuda")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    x[25, 3] = float("nan")
    w = torch.randn(3, 64, 128, device="cuda", dtype=torch.bfloat16)
    gx = fp4gen.quantize_grouped(x, offsets, scaling="row")
    gw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16))
    y = fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, offsets).cpu()
    assert torch.isnan(y[25]).all() and not torch.isnan(y[:25]).any() and not torch.isnan(y[26:]).any()
    dy = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    gdy = fp4gen.quantize_grouped(dy, offsets, scaling="tensor")
    dw = fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, offsets, out_dtype=torch.float32).cpu()
    assert torch.isnan(dw[1]).any() and not torch.isnan(dw[0]).any() and not torch.isnan(dw[2]).any()


def test_no_host_synchronization_and_graph_replay_under_new_routing():
    torch.manual_seed(5)
    t, k, n, e = 128, 128, 64, 4
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(group_ends([32, 32, 32, 32]), device="cuda")
    gw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16))

    def step():
        gx = fp4gen.quantize_grouped(x, offsets, hadamard=True)
        gdy = fp4gen.quantize_grouped(dy, offsets, scaling="tensor", hadamard=True)
        return (fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, offsets),
                fp4gen.grouped_gemm(gdy.rowwise, gw.columnwise, offsets),
                fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, offsets, out_dtype=torch.float32))

    run_without_host_sync(step)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = step()
    for sizes in ([128, 0, 0, 0], [1, 2, 3, 122], [0, 50, 0, 78], [40, 17, 39, 32]):
        offsets.copy_(torch.tensor(group_ends(sizes)))
        graph.replay()
        torch.cuda.synchronize()
        want = [t.clone() for t in step()]  # eager with the same routing
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref), sizes
