"""fp4gen.quantize_grouped on the CUDA backend gives the reference backend's bytes for every routing (empty
groups, one group taking every token, token counts off the 16 grid), option, scaling and dtype; and it is
CUDA-graph safe: no host synchronization, and a captured call follows new offsets on replay."""
import pytest
import torch

import fp4gen
from conftest import bit_patterns, group_ends as _ends, run_without_host_sync

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OPTIONS = {
    "plain": {},
    "sr": dict(rounding="stochastic"),
    "rht": dict(hadamard=True),
    "sr+rht": dict(rounding="stochastic", hadamard=True),
    "4o6-mae": dict(four_over_six="mae"),
    "4o6-mse": dict(four_over_six="mse"),
}
ROUTINGS = {  # group sizes
    "uniform": [48, 48, 48, 48],
    "skewed": [0, 3, 0, 150, 17, 0, 1, 21],
    "one-takes-all": [0, 0, 197, 0],
    "single": [77],
    "all-empty-but-last": [0, 0, 0, 16],
}


def assert_same_as_reference(x, offsets, seed=7, **kwargs):
    gpu_kwargs, cpu_kwargs = dict(kwargs), dict(kwargs)
    if kwargs.get("rounding") == "stochastic":
        gpu_kwargs["rng"], cpu_kwargs["rng"] = fp4gen.RNGState(seed, device=x.device), fp4gen.RNGState(seed)
    dev_offsets = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=x.device)
    got = fp4gen.quantize_grouped(x, dev_offsets, **gpu_kwargs)
    want = fp4gen.quantize_grouped(x.cpu(), None if offsets is None else torch.tensor(offsets), backend="reference",
                                   **cpu_kwargs)
    for copy in ("rowwise", "columnwise"):
        a, b = getattr(got, copy), getattr(want, copy)
        assert (a is None) == (b is None), copy
        if a is None:
            continue
        assert a.layout == b.layout and a.row_scaled == b.row_scaled and a.e4m3_max == b.e4m3_max
        for field in ("data", "scale", "amax"):
            assert getattr(a, field).shape == getattr(b, field).shape, (copy, field)
            assert torch.equal(bit_patterns(getattr(a, field)).cpu(), bit_patterns(getattr(b, field))), \
                (copy, field)
        if b.padded_offsets is not None:
            assert torch.equal(a.padded_offsets.cpu(), b.padded_offsets)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_tokens_equal_reference(dtype, option, scaling, routing):
    torch.manual_seed(0)
    ends = _ends(ROUTINGS[routing])
    x = (torch.randn(ends[-1], 208, device="cuda") * torch.rand(ends[-1], 1, device="cuda") * 4).to(dtype)
    assert_same_as_reference(x, ends, scaling=scaling, **OPTIONS[option])


