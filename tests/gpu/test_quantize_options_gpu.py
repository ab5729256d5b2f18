"""Recipe options on the CUDA backend: stochastic rounding, the random Hadamard transform and 4over6 give the
reference backend's bytes for every dtype, scaling, block shape and copy, including tails, NaN and CUDA-graph
replays; and Linear trains with every option on the GPU."""
import pytest
import torch

import fp4gen
from conftest import bit_patterns

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OPTIONS = {
    "sr": dict(rounding="stochastic"),
    "rht": dict(hadamard=True),
    "sr+rht": dict(rounding="stochastic", hadamard=True),
    "4o6-mae": dict(four_over_six="mae"),
    "4o6-mse": dict(four_over_six="mse"),
    "rht+4o6": dict(hadamard=True, four_over_six="mse"),
}
LAYOUTS = [("row", (1, 16)), ("tensor", (1, 16)), ("tensor", (16, 16))]
COPIES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}


def assert_same_as_reference(x: torch.Tensor, seed=5, **kwargs):
    extra_gpu, extra_cpu = {}, {}
    if kwargs.get("rounding") == "stochastic":
        extra_gpu["rng"], extra_cpu["rng"] = fp4gen.RNGState(seed, device=x.device), fp4gen.RNGState(seed)
    got = fp4gen.quantize(x, **kwargs, **extra_gpu)
    want = fp4gen.quantize(x.cpu(), backend="reference", **kwargs, **extra_cpu)
    for copy in ("rowwise", "columnwise"):
        a, b = getattr(got, copy), getattr(want, copy)
        assert (a is None) == (b is None), copy
        if a is None:
            continue
        for field in ("data", "scale", "amax"):
            assert torch.equal(bit_patterns(getattr(a, field)).cpu(), bit_patterns(getattr(b, field))), (copy, field)
        assert a.e4m3_max == b.e4m3_max
    if "rng" in extra_gpu:
        assert extra_gpu["rng"].offset.item() == 2  # advanced on the device
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("scaling,block", LAYOUTS)
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("rows,cols", [(64, 128), (144, 208), (272, 1040)])
def test_every_option_equals_reference(dtype, option, scaling, block, copies, rows, cols):
    kwargs = OPTIONS[option]
    rowwise, columnwise = COPIES[copies]
    if kwargs.get("hadamard") and (block == (16, 16) or not columnwise):
        pytest.skip("the transform is of 1x16 columnwise copies (refused otherwise, see test_quantize_options)")
    torch.manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device="cuda") * 3)
    x[rows // 2] *= 1e-3  # a quiet row
    x[:, 5] *= 40.0  # an outlier column
    assert_same_as_reference(x.to(dtype), scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise,
                             **kwargs)


def _launched_kernels(monkeypatch):
    """The names of the kernels each quantize call's launch plan launches, in order (whichever launcher runs it)."""
    from fp4gen.cuda.launch_plan import LaunchPlan
    names = []
    real_run = LaunchPlan.run

    def run(plan, launch, inputs, device):
        names.extend(kernel.name for kernel, _, _ in plan.launches)
        return real_run(plan, launch, inputs, device)

    monkeypatch.setattr(LaunchPlan, "run", run)
    return names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cols", [16, 2064, 4112, 6160, 16384, 16400])
def test_hadamard_row_pass_over_cluster_widths(dtype, cols, monkeypatch):
    # the row pass with the transform holds a 16-row panel in a cluster of CTAs of up to 2048 columns: one
    # CTA, several with a part-filled last one, the widest cluster (8 CTAs); wider rows take the amax_hadamard
    # pass and the plain rowwise kernel
    launched = _launched_kernels(monkeypatch)
    torch.manual_seed(cols)
    x = torch.randn(48, cols, device="cuda") * torch.exp2(torch.randint(-8, 9, (48, 1), device="cuda").float())
    x[:, -1] *= 50.0  # an outlier in the last column
    assert_same_as_reference(x.to(dtype), scaling="row", hadamard=True)
    row_pass = [n for n in launched if n.startswith("quantize_row_pass")]
    if cols <= 16384:
        assert row_pass and "rht16" in row_pass[0], launched
    else:
        assert not row_pass and any(n.startswith("amax_hadamard") for n in launched), launched
    assert any(n.startswith("quantize_nvfp4_") and "col_rowscaled_b1x16_rht16" in n for n in launched), launched


@pytest.mark.parametrize("option", ["sr", "rht", "sr+rht"])
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_plain_kernels_take_the_transform_and_stochastic_rounding(option, scaling, monkeypatch):
    # 16-bit input, 1x16 blocks: the plain kernels' variants, none of the quantize_options kernels; a tensor
    # of several tiles a CTA (rows and columns with tails of a tile), so that the random bytes of every tile
    # position are checked
    launched = _launched_kernels(monkeypatch)
    kwargs = OPTIONS[option]
    torch.manual_seed(7)
    x = (torch.randn(1040, 2064, device="cuda") * 3).to(torch.bfloat16)
    for copies in ("rowwise", "columnwise", "both"):
        rowwise, columnwise = COPIES[copies]
        if kwargs.get("hadamard") and not columnwise:
            continue
        launched.clear()
        assert_same_as_reference(x, scaling=scaling, rowwise=rowwise, columnwise=columnwise, **kwargs)
        assert not any("options" in n for n in launched), (copies, launched)
        if kwargs.get("rounding") == "stochastic":  # every kernel that encodes rounds stochastically
            encoders = [n for n in launched if n.startswith(("quantize_nvfp4", "quantize_row_pass"))]
            assert encoders and all("_sr_" in n for n in encoders), (copies, launched)
            if scaling == "row" and rowwise and not kwargs.get("hadamard"):
                assert any(n.startswith("quantize_row_pass") for n in launched), launched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "rht"])
