"""The generated amax, row pass and quantize kernels on a CUDA device: byte-equal to the reference backend and
to the golden vectors, for every variant."""
import numpy as np
import pytest
import torch

import fp4gen
from conftest import golden_cases, load_golden
from fp4gen.cuda import ops as cuda_ops

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DIRECTIONS = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}
MODES = [("row", (1, 16)), ("tensor", (1, 16)), ("tensor", (16, 16))]


def assert_same_operand(got, ref):
    assert torch.equal(got.data, ref.data), "E2M1 codes differ"
    assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8)), "E4M3 scales differ"
    nan = torch.isnan(ref.amax)
    assert torch.equal(torch.isnan(got.amax), nan) and torch.equal(got.amax[~nan], ref.amax[~nan]), "amax differs"


def takes_row_pass(x, scaling="row", block=(1, 16), rowwise=True, columnwise=True):
    flat = torch.empty(x.shape[:-1].numel(), x.shape[-1], dtype=x.dtype, device="meta")  # as fp4gen flattens x
    return cuda_ops.uses_row_pass(flat, scaling, block, rowwise, columnwise)


def assert_same(x, **kw):
    """fp4gen.quantize on the GPU equals the reference backend. Where the call takes the row pass (row scaling
    with a rowwise copy, see fp4gen.cuda.ops.uses_row_pass) the other path, the amax pass and the quantize
    kernel of the same direction, is checked too."""
    ref = fp4gen.quantize(x, backend="reference", **kw)

    def check(got):
        for direction in ("rowwise", "columnwise"):
            if getattr(ref, direction) is None:
                assert getattr(got, direction) is None
            else:
                assert_same_operand(getattr(got, direction), getattr(ref, direction))
        return got

    got = check(fp4gen.quantize(x, **kw))
    if takes_row_pass(x, **kw):
        with cuda_ops.row_pass_limits(0):
            assert not takes_row_pass(x, **kw)
            check(fp4gen.quantize(x, **kw))
    return got