@pytest.mark.parametrize("copies", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
def test_one_copy(copies):
    torch.manual_seed(1)
    ends = _ends(ROUTINGS["skewed"])
    x = torch.randn(ends[-1], 64, device="cuda", dtype=torch.bfloat16)
    assert_same_as_reference(x, ends, rowwise=copies[0], columnwise=copies[1], hadamard=copies[1])


def _one_copy_cases():
    """(kind, copy, option, scaling, block) of every one-copy call that quantize_grouped accepts: 16x16 blocks are
    for stacked weights without the transform, and the transform is of the columnwise copy (others are refused,
    tests/test_grouped.py)."""
    for kind in ("tokens", "stacked"):
        for copy in ("rowwise", "columnwise"):
            for option, kwargs in OPTIONS.items():
                for scaling, block in (("tensor", (16, 16)), ("tensor", (1, 16)), ("row", (1, 16))):
                    hadamard = kwargs.get("hadamard", False)
                    if (block == (16, 16) and (kind == "tokens" or hadamard)) or (hadamard and copy == "rowwise"):
                        continue
                    yield pytest.param(kind, copy, option, scaling, block,
                                       id=f"{kind}-{copy}-{option}-{scaling}-{block[0]}x{block[1]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,copy,option,scaling,block", list(_one_copy_cases()))
def test_every_one_copy_call_equals_reference(kind, copy, option, scaling, block, dtype):
    """Each copy alone, for tokens (skewed routing: empty groups, counts off the 16 grid) and stacked weights: the
    one-copy calls take other kernel paths than both copies (the columnwise-only stacked call with 16x16 blocks once
    read a null amax pointer)."""
    torch.manual_seed(9)
    if kind == "tokens":
        ends = _ends(ROUTINGS["skewed"])
        x = (torch.randn(ends[-1], 208, device="cuda") * torch.rand(ends[-1], 1, device="cuda") * 4).to(dtype)
    else:
        ends, scales = None, torch.tensor([0.25, 1.0, 3.0, 8.0], device="cuda").view(-1, 1, 1)
        x = (torch.randn(4, 48, 208, device="cuda") * scales).to(dtype)
    got = assert_same_as_reference(x, ends, scaling=scaling, block=block, rowwise=copy == "rowwise",
                                   columnwise=copy == "columnwise", **OPTIONS[option])
    assert getattr(got, copy) is not None and getattr(got, "columnwise" if copy == "rowwise" else "rowwise") is None


def test_wide_rows_and_many_groups():
    torch.manual_seed(2)
    sizes = torch.randint(0, 40, (64,)).tolist()
    ends = _ends(sizes)
    x = torch.randn(ends[-1], 1040, device="cuda", dtype=torch.bfloat16)
    assert_same_as_reference(x, ends, scaling="row", hadamard=True)
    assert_same_as_reference(x, ends, scaling="tensor", rounding="stochastic")


@pytest.mark.parametrize("dtype,option", [(torch.bfloat16, "plain"), (torch.bfloat16, "rht"), (torch.bfloat16, "sr+rht"),
                                          (torch.float32, "plain"), (torch.float32, "rht")], ids=str)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_many_groups_over_many_tiles(dtype, option, scaling):
    """More groups than one ballot of a warp covers (130), groups of several 64-row tiles beside empty ones and
    ones of a few tokens, and enough tiles that the quantize kernel's CTAs each take several, in rows and in
    columns: a tile's group, its tokens and its amaxes change from one tile to the next."""
    torch.manual_seed(6)
    sizes = torch.randint(0, 300, (130,))
    sizes[torch.randperm(130)[:20]] = 0
    sizes[7] = 1
    ends = _ends(sizes.tolist())
    x = (torch.randn(ends[-1], 576, device="cuda") * torch.rand(ends[-1], 1, device="cuda") * 4).to(dtype)
    assert_same_as_reference(x, ends, scaling=scaling, **OPTIONS[option])


@pytest.mark.parametrize("option", ["plain", "sr", "4o6-mse"])
@pytest.mark.parametrize("scaling,block", [("tensor", (16, 16)), ("tensor", (1, 16)), ("row", (1, 16))])
def test_stacked_weights_equal_reference(option, scaling, block):
    torch.manual_seed(3)
    scales = torch.linspace(0.1, 8, 5, device="cuda").view(5, 1, 1)
    w = torch.randn(5, 48, 208, device="cuda", dtype=torch.bfloat16) * scales
    got = assert_same_as_reference(w, None, scaling=scaling, block=block, **OPTIONS[option])
    assert got.rowwise.data.shape == (5, 48, 104) and got.columnwise.data.shape == (5, 208, 24)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", ["plain", "rht", "sr"])
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_stacked_weights_over_several_tiles(dtype, option, scaling):
    """Groups of 112 rows (a whole and a partial 64-row tile each) and 208 columns; groups of 2000 x 64 whose
    per-group amax pass splits each group between many CTAs; and more groups (600) than a grid of the plain
    quantize kernel has CTAs, so that each takes one."""
    torch.manual_seed(4)
    for shape in ((3, 112, 208), (2, 2000, 64), (600, 16, 64)):
        scales = torch.linspace(0.5, 4, shape[0], device="cuda").view(-1, 1, 1)
        w = (torch.randn(*shape, device="cuda") * scales).to(dtype)
        assert_same_as_reference(w, None, scaling=scaling, **OPTIONS[option])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_stacked_weights_in_dealt_units_equal_each_dense_slice(dtype):
    """Two experts of three or more waves of units for their share of the GPU's CTAs, which the stacked kernel deals
    in turn (quant_units_dealt): each group equals the dense quantization of its slice, byte for byte."""
    experts, cols = 2, 4112
    slots = torch.cuda.get_device_properties(0).multi_processor_count * 4 // experts
    band_rows = 4 * (64 if dtype.itemsize == 2 else 32)
    rows = -(-3 * slots // -(-cols // 512)) * band_rows
    torch.manual_seed(5)
    w = (torch.randn(experts, rows, cols, device="cuda") * torch.tensor([0.5, 3.0], device="cuda").view(-1, 1, 1))
    w = w.to(dtype)
    got = fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16))
    for e in range(experts):
        want = fp4gen.quantize(w[e], scaling="tensor", block=(16, 16))
        for copy in ("rowwise", "columnwise"):
            a, b = getattr(got, copy), getattr(want, copy)
            assert torch.equal(a.data[e], b.data), (e, copy)
            assert torch.equal(a.scale[e].view(torch.uint8), b.scale.view(torch.uint8)), (e, copy)
            assert torch.equal(a.amax[e : e + 1], b.amax.reshape(1)), (e, copy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [(16, 16), (1, 16)], ids=["16x16", "1x16"])