def test_stochastic_rounding_of_products_that_round_to_zero(dtype, scaling, hadamard):
    # Stochastic rounding takes y = fl(x * r) + 0: a negative product that rounds to zero is +0, code 0 (a kernel
    # that multiplied with one fma, fma(x, r, +0), would keep its -0 and give code 8 wherever a block's inverse
    # scale r is below 2^-16). bf16: a block of amax 1e6 (r about 6e-6, in a row block and a column block) with the
    # tiniest negative elements, whose products round to zero (the transform mixes the column block's values, so
    # with it only the rowwise copy has such products), beside ordinary tiles; -0.0 throughout. (An fp16 value's
    # product never rounds to zero: r is at least about 6 / 65504 there.)
    from fp4gen.cuda import ops as cuda_ops
    g = torch.Generator(device="cuda").manual_seed(23)
    x = torch.randn(1040, 2064, device="cuda", generator=g) * 1000
    x[::3, ::5] = -0.0
    if dtype == torch.bfloat16:
        x[130, 64:80] = -2.0 ** -133
        x[128:144, 70] = -2.0 ** -133
        x[130, 70] = 1e6
    x = x.to(dtype)
    for copies in ("rowwise", "columnwise", "both"):
        rowwise, columnwise = COPIES[copies]
        if hadamard and not columnwise:
            continue
        kw = dict(scaling=scaling, rowwise=rowwise, columnwise=columnwise, rounding="stochastic", hadamard=hadamard)
        assert_same_as_reference(x, **kw)
        if scaling == "row" and rowwise:  # the row pass's rowwise copy above; the quantize kernel's here
            with cuda_ops.row_pass_limits(0):
                assert_same_as_reference(x, **kw)


@pytest.mark.parametrize("option", ["sr", "sr+rht"])
def test_stochastic_rounding_of_fp32_takes_the_option_kernels(option, monkeypatch):
    launched = _launched_kernels(monkeypatch)
    assert_same_as_reference(torch.randn(64, 128, device="cuda"), scaling="tensor", **OPTIONS[option])
    assert any("options" in n for n in launched), launched


@pytest.mark.parametrize("option", ["sr", "4o6-mae"])
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_rowwise_only_with_a_row_tail(option, scaling):
    x = torch.randn(37, 80, device="cuda", dtype=torch.bfloat16)
    assert_same_as_reference(x, scaling=scaling, columnwise=False, **OPTIONS[option])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", OPTIONS)
def test_extreme_values(dtype, option):
    # huge and tiny rows and columns, zero rows and columns, values near the dtype's limits
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(128, 256, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-20, 21, (128, 1), device="cuda", generator=g).float())
    x[7] = 0
    x[:, 9] = 0
    x[:16, :16] = 1e-6
    x = x.to(dtype)
    x[-1, -16:] = torch.finfo(dtype).max
    assert_same_as_reference(x, scaling="row", **OPTIONS[option])
    assert_same_as_reference(x, scaling="tensor", **OPTIONS[option])


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_nan_surfaces(option, scaling):
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    x[3, 17] = float("nan")
    q = assert_same_as_reference(x, scaling=scaling, **OPTIONS[option])
    for copy in (q.rowwise, q.columnwise):
        out = fp4gen.dequantize(copy, torch.float32, backend="reference")
        assert torch.isnan(out).any()