def heavy(rows, cols, dtype, seed):
    """2^+-30 row and column spreads, an all-zero row and column, a tiny block, a huge block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-30, 31, (rows, 1), device="cuda", generator=g).float())
    x *= torch.exp2(torch.randint(-30, 31, (1, cols), device="cuda", generator=g).float())
    x[rows // 3] = 0
    x[:, cols // 2] = 0
    x[:16, :16] = 1e-12
    x[-16:, -16:] *= 1e20
    return x.to(dtype)


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_golden_vectors_on_gpu(case):
    x, z = load_golden(case)
    q = fp4gen.quantize(x.cuda(), scaling=case["scaling"], block=tuple(case["block"]), rowwise=case["rowwise"],
                        columnwise=case["columnwise"], hadamard=case["rht"])
    for direction, suffix in (("rowwise", ""), ("columnwise", "_t")):
        if case[direction]:
            op = getattr(q, direction)
            np.testing.assert_array_equal(op.data.cpu().numpy(), z["data" + suffix])
            np.testing.assert_array_equal(op.scale.view(torch.uint8).cpu().numpy(), z["scale" + suffix])
            np.testing.assert_array_equal(op.amax.cpu().numpy().view(np.uint32), z["amax" + suffix].view(np.uint32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("scaling,block", MODES)
# (320 and 1152 rows: a columnwise copy whose rows of scales, 20 and 72 bytes, start at 4- and 8-byte boundaries,
# so its kernels store whole 16-byte pieces of them in words; 48 and 1040: at any byte)
@pytest.mark.parametrize("rows,cols", [(16, 16), (48, 80), (1040, 4112), (256, 1024), (320, 272), (1152, 1040)])
def test_every_variant_equals_reference(dtype, direction, scaling, block, rows, cols):
    rowwise, columnwise = DIRECTIONS[direction]
    torch.manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
    assert_same(x, scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,cols", [(2064, 8208), (4112, 8208), (8208, 8208)])
def test_units_of_every_width_equal_reference(dtype, rows, cols):
    # The quantize kernel's CTAs take units of 8, 4 or 2 tile columns, narrower where the tensor would not fill
    # the GPU: the shapes above take 2-tile units, these (a part tile row and column left over) also 4- and
    # 8-tile ones on a GPU of about 130 multiprocessors (an H200: bf16 2, 4 and 8; fp32 4, 8 and 8).
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
    for scaling, block in MODES[1:]:  # per tensor, 1x16 and 16x16 (row scaling takes the row pass here)
        for rowwise, columnwise in DIRECTIONS.values():
            assert_same(x, scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise)


def rows_for_dealt_units(dtype, cols: int, ctas_per_sm: int = 4) -> int:
    """Rows (a multiple of 16, with a part tile row left over) that give the both-copies quantize kernel at least
    three of its 8-tile units per CTA on this GPU, where its CTAs take units dealt in turn instead of runs
    (quant_units_dealt in templates/include/fp4gen/quantize.cuh; 4 CTAs a multiprocessor)."""
    band_rows = 4 * (64 if dtype.itemsize == 2 else 32)  # 4 warps, one tile row each
    units_k = -(-cols // 512)  # 8-tile units of 64 columns
    slots = torch.cuda.get_device_properties(0).multi_processor_count * ctas_per_sm
    return -(-3 * slots // units_k) * band_rows + 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_dealt_units_equal_reference(dtype, block):
    # tensors of three or more waves of units: the CTAs of the both-copies kernel take units dealt in turn
    cols = 4112
    rows = rows_for_dealt_units(dtype, cols)
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
    assert_same(x, scaling="tensor", block=block, rowwise=True, columnwise=True)


@pytest.mark.parametrize("rows,cols", [(2064, 8208), (7936, 8208), (26640, 8208)])
def test_stochastic_units_of_both_widths_equal_reference(rows, cols):
    # The stochastic kernels take 2-tile units unless the units fill one wave of CTAs (90% or more) or 8-tile
    # ones make three: on an H200 (528 CTA slots) the shapes take 2-tile units, 8-tile units in one wave (527)
    # and in three (1785). The same random state on both backends.
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols, device="cuda") * 3).to(torch.bfloat16)
    for rowwise, columnwise in DIRECTIONS.values():
        kw = dict(scaling="tensor", rowwise=rowwise, columnwise=columnwise, rounding="stochastic")
        got = fp4gen.quantize(x, rng=fp4gen.RNGState(7, device=x.device), **kw)
        ref = fp4gen.quantize(x, backend="reference", rng=fp4gen.RNGState(7, device=x.device), **kw)
        for direction in ("rowwise", "columnwise"):
            assert (getattr(got, direction) is None) == (getattr(ref, direction) is None)
            if getattr(ref, direction) is not None:
                assert_same_operand(getattr(got, direction), getattr(ref, direction))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("rows,cols", [(1, 16), (37, 80), (1001, 4112)])
def test_rowwise_only_with_rows_not_a_multiple_of_16(dtype, scaling, rows, cols):
    # only the columnwise copy and 16x16 blocks need M % 16 == 0: the last tile row of a rowwise-only call
    # is partly outside the tensor, and its staged rows must not be written
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
    assert_same(x, scaling=scaling, block=(1, 16), rowwise=True, columnwise=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaling,block", MODES)
def test_heavy_dynamic_range_and_zero_rows_and_columns(dtype, scaling, block):
    x = heavy(528, 784, dtype, seed=11)  # multiples of 16, not of 32
    assert_same(x, scaling=scaling, block=block)


def test_rounding_boundaries():
    # values on and next to every E2M1 decision boundary, scaled so S_enc = 1 and the block scale is 1
    base = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device="cuda")
    vals = torch.cat([base, base.nextafter(torch.zeros_like(base)), base.nextafter(torch.full_like(base, 9)),
                      -base, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 6.0, 6.0, 6.0, 6.0], device="cuda")])
    x = vals.repeat(64, 4)[:, :128].contiguous()
    for scaling in ("row", "tensor"):
        assert_same(x, scaling=scaling)


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_nan_input(scaling):
    x = torch.randn(64, 96, device="cuda")
    x[5, 7] = float("nan")
    x[40:56, 16:32] = float("nan")  # a whole block
    q = assert_same(x, scaling=scaling)
    if scaling == "row":
        assert torch.isnan(q.rowwise.amax).nonzero().flatten().tolist() == [5] + list(range(40, 56))
        assert torch.isnan(q.columnwise.amax).nonzero().flatten().tolist() == [7] + list(range(16, 32))
    else:
        assert torch.isnan(q.rowwise.amax).all()
    assert torch.isnan(fp4gen.dequantize(q.rowwise, torch.float32)[5]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("direction", ["columnwise", "both"])
def test_nan_input_16bit_columnwise(dtype, direction):
    # 16-bit block maxima are packed two columns per word: NaNs in one column of a pair, in either
    # row half of a block, and a column block that is all NaN beside a finite one
    x = torch.randn(80, 96, device="cuda").to(dtype)
    x[5, 7] = x[9, 22] = x[70, 95] = float("nan")
    x[16:32, 50] = float("nan")
    x[48:64, 64:80] = float("nan")
    rowwise, columnwise = DIRECTIONS[direction]
    for scaling, block in MODES:
        assert_same(x, scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("scaling,block", MODES)
def test_16bit_fast_encode_and_its_fallback(dtype, direction, scaling, block):
    # sm_90a encodes a 16-bit tile with fewer instructions where every block allows it (no saturation,
    # no product that underflows, no NaN) and exactly otherwise: tiles of both kinds side by side, -0.0
    # throughout, and each reason for the fallback in a tile of its own
    g = torch.Generator(device="cuda").manual_seed(17)
    x = torch.randn(256, 512, device="cuda", generator=g)
    x[::3, ::5] = -0.0
    x[70, 130] = 3e4                   # tile (1, 2): a large value, so that a small block of its row ...
    x[70, 144:160] *= 1e-3             # ... gets a coarse (subnormal or zero) E4M3 scale: codes saturate
    x[200:216, 400] = 1e-30 * torch.randn(16, device="cuda", generator=g).abs()  # tiny positive column block
    # (with one amax for the tensor, a huge value or a NaN would send every tile to the exact encode)
    if dtype == torch.bfloat16 and scaling == "row":
        x[130, 70] = 3e38              # tile (2, 1): a huge block ...
        x[131:146, 64:80] = -1e-30     # ... whose tiny negative products round to -0 (code 0, not 8)
    x = x.to(dtype)
    if scaling == "row":
        x.view(torch.int16)[250, 260] = -64  # 0xFFC0: a NaN with its sign bit set (code 7)
    rowwise, columnwise = DIRECTIONS[direction]
    assert_same(x, scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_global_scales_at_the_branch_free_reciprocal_bounds(dtype, direction, scaling):
    # sm_90a computes a tile's block-scale reciprocals with no branch where every global decode scale S_dec of
    # its rows and columns lies in [2^-117, 2^116] (nvfp4.cuh: block_reciprocals_in_range), and with
    # __frcp_rn elsewhere: rows and columns whose amax puts S_dec (about amax / 2688) just inside and just
    # outside each bound, tiny and huge, beside ordinary ones
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(256, 512, device="cuda", generator=g, dtype=torch.float64)
    low, high = 2688 * 2.0 ** -117, 2688 * 2.0 ** 116
    # (1 -+ 2^-6: distinct in bf16 too, whose 8-bit significands would round 1 -+ 2^-10 to 1)
    amaxes = [low * (1 - 2 ** -6), low * (1 + 2 ** -6), high * (1 - 2 ** -6), high * (1 + 2 ** -6), 1e-36, 3e38]
    for k, amax in enumerate(amaxes):
        row, col = 64 * (k % 4) + 3 * k, 70 * k + 5  # spread over tiles, in different tile rows and columns
        if k >= 2 and scaling == "tensor":
            break  # one huge value makes the whole tensor's scale special; the small ones are tried first
        x[row] = x[row] / x[row].abs().max() * amax
        x[:, col] = x[:, col] / x[:, col].abs().max() * amax
    x = x.to(dtype)
    rowwise, columnwise = DIRECTIONS[direction]
    assert_same(x, scaling=scaling, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("direction", ["rowwise", "both"])
def test_row_pass_is_taken_for_row_scaling(dtype, direction):
    # the shapes of the variant tests above do take it (and assert_same then checks the other path as well)
    x = torch.randn(1040, 4112, device="cuda").to(dtype)
    rowwise, columnwise = DIRECTIONS[direction]
    assert takes_row_pass(x, rowwise=rowwise, columnwise=columnwise)
    assert not takes_row_pass(x, scaling="tensor", rowwise=rowwise, columnwise=columnwise)
    assert not takes_row_pass(x, rowwise=False, columnwise=True)
    assert not takes_row_pass(x, block=(16, 16), rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_wider_than_the_row_pass_limit(dtype):
    # past ROW_PASS_MAX_ROW_BYTES a call with both copies takes the amax pass and the quantize kernel, while
    # the rowwise copy alone still takes the row pass (without column maxima); with the limit raised, the row
    # pass takes rows whose column maxima need more than the 48 KB of shared memory a kernel gets by default
    elem = torch.tensor([], dtype=dtype).element_size()
    x = heavy(48, cuda_ops.ROW_PASS_MAX_ROW_BYTES // elem + 16, dtype, seed=3)
    assert not takes_row_pass(x)
    assert_same(x)
    assert takes_row_pass(x, columnwise=False)
    assert_same(x, columnwise=False)
    wide = heavy(32, 160 * 1024 // elem, dtype, seed=4)
    with cuda_ops.row_pass_limits(1 << 20):
        assert takes_row_pass(wide)
        assert_same(wide)


def test_inf_input():
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    x[3, 3] = float("inf")
    x[20, 50] = -float("inf")
    for scaling in ("row", "tensor"):
        assert_same(x, scaling=scaling)


def test_nd_input_and_row_strided_view():
    x = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert_same(x)
    wide = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    view = wide[:, 64:192]  # row stride 256, contiguous rows
    got = fp4gen.quantize(view)
    ref = fp4gen.quantize(view.contiguous(), backend="reference")
    assert_same_operand(got.rowwise, ref.rowwise)
    assert_same_operand(got.columnwise, ref.columnwise)


def test_transposed_view_is_a_clear_error():
    x = torch.randn(64, 32, device="cuda").t()
    with pytest.raises(ValueError, match=r"strides \(1, 32\).*contiguous"):
        fp4gen.quantize(x)


def test_misaligned_input_is_a_clear_error():
    x = torch.randn(32 * 64 + 1, device="cuda")[1:].view(32, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp4gen.quantize(x)


def test_empty_input():
    for shape in ((0, 64), (32, 0)):
        x = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
        q = assert_same(x, scaling="row")
        assert q.rowwise.data.shape == (shape[0], shape[1] // 2)


def test_more_than_2_pow_31_elements():
    rows, cols = (1 << 17) + 16, 1 << 14  # 2^31 + 2^18 elements
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    x[-1, -1] = 1000.0
    q = fp4gen.quantize(x, scaling="row")
    assert torch.equal(q.columnwise.amax, x.abs().amax(0).float())
    assert torch.equal(q.rowwise.amax, x.abs().amax(1).float())
    for r0 in (0, rows - 16):  # the first rows and rows past element 2^31
        ref = fp4gen.quantize(x[r0:r0 + 16], scaling="row", columnwise=False, backend="reference").rowwise
        assert torch.equal(q.rowwise.data[r0:r0 + 16], ref.data)
        assert torch.equal(q.rowwise.scale[r0:r0 + 16].view(torch.uint8), ref.scale.view(torch.uint8))
    for c0 in (0, cols - 16):  # columns: their codes past byte 2^30 of the columnwise buffer
        ref = fp4gen.quantize(x[:, c0:c0 + 16], scaling="row", rowwise=False, backend="reference").columnwise
        assert torch.equal(q.columnwise.data[c0:c0 + 16], ref.data)
        assert torch.equal(q.columnwise.scale[c0:c0 + 16].view(torch.uint8), ref.scale.view(torch.uint8))


def test_cuda_graph_capture_and_replay_with_new_input():
    static_x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    fp4gen.quantize(static_x)  # warm up: load the libraries outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        q = fp4gen.quantize(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        torch.manual_seed(seed)
        new = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * seed
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = fp4gen.quantize(new, backend="reference")
        assert_same_operand(q.rowwise, ref.rowwise)
        assert_same_operand(q.columnwise, ref.columnwise)


def test_two_streams_at_once():
    xs = [torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(2)]
    streams = [torch.cuda.Stream() for _ in xs]
    torch.cuda.synchronize()
    outs = []
    for x, stream in zip(xs, streams):
        with torch.cuda.stream(stream):
            outs.append(fp4gen.quantize(x))
    torch.cuda.synchronize()
    for x, q in zip(xs, outs):
        ref = fp4gen.quantize(x, backend="reference")
        assert_same_operand(q.rowwise, ref.rowwise)
        assert_same_operand(q.columnwise, ref.columnwise)


def test_e2m1_encoding_of_arbitrary_floats():
    # Tensor scaling with amax 2688 gives S_enc = 1, and a 6 in every block gives block scale 1, so
    # every other element is encoded as itself: a direct sweep of the E2M1 rounding over fp32 values.
    g = torch.Generator(device="cuda").manual_seed(5)
    n_blocks = 1 << 16
    y = torch.rand(n_blocks, 16, device="cuda", generator=g) * 12 - 6  # |y| <= 6: the block scale stays 1
    boundaries = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device="cuda")
    near = torch.cat([boundaries, boundaries.nextafter(torch.zeros_like(boundaries)),
                      boundaries.nextafter(torch.full_like(boundaries, 9.0))])
    near = torch.cat([near, -near, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 0.1, -6.0],
                                                device="cuda")])
    y[: near.numel() // 8].view(-1)[: near.numel()] = near
    exps = torch.randint(-149, 3, (n_blocks // 4, 16), device="cuda", generator=g).float()
    y[n_blocks // 2: n_blocks // 2 + n_blocks // 4] = torch.exp2(exps) * torch.sign(torch.randn_like(exps))
    y[:, 0] = 6.0
    y[0, 1] = 2688.0  # the tensor amax; this one block gets its own scale
    got = fp4gen.quantize(y, scaling="tensor", columnwise=False)
    ref = fp4gen.quantize(y, scaling="tensor", columnwise=False, backend="reference")
    assert got.rowwise.amax.item() == 2688.0
    assert (got.rowwise.scale.float()[1:] == 1.0).all()
    assert_same_operand(got.rowwise, ref.rowwise)
