"""fp4gen.gemm on the H200 against a float64 product of the dequantized operands."""
import json

import pytest
import torch

import fp4gen
from conftest import dequantize_f64

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def rule_choices(monkeypatch):
    """These tests check the deterministic rule's choices (and force kernels): no measured choices."""
    from fp4gen.cuda import ops
    monkeypatch.setenv("FP4GEN_AUTOTUNE", "0")
    monkeypatch.setattr(ops, "_GEMM_PLANS", {})


def rel_err(d, ref):
    return ((d.double() - ref).norm() / ref.norm()).item()


def operand(rows, k, row_scaled, seed, direction="rowwise"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g) * torch.rand(rows, 1, device="cuda", generator=g) * 10
    if direction == "rowwise":
        return fp4gen.quantize(x.bfloat16(), scaling="row" if row_scaled else "tensor", columnwise=False).rowwise
    # the columnwise copy of x.T [k, rows] is an operand with `rows` rows too
    return fp4gen.quantize(x.t().contiguous().bfloat16(), scaling="row" if row_scaled else "tensor",
                           rowwise=False).columnwise


SCALES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("a_row,b_row", SCALES)
@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("m,n,k", [(1, 256, 128), (16, 1000, 512), (100, 264, 64), (128, 512, 256),
                                   (1000, 1000, 1024), (4100, 3000, 2048), (333, 17, 48), (16384, 512, 256)])
def test_gemm_matches_float64(a_row, b_row, out_dtype, tol, m, n, k):
    a, b = operand(m, k, a_row, m + k), operand(n, k, b_row, n + 7)
    d = fp4gen.gemm(a, b, out_dtype=out_dtype)
    assert d.shape == (m, n) and d.dtype == out_dtype
    assert rel_err(d, dequantize_f64(a) @ dequantize_f64(b).t()) < tol


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_accumulate_into_out(out_dtype):
    a, b = operand(256, 512, True, 1), operand(384, 512, False, 2)
    base = torch.randn(256, 384, device="cuda").to(out_dtype)
    out = base.clone()
    assert fp4gen.gemm(a, b, out=out, accumulate=True) is out
    ref = dequantize_f64(a) @ dequantize_f64(b).t() + base.double()
    assert rel_err(out, ref) < (1e-2 if out_dtype == torch.bfloat16 else 1e-5)


def test_gemm_into_unaligned_out_and_tail_n():
    a, b = operand(64, 128, True, 3), operand(37, 128, True, 4)
    out = torch.full((64, 37), float("nan"), device="cuda")  # row stride 37: not 16-byte aligned
    fp4gen.gemm(a, b, out=out)
    assert not torch.isnan(out).any()
    assert rel_err(out, dequantize_f64(a) @ dequantize_f64(b).t()) < 1e-5


def test_training_gemms_from_both_quantize_directions():
    # the training GEMMs: fprop X W^T, dgrad dY W, wgrad dY^T X with real quantize outputs
    torch.manual_seed(0)
    m, k, n = 512, 384, 256  # tokens, in features, out features
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    qx = fp4gen.quantize(x, scaling="row")
    qw = fp4gen.quantize(w, scaling="tensor", block=(16, 16))
    qdy = fp4gen.quantize(dy, scaling="tensor")
    for a, b in ((qx.rowwise, qw.rowwise), (qdy.rowwise, qw.columnwise), (qdy.columnwise, qx.columnwise)):
        d = fp4gen.gemm(a, b, out_dtype=torch.float32)
        assert rel_err(d, dequantize_f64(a) @ dequantize_f64(b).t()) < 1e-5
    wgrad = fp4gen.gemm(qdy.columnwise, qx.columnwise, out_dtype=torch.float32)
    assert wgrad.shape == (n, k)
    exact = dy.double().t() @ x.double()
    assert rel_err(wgrad, exact) < 0.2  # NVFP4 noise on both operands, but the right product


def test_gemm_equals_reference_backend_closely():
    a, b = operand(200, 256, True, 5), operand(300, 256, True, 6)
    d = fp4gen.gemm(a, b, out_dtype=torch.float32)
    ref = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="reference")
    assert rel_err(d, ref.double()) < 1e-6


def test_gemm_nan_row_stays_nan():
    x = torch.randn(64, 128, device="cuda")
    x[5, 3] = float("nan")
    a = fp4gen.quantize(x, scaling="row", columnwise=False).rowwise
    b = operand(64, 128, False, 7)
    d = fp4gen.gemm(a, b, out_dtype=torch.float32)
    assert torch.isnan(d[5]).all() and not torch.isnan(d[torch.arange(64, device="cuda") != 5]).any()