def test_stacked_weights_of_whole_units_in_one_grid(dtype, block):
    """Experts whose rows are whole units of the plain quantize kernel (256 rows, 128 with fp32 input) are quantized
    as one tensor whose units the CTAs take in turn across experts, so a CTA's units change expert: each must take
    its own expert's amax and write its own expert's columnwise copy. 40 experts of amaxes 2^-6 .. 2^6, of one unit
    of rows and then of two, 208 columns (a partial tile column), one expert with a NaN, against the reference."""
    unit_rows = 256 if dtype.itemsize == 2 else 128
    torch.manual_seed(8)
    for rows in (unit_rows, 2 * unit_rows):
        scales = torch.exp2(torch.linspace(-6, 6, 40, device="cuda")).view(-1, 1, 1)
        w = (torch.randn(40, rows, 208, device="cuda") * scales).to(dtype)
        w[17, 3, 5] = float("nan")
        got = assert_same_as_reference(w, None, scaling="tensor", block=block)
        assert torch.isnan(got.rowwise.amax.cpu()).nonzero().flatten().tolist() == [17]


def _assert_each_expert_is_its_dense_quantization(w, got, block):
    for e in range(w.shape[0]):
        want = fp4gen.quantize(w[e], scaling="tensor", block=block)
        for copy in ("rowwise", "columnwise"):
            a, b = getattr(got, copy), getattr(want, copy)
            assert torch.equal(a.data[e], b.data), (e, copy)
            assert torch.equal(a.scale[e].view(torch.uint8), b.scale.view(torch.uint8)), (e, copy)
            assert torch.equal(bit_patterns(a.amax[e : e + 1]), bit_patterns(b.amax.reshape(1))), (e, copy)


@pytest.mark.parametrize("block", [(16, 16), (1, 16)], ids=["16x16", "1x16"])
def test_stacked_weights_in_one_grid_over_several_waves(block):
    """The one-grid stacked kernel takes each expert's amax itself, a unit at a time, shortly before it quantizes
    the expert's units: CTAs wait for experts whose amaxes other CTAs are still taking. 192 experts of 16 units
    each (3072 units: several times the GPU's CTA slots), amaxes 2^-8 .. 2^8, one expert with an infinity and one
    with a NaN: each expert equals the dense quantization of its slice."""
    torch.manual_seed(9)
    scales = torch.exp2(torch.linspace(-8, 8, 192, device="cuda")).view(-1, 1, 1)
    w = (torch.randn(192, 256, 2048, device="cuda") * scales).to(torch.bfloat16)
    w[40, 100, 7] = float("inf")
    w[150, 0, 2047] = float("nan")
    got = fp4gen.quantize_grouped(w, None, scaling="tensor", block=block)
    _assert_each_expert_is_its_dense_quantization(w, got, block)
    assert torch.isnan(got.rowwise.amax.cpu()).nonzero().flatten().tolist() == [150]
    assert got.rowwise.amax[40].item() == float("inf")


def test_stacked_weights_in_one_grid_on_two_streams_at_once():
    """Two one-grid stacked quantizations running at the same time on two streams, each grid as large as the GPU
    holds: neither waits on the other's CTAs, and both give each expert's dense quantization."""
    torch.manual_seed(10)
    ws = [(torch.randn(96, 512, 2048, device="cuda") * (1 + i)).to(torch.bfloat16) for i in range(2)]
    fp4gen.quantize_grouped(ws[0], None, scaling="tensor", block=(16, 16))  # load the kernel
    streams = [torch.cuda.Stream() for _ in ws]
    outs = []
    for stream, w in zip(streams, ws):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append(fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16)))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    for w, got in zip(ws, outs):
        _assert_each_expert_is_its_dense_quantization(w, got, (16, 16))


def test_nan_in_a_stacked_weight_stays_in_its_group():
    w = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    w[2, 5, 9] = float("nan")
    got = assert_same_as_reference(w, None, scaling="tensor", block=(16, 16))
    assert torch.isnan(got.rowwise.amax.cpu()).tolist() == [False, False, True, False]
    assert torch.isnan(got.columnwise.amax.cpu()).tolist() == [False, False, True, False]