def test_stochastic_rounding_is_fresh_after_each_cuda_graph_replay():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    state = fp4gen.RNGState(21, device="cuda")
    out = {}

    def step():
        q = fp4gen.quantize(x, "tensor", rounding="stochastic", rng=state)
        out["row"], out["col"] = q.rowwise.data, q.columnwise.data

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: offset 0 -> 2
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # captured at offset 2 -> 4
    seen = []
    for replay in range(3):
        before = state.offset.item()
        graph.replay()
        torch.cuda.synchronize()
        replay_state = fp4gen.RNGState(21)
        replay_state.tensor[1] = before
        want = fp4gen.quantize(x.cpu(), "tensor", rounding="stochastic", rng=replay_state, backend="reference")
        assert torch.equal(out["row"].cpu(), want.rowwise.data) and torch.equal(out["col"].cpu(), want.columnwise.data)
        assert state.offset.item() == before + 2
        seen.append(out["row"].clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


def test_stochastic_rounding_is_unbiased_on_the_gpu():
    torch.manual_seed(0)
    x = torch.randn(32, 256, device="cuda")
    state = fp4gen.RNGState(99, device="cuda")
    draws = torch.stack([fp4gen.dequantize(fp4gen.quantize(x, "tensor", rounding="stochastic", rng=state,
                                                           columnwise=False).rowwise, torch.float32).double()
                         for _ in range(400)])
    mean, lo, hi = draws.mean(0), draws.amin(0), draws.amax(0)
    # where both neighbours of x turned up: the mean must be within 5 standard errors of x, the standard error
    # being that of the two-point distribution with P(hi) = (x - lo) / (hi - lo) over 400 draws (the sample
    # deviation would understate it where the rarer neighbour came up only once or twice), give or take the
    # resolution of the 8-bit random threshold: the rule's probabilities are multiples of 1/256, so its bias is
    # up to 1/256 of the gap and a neighbour a hair away still comes up with probability 1/256
    both = hi > lo
    assert both.float().mean() > 0.9
    gap = (hi - lo)[both]
    p = ((x.double()[both] - lo[both]) / gap).clamp(1 / 256, 1 - 1 / 256)
    stderr = gap * (p * (1 - p)).sqrt() / 20
    assert ((mean[both] - x.double()[both]).abs() < 5 * stderr + gap / 256 + 1e-6).all()
    nearest = fp4gen.dequantize(fp4gen.quantize(x, "tensor", columnwise=False).rowwise, torch.float32).double()
    assert (mean - x.double()).pow(2).mean() < (nearest - x.double()).pow(2).mean()


def test_four_over_six_operands_on_the_cuda_gemm():
    x = torch.randn(128, 256, device="cuda")
    a = fp4gen.quantize(x, "row", four_over_six="mae").rowwise
    b = fp4gen.quantize(torch.randn(64, 256, device="cuda"), "tensor", (16, 16), four_over_six="mse").rowwise
    assert a.e4m3_max == b.e4m3_max == 256.0
    d = fp4gen.gemm(a, b, out_dtype=torch.float32)  # the epilogue's alpha uses each operand's 6 * e4m3_max
    ref = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="reference")
    assert ((d - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("gradient_scaling", ["tensor", "row"])
def test_linear_with_every_option_matches_the_reference_backend(gradient_scaling, monkeypatch):
    recipe = fp4gen.Recipe(stochastic_rounding=True, hadamard_wgrad=True, four_over_six="all",
                           gradient_scaling=gradient_scaling)

    def run(device, backend):
        if backend:
            monkeypatch.setenv("FP4GEN_BACKEND", backend)
        else:
            monkeypatch.delenv("FP4GEN_BACKEND", raising=False)
        torch.manual_seed(0)
        layer = fp4gen.nn.Linear(256, 128, recipe=recipe, device=device, dtype=torch.bfloat16)
        x = torch.randn(512, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        fp4gen.RNGState.default(device).reset(1234)  # both runs draw the same bits
        y = layer(x)
        y.float().square().mean().backward()
        return y.float(), x.grad.float(), layer.weight.grad.float()

    cuda = run("cuda", None)
    ref = run("cuda", "reference")
    for got, want in zip(cuda, ref):  # same quantized bytes; the GEMMs differ only in summation order
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaling,block", LAYOUTS)
def test_dequantize_of_four_over_six_operands_equals_reference(dtype, scaling, block):
    x = torch.randn(128, 256, device="cuda") * 5
    x[-1, -16:] = 3e38  # blocks whose fl(sdec * amax) overflows take the factor in the other order
    q = fp4gen.quantize(x, scaling, block, four_over_six="mse")
    for copy in (q.rowwise, q.columnwise):
        got = fp4gen.dequantize(copy, dtype)
        want = fp4gen.dequantize(copy, dtype, backend="reference")
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        if dtype == torch.float32:  # (fp16 flushes this tensor-scaled data to 0 and inf either way)
            plain = fp4gen.NVFP4Data(copy.data, copy.scale, copy.amax)  # the same bytes read with 6 * 448
            assert not torch.equal(fp4gen.dequantize(plain, dtype), got)


@pytest.mark.parametrize("option", ["plain", *OPTIONS])
@pytest.mark.parametrize("scaling,block", LAYOUTS)
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("shape", [(0, 32), (32, 0), (0, 0)], ids=str)
def test_empty_inputs_equal_reference(option, scaling, block, copies, shape):
    kwargs = OPTIONS.get(option, {})
    rowwise, columnwise = COPIES[copies]
    if kwargs.get("hadamard") and (block == (16, 16) or not columnwise):
        pytest.skip("the transform is of 1x16 columnwise copies (refused otherwise, see test_quantize_options)")
    x = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    assert_same_as_reference(x, scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise, **kwargs)