def test_gemm_cuda_graph_and_two_streams():
    a, b = operand(256, 512, True, 8), operand(512, 512, False, 9)
    static_a = fp4gen.NVFP4Data(a.data.clone(), a.scale.clone(), a.amax.clone())
    fp4gen.gemm(static_a, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        d = fp4gen.gemm(static_a, b, out_dtype=torch.float32)
    torch.cuda.current_stream().wait_stream(stream)
    new = operand(256, 512, True, 10)
    static_a.data.copy_(new.data), static_a.scale.copy_(new.scale), static_a.amax.copy_(new.amax)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(d, dequantize_f64(new) @ dequantize_f64(b).t()) < 1e-5
    pairs = [(operand(512, 1024, True, s), operand(768, 1024, True, s + 1)) for s in (11, 13)]
    streams = [torch.cuda.Stream() for _ in pairs]
    torch.cuda.synchronize()
    outs = []
    for (a_, b_), st in zip(pairs, streams):
        with torch.cuda.stream(st):
            outs.append(fp4gen.gemm(a_, b_, out_dtype=torch.float32))
    torch.cuda.synchronize()
    for (a_, b_), o in zip(pairs, outs):
        assert rel_err(o, dequantize_f64(a_) @ dequantize_f64(b_).t()) < 1e-5


def chosen_kernel(a, b, out_dtype):
    from fp4gen.cuda.ops import gemm_kernel
    return gemm_kernel(a, b, out_dtype)


@pytest.mark.parametrize("m,family,tile", [(5, "gemm_packed_rs", "t16x128x64"),
                                           (16, "gemm_packed_rs", "t16x128x64"),
                                           (20, "gemm_packed_rs", "t64x128x64"),
                                           (64, "gemm_packed_rs", "t64x128x64"),
                                           (100, "gemm_packed_rs", "t128x128x64"),
                                           (200, "gemm_packed_rs", "t128x128x64")])
@pytest.mark.parametrize("n,k", [(1000, 192), (17, 1024), (64, 64)])
@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_packed_gemm_rule_choice_per_m(m, family, tile, n, k, out_dtype, tol):
    for a_row, b_row in SCALES:
        a, b = operand(m, k, a_row, m + n), operand(n, k, b_row, k)
        kernel = chosen_kernel(a, b, out_dtype)
        assert kernel.family == family and tile in kernel.name
        d = fp4gen.gemm(a, b, out_dtype=out_dtype)
        assert d.shape == (m, n) and d.stride() == (n, 1)  # no padded N for this family
        assert rel_err(d, dequantize_f64(a) @ dequantize_f64(b).t()) < tol


def mma_sync_kernel(out_dtype, tile="t64x64x64"):
    """A gemm_fused_dequant (mma.sync) kernel: no longer the rule's choice anywhere, still an autotuner candidate."""
    token = {torch.bfloat16: "bf16out", torch.float32: "fp32out"}[out_dtype]
    return f"gemm_nvfp4_fused_{token}_{tile}_sm90a"


def test_fused_gemm_row_strided_operands_accumulate_and_nan(force_kernel):
    wide_a, wide_b = operand(48, 512, True, 21), operand(300, 512, False, 22)
    # the first 256 columns of each: row strides of 256 code bytes and 32 scale bytes
    a = fp4gen.NVFP4Data(wide_a.data[:, :128], wide_a.scale[:, :16], wide_a.amax)
    b = fp4gen.NVFP4Data(wide_b.data[:, :128], wide_b.scale[:, :16], wide_b.amax)
    force_kernel(mma_sync_kernel(torch.float32) + "," + mma_sync_kernel(torch.bfloat16))
    assert chosen_kernel(a, b, torch.float32).family == "gemm_fused_dequant"
    base = torch.randn(48, 300, device="cuda")
    out = base.clone()
    fp4gen.gemm(a, b, out=out, accumulate=True)
    assert rel_err(out, dequantize_f64(a) @ dequantize_f64(b).t() + base.double()) < 1e-5
    a.amax[7] = float("nan")
    d = fp4gen.gemm(a, b, out_dtype=torch.bfloat16)
    assert torch.isnan(d[7]).all() and not torch.isnan(d[torch.arange(48, device="cuda") != 7]).any()


def gemm_replayed(a, b, new_a, **kwargs):
    """fp4gen.gemm(a, b) captured in a CUDA graph on a side stream, then replayed with new_a's contents in
    a's buffers: the replayed result."""
    static_a = fp4gen.NVFP4Data(a.data.clone(), a.scale.clone(), a.amax.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        d = fp4gen.gemm(static_a, b, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    static_a.data.copy_(new_a.data), static_a.scale.copy_(new_a.scale), static_a.amax.copy_(new_a.amax)
    graph.replay()
    torch.cuda.synchronize()
    return d


def test_fused_gemm_in_a_cuda_graph(force_kernel):
    a, b = operand(64, 512, True, 23), operand(700, 512, True, 24)
    force_kernel(mma_sync_kernel(torch.bfloat16))
    assert chosen_kernel(a, b, torch.bfloat16).family == "gemm_fused_dequant"
    new = operand(64, 512, False, 25)
    assert rel_err(gemm_replayed(a, b, new), dequantize_f64(new) @ dequantize_f64(b).t()) < 1e-2


@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_fused_gemm_split_k_is_right_and_deterministic(force_kernel, out_dtype, tol):
    from fp4gen.cuda.ops import _multiprocessors
    from fp4gen.cuda.select import split_k
    a, b = operand(60, 2048, True, 26), operand(4096, 2048, False, 27)
    force_kernel(mma_sync_kernel(out_dtype))
    kernel = chosen_kernel(a, b, out_dtype)
    splits = split_k(kernel.facts["tile_m"], kernel.facts["tile_n"], 60, 4096, 2048 // 64, _multiprocessors(0),
                     kernel.facts["split_ctas_per_multiprocessor"])
    assert kernel.family == "gemm_fused_dequant" and splits > 1
    base = torch.randn(60, 4096, device="cuda").to(out_dtype)
    first = fp4gen.gemm(a, b, out=base.clone(), accumulate=True)
    second = fp4gen.gemm(a, b, out=base.clone(), accumulate=True)
    assert torch.equal(first, second)  # partial sums are added in a fixed order
    assert rel_err(first, dequantize_f64(a) @ dequantize_f64(b).t() + base.double()) < tol


def packed_wgmma_kernels(out_dtype):
    from fp4gen.cuda.manifest import load_manifest
    token = {torch.bfloat16: "bf16out", torch.float32: "fp32out"}[out_dtype]
    return sorted(name for name, k in load_manifest()["kernels"].items()
                  if k["family"] in ("gemm_fused_wgmma", "gemm_packed_rs") and token in name
                  and name.endswith("sm90a"))


@pytest.fixture
def force_kernel(monkeypatch):
    """Forces a GEMM kernel by name (FP4GEN_KERNEL) with an empty plan cache, so the name really decides."""
    from fp4gen.cuda import ops

    def force(name):
        monkeypatch.setenv("FP4GEN_KERNEL", name)
        monkeypatch.setattr(ops, "_PLANS", {})
        monkeypatch.setattr(ops, "_GEMM_PLANS", {})
    return force


@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("m,n,k", [(1, 256, 128), (100, 264, 64), (200, 1000, 512), (333, 17, 192),
                                   (1000, 1000, 1024), (4100, 3000, 2048), (64, 8192, 4096)])
def test_packed_wgmma_gemm_every_tile(force_kernel, out_dtype, tol, m, n, k):
    names = packed_wgmma_kernels(out_dtype)
    assert names, "no gemm_fused_wgmma or gemm_packed_rs kernel built"
    for a_row, b_row in SCALES:
        a, b = operand(m, k, a_row, m + n), operand(n, k, b_row, k + 1)
        ref = dequantize_f64(a) @ dequantize_f64(b).t()
        for name in names:
            force_kernel(name)
            assert chosen_kernel(a, b, out_dtype).name == name
            d = fp4gen.gemm(a, b, out_dtype=out_dtype)
            assert d.shape == (m, n) and d.stride() == (n, 1)  # no padded N for this family
            assert rel_err(d, ref) < tol, name


@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_packed_wgmma_gemm_accumulates_strided_operands_and_nan(force_kernel, out_dtype, tol):
    wide_a, wide_b = operand(300, 1024, True, 31), operand(500, 1024, False, 32)
    # the first 512 columns of each: row strides of 512 code bytes and 64 scale bytes
    a = fp4gen.NVFP4Data(wide_a.data[:, :256], wide_a.scale[:, :32], wide_a.amax)
    b = fp4gen.NVFP4Data(wide_b.data[:, :256], wide_b.scale[:, :32], wide_b.amax)
    base = torch.randn(300, 500, device="cuda").to(out_dtype)
    for name in packed_wgmma_kernels(out_dtype):
        force_kernel(name)
        out = base.clone()
        fp4gen.gemm(a, b, out=out, accumulate=True)
        assert rel_err(out, dequantize_f64(a) @ dequantize_f64(b).t() + base.double()) < tol, name
        odd = torch.full((300, 499), float("nan"), device="cuda", dtype=out_dtype)  # odd row stride: no pair stores
        b_odd = fp4gen.NVFP4Data(b.data[:499], b.scale[:499], b.amax)
        fp4gen.gemm(a, b_odd, out=odd)
        assert rel_err(odd, dequantize_f64(a) @ dequantize_f64(b_odd).t()) < tol, name
    nan_a = fp4gen.NVFP4Data(a.data, a.scale, a.amax.clone())
    nan_a.amax[7] = float("nan")
    d = fp4gen.gemm(nan_a, b, out_dtype=out_dtype)
    assert torch.isnan(d[7]).all() and not torch.isnan(d[torch.arange(300, device="cuda") != 7]).any()


def test_packed_wgmma_gemm_split_k_and_cuda_graph(force_kernel):
    from fp4gen.cuda.ops import _multiprocessors
    from fp4gen.cuda.select import split_k
    a, b = operand(64, 4096, True, 33), operand(2048, 4096, False, 34)
    for name in packed_wgmma_kernels(torch.bfloat16):
        force_kernel(name)
        kernel = chosen_kernel(a, b, torch.bfloat16)
        assert split_k(kernel.facts["tile_m"], kernel.facts["tile_n"], 64, 2048, 64, _multiprocessors(0),
                       kernel.facts["split_ctas_per_multiprocessor"]) > 1
        first, second = fp4gen.gemm(a, b), fp4gen.gemm(a, b)
        assert torch.equal(first, second)  # partial sums are added in a fixed order
        assert rel_err(first, dequantize_f64(a) @ dequantize_f64(b).t()) < 1e-2, name
        new = operand(64, 4096, False, 35)
        assert rel_err(gemm_replayed(a, b, new), dequantize_f64(new) @ dequantize_f64(b).t()) < 1e-2, name


def test_packed_rs_split_k_of_every_size(force_kernel):
    """gemm_packed_rs with every split of K the rule can take (2 to 8), tails in M and N, the scale
    combinations in turn, fp32 output: right, and the same bits from call to call."""
    from fp4gen.cuda.manifest import load_manifest
    from fp4gen.cuda.ops import _multiprocessors
    from fp4gen.cuda.select import split_k
    k = 4096  # 64 k-tiles: splits of up to 8 keep 8 k-tiles each
    names = [name for name in packed_wgmma_kernels(torch.float32) if "packedrs" in name]
    assert names, "no gemm_packed_rs kernel built"
    for name in names:
        force_kernel(name)
        facts = load_manifest()["kernels"][name]["facts"]
        tile_m, tile_n = facts["tile_m"], facts["tile_n"]
        m = tile_m - 3 if tile_m > 16 else 13  # one tile row with a tail
        seen = {}
        for tiles_n in range(1, 300):  # the first N-tile count that gives each split
            splits = split_k(tile_m, tile_n, m, tiles_n * tile_n, k // 64, _multiprocessors(0),
                             facts["split_ctas_per_multiprocessor"])
            seen.setdefault(splits, tiles_n)
        assert set(range(2, 9)) <= set(seen), (name, seen)
        for splits in range(2, 9):
            n = seen[splits] * tile_n - 5  # a tail in the last tile
            a_row, b_row = SCALES[splits % 4]
            a, b = operand(m, k, a_row, 50 + splits), operand(n, k, b_row, 60 + splits)
            first, second = fp4gen.gemm(a, b, out_dtype=torch.float32), fp4gen.gemm(a, b, out_dtype=torch.float32)
            assert torch.equal(first, second), (name, splits)  # added in split order
            assert rel_err(first, dequantize_f64(a) @ dequantize_f64(b).t()) < 1e-5, (name, splits)


def test_autotune_measures_once_per_shape_class_and_never_in_a_graph(monkeypatch, tmp_path):
    from fp4gen.cuda import autotune, ops
    monkeypatch.setenv("FP4GEN_AUTOTUNE", "1")
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "_TUNING_CACHES", {})
    measured = []
    real_time = ops._time_gemm

    def counting(kernel, *args):
        measured.append(kernel.name)
        return real_time(kernel, *args)
    monkeypatch.setattr(ops, "_time_gemm", counting)
    a, b = operand(100, 1024, True, 40), operand(3000, 1024, False, 41)
    ref = dequantize_f64(a) @ dequantize_f64(b).t()
    # a new shape class met inside graph capture: the rule's kernel, nothing timed, nothing remembered
    captured = gemm_replayed(a, b, a, out_dtype=torch.float32)
    assert measured == [] and rel_err(captured, ref) < 1e-5
    # the first eager call measures every kernel that can take the problem, then runs the fastest
    d = fp4gen.gemm(a, b, out_dtype=torch.float32)
    assert rel_err(d, ref) < 1e-5
    (entry,) = json.loads(next((tmp_path / "autotune").glob("*.json")).read_text()).values()
    assert sorted(measured) == sorted(entry["ms"]) and len(measured) >= 3
    assert all(t is not None and t > 0 for t in entry["ms"].values())
    assert chosen_kernel(a, b, torch.float32).name == entry["kernel"]
    fastest = min(entry["ms"], key=entry["ms"].get)
    assert entry["ms"][entry["kernel"]] <= entry["ms"][fastest] * (1 + autotune.MARGIN)
    # the same class (M 65..128) is not measured again, and accumulating into out is right with the choice
    out = torch.randn(120, 3000, device="cuda")
    a120 = operand(120, 1024, True, 42)
    ref120 = dequantize_f64(a120) @ dequantize_f64(b).t() + out.double()
    fp4gen.gemm(a120, b, out=out, accumulate=True)
    assert len(measured) == len(entry["ms"]) and rel_err(out, ref120) < 1e-5


@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1024), (4100, 3000, 2048), (2048, 4096, 4096)])
def test_scratch_gemm_every_kernel_over_several_waves(force_kernel, out_dtype, tol, m, n, k):
    """Every gemm_sm90 kernel on shapes of one to a few waves of tiles with tails in M and N, every scale
    combination: the product, accumulation into C, and the same bits on a second call."""
    from fp4gen.cuda.manifest import load_manifest
    token = {torch.bfloat16: "bf16out", torch.float32: "fp32out"}[out_dtype]
    names = sorted(name for name, kernel in load_manifest()["kernels"].items()
                   if kernel["family"] == "gemm_sm90" and token in name)
    assert names, "no gemm_sm90 kernel built"
    for a_row, b_row in SCALES:
        a, b = operand(m, k, a_row, m + k), operand(n, k, b_row, n + 1)
        ref = dequantize_f64(a) @ dequantize_f64(b).t()
        base = torch.randn(m, n, device="cuda").to(out_dtype)
        for name in names:
            force_kernel(name)
            assert chosen_kernel(a, b, out_dtype).name == name
            d = fp4gen.gemm(a, b, out_dtype=out_dtype)
            assert rel_err(d, ref) < tol, name
            assert torch.equal(fp4gen.gemm(a, b, out_dtype=out_dtype), d), name
            out = base.clone()
            fp4gen.gemm(a, b, out=out, accumulate=True)
            assert rel_err(out, ref + base.double()) < tol, name