@pytest.mark.parametrize("option", ["plain", "4o6-mae"])
@pytest.mark.parametrize("scaling,block", [("tensor", (16, 16)), ("tensor", (1, 16)), ("row", (1, 16))])
@pytest.mark.parametrize("copies", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
def test_one_copy_of_stacked_weights(copies, option, scaling, block):
    """One copy of stacked weights alone (a weight cache made without autograd, dgrad's columnwise copy made in
    backward) equals the reference's and that copy of a both-copies call. The columnwise-only call with 16x16 blocks
    once read the group amax through a null rowwise amax pointer (an illegal address)."""
    torch.manual_seed(6)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0], device="cuda").view(-1, 1, 1)
    w = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16) * scales
    got = assert_same_as_reference(w, None, scaling=scaling, block=block, rowwise=copies[0], columnwise=copies[1],
                                   **OPTIONS[option])
    both = fp4gen.quantize_grouped(w, None, scaling=scaling, block=block, **OPTIONS[option])
    name = "rowwise" if copies[0] else "columnwise"
    for field in ("data", "scale", "amax"):
        assert torch.equal(bit_patterns(getattr(getattr(got, name), field)),
                           bit_patterns(getattr(getattr(both, name), field)))


def test_stacked_rowwise_only_with_rows_off_the_grid():
    w = torch.randn(3, 40, 64, device="cuda", dtype=torch.float16)
    assert_same_as_reference(w, None, scaling="tensor", columnwise=False)
    w = torch.randn(3, 37, 64, device="cuda", dtype=torch.float16)
    assert_same_as_reference(w, None, scaling="row", columnwise=False)


def test_nan_token_surfaces_in_its_row_and_group():
    ends = _ends([20, 30, 14])
    x = torch.randn(ends[-1], 64, device="cuda", dtype=torch.bfloat16)
    x[25, 7] = float("nan")
    for scaling in ("row", "tensor"):
        g = assert_same_as_reference(x, ends, scaling=scaling)
        row_amax, col_amax = g.rowwise.amax.cpu(), g.columnwise.amax.cpu()
        if scaling == "row":
            assert torch.isnan(row_amax[25]) and torch.isnan(row_amax).sum() == 1
            assert torch.isnan(col_amax[1, 7]) and torch.isnan(col_amax).sum() == 1
        else:
            assert torch.isnan(row_amax).tolist() == [False, True, False]
            assert torch.isnan(col_amax).tolist() == [False, True, False]


def test_no_host_synchronization():
    ends = torch.tensor(_ends([5, 0, 40, 19]), device="cuda")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    calls = ({}, dict(hadamard=True, rounding="stochastic"), dict(scaling="tensor", four_over_six="mae"))
    # the warm call loads the kernels and creates the device's default RNGState (a copy)
    run_without_host_sync(lambda: [fp4gen.quantize_grouped(x, ends, **kwargs) for kwargs in calls])


def test_graph_replay_follows_new_offsets():
    torch.manual_seed(4)
    x = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(_ends([30, 30, 36]), device="cuda")
    fp4gen.quantize_grouped(x, offsets, hadamard=True)  # load the kernel outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fp4gen.quantize_grouped(x, offsets, hadamard=True)
    for sizes in ([96, 0, 0], [1, 2, 93], [40, 17, 39]):
        offsets.copy_(torch.tensor(_ends(sizes)))
        graph.replay()
        torch.cuda.synchronize()
        want = fp4gen.quantize_grouped(x.cpu(), _ends(sizes), backend="reference", hadamard=True)
        for copy in ("rowwise", "columnwise"):
            for field in ("data", "scale", "amax"):
                assert torch.equal(bit_patterns(getattr(getattr(out, copy), field)).cpu(),
                                   bit_patterns(getattr(getattr(want, copy), field))), (sizes, copy, field)


def test_side_stream():
    torch.manual_seed(5)
    ends = _ends([10, 54])
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = fp4gen.quantize_grouped(x, torch.tensor(ends, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    want = fp4gen.quantize_grouped(x.cpu(), ends, backend="reference")
    assert torch.equal(got.columnwise.data.cpu(), want.columnwise.data)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_no_tokens_and_empty_experts_equal_reference(option, scaling):
    kwargs = OPTIONS[option]
    assert_same_as_reference(torch.zeros(0, 64, device="cuda", dtype=torch.bfloat16), [0, 0, 0], scaling=scaling,
                             **kwargs)
    blocks = [(1, 16)] + ([(16, 16)] if scaling == "tensor" and not kwargs.get("hadamard") else [])
    for block in blocks:
        for e, n, k in ((3, 0, 64), (3, 32, 0)):
            assert_same_as_reference(torch.zeros(e, n, k, device="cuda", dtype=torch.bfloat16), None,
                                     scaling=scaling, block=block, **kwargs)