@pytest.mark.parametrize("out_dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("m,n,k", [(100, 264, 512), (300, 37, 256), (16, 1000, 128)])
def test_bias_in_every_gemm_kernel(force_kernel, out_dtype, tol, m, n, k):
    from fp4gen.cuda.manifest import load_manifest
    from fp4gen.cuda.select import Problem, viable
    a, b = operand(m, k, True, 50), operand(n, k, False, 51)
    product = dequantize_f64(a) @ dequantize_f64(b).t()
    bias = torch.randn(n, device="cuda") * product.abs().mean().float()  # comparable to the products
    base = torch.randn(m, n, device="cuda").to(out_dtype)
    names = viable(Problem("gemm", (9, 0), {"out_dtype": str(out_dtype).replace("torch.", "")}, {}, k, m),
                   load_manifest())
    assert {load_manifest()["kernels"][name]["family"] for name in names} >= {"gemm_sm90", "gemm_fused_wgmma"}
    for name in names:
        force_kernel(name)
        for bias_dtype in (torch.float32, torch.bfloat16):
            b_vec = bias.to(bias_dtype)
            d = fp4gen.gemm(a, b, out_dtype=out_dtype, bias=b_vec)
            assert rel_err(d, product + b_vec.double()) < tol, (name, bias_dtype)
        out = base.clone()
        fp4gen.gemm(a, b, out=out, accumulate=True, bias=bias)
        assert rel_err(out, product + bias.double() + base.double()) < tol, name
