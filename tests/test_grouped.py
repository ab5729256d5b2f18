"""Grouped (mixture-of-experts) operations on the reference backend. quantize_grouped: every group equals the
dense fp4gen.quantize of its slice (the columnwise copy of the slice padded with zero tokens to a multiple of
64), for any group sizes; the layouts, capacity and padded offsets; stochastic rounding keyed by position;
clear errors for bad offsets. grouped_gemm: each group's dense GEMM. GroupedLinear: a loop of Linear layers."""
import pytest
import torch

import fp4gen
from conftest import group_ends as _ends
from fp4gen import grouped


def _same(a: fp4gen.NVFP4Data, b: fp4gen.NVFP4Data) -> bool:
    return (torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
            and torch.equal(a.amax, b.amax) and a.e4m3_max == b.e4m3_max)


ROUTINGS = {
    "uniform": [32, 32, 32],
    "skewed": [0, 5, 0, 70, 1, 19, 0],
    "one-takes-all": [0, 45, 0],
    "single": [33],
}
OPTIONS = {
    "plain": {},
    "rht": dict(hadamard=True),
    "4o6": dict(four_over_six="mse"),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_each_group_equals_dense_quantization_of_its_slice(routing, scaling, option, dtype):
    torch.manual_seed(0)
    ends = _ends(ROUTINGS[routing])
    x = (torch.randn(ends[-1], 64) * torch.rand(ends[-1], 1) * 3).to(dtype)
    g = fp4gen.quantize_grouped(x, torch.tensor(ends), scaling=scaling, **OPTIONS[option])
    assert g.rowwise.layout == "rows" and g.columnwise.layout == "columns"
    assert g.columnwise.data.shape == (64, grouped.capacity(ends[-1], len(ends)) // 2)
    starts = [0] + ends[:-1]
    for i, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            dense = fp4gen.quantize(x[s:e], scaling=scaling, columnwise=False, **{
                k: v for k, v in OPTIONS[option].items() if k != "hadamard"})
            assert _same(g.rowwise.group(i), dense.rowwise), (i, "rowwise")
        padded = -(-(e - s) // 64) * 64
        col = g.columnwise.group(i)
        assert col.shape == (64, padded)
        if padded:
            xp = torch.zeros(padded, 64, dtype=dtype)
            xp[: e - s] = x[s:e]
            dense = fp4gen.quantize(xp, scaling=scaling, rowwise=False, **OPTIONS[option])
            assert _same(col, dense.columnwise), (i, "columnwise")
        else:  # an empty group: nothing to encode, amax 0
            assert not col.amax.any()
    # columns past the last group's padded end are zero codes and zero scales
    used = g.columnwise.padded_offsets[-1].item()
    assert not g.columnwise.data[:, used // 2:].any() and not g.columnwise.scale.view(torch.uint8)[:, used // 16:].any()


def test_padded_offsets_and_capacity():
    offsets = torch.tensor(_ends([0, 5, 64, 65, 0, 1]))
    assert grouped.padded_offsets(offsets).tolist() == _ends([0, 64, 64, 128, 0, 64])
    # the bound holds for the worst routing: every group one token past a multiple of 64
    assert grouped.capacity(6 * 65, 6) >= 6 * 128 and grouped.capacity(6 * 65, 6) % 64 == 0


@pytest.mark.parametrize("scaling,block", [("tensor", (16, 16)), ("tensor", (1, 16)), ("row", (1, 16))])
def test_stacked_weights_are_one_dense_quantization_per_expert(scaling, block):
    torch.manual_seed(1)
    w = torch.randn(3, 32, 48) * torch.tensor([0.5, 4.0, 40.0]).view(3, 1, 1)
    g = fp4gen.quantize_grouped(w, None, scaling=scaling, block=block)
    assert g.rowwise.layout == g.columnwise.layout == "stacked"
    assert g.rowwise.data.shape == (3, 32, 24) and g.columnwise.data.shape == (3, 48, 16)
    for e in range(3):
        dense = fp4gen.quantize(w[e], scaling=scaling, block=block)
        assert _same(g.rowwise.group(e), dense.rowwise)
        assert _same(g.columnwise.group(e), dense.columnwise)


def test_stochastic_rounding_is_keyed_by_position_and_reproducible():
    torch.manual_seed(2)
    ends = _ends([7, 0, 40, 17])
    x = torch.randn(ends[-1], 64)
    a = fp4gen.quantize_grouped(x, ends, rounding="stochastic", rng=fp4gen.RNGState(11))
    b = fp4gen.quantize_grouped(x, ends, rounding="stochastic", rng=fp4gen.RNGState(11))
    c = fp4gen.quantize_grouped(x, ends, rounding="stochastic", rng=fp4gen.RNGState(12))
    assert torch.equal(a.rowwise.data, b.rowwise.data) and torch.equal(a.columnwise.data, b.columnwise.data)
    assert not torch.equal(a.rowwise.data, c.rowwise.data)
    # the rowwise copy's bits are those of the dense [T, K] copy at the same state
    dense = fp4gen.quantize(x, scaling="row", columnwise=False, rounding="stochastic", rng=fp4gen.RNGState(11))
    assert torch.equal(a.rowwise.data, dense.rowwise.data)


def test_nan_token_makes_its_row_and_group_nan():
    ends = _ends([16, 20, 12])
    x = torch.randn(48, 32)
    x[20, 3] = float("nan")
    g = fp4gen.quantize_grouped(x, ends, scaling="tensor")
    assert torch.isnan(g.rowwise.amax).tolist() == [False, True, False]
    assert torch.isnan(g.columnwise.amax).tolist() == [False, True, False]
    g = fp4gen.quantize_grouped(x, ends, scaling="row")
    assert torch.isnan(g.rowwise.amax).nonzero().flatten().tolist() == [20]
    assert torch.isnan(g.columnwise.amax).nonzero().tolist() == [[1, 3]]


BAD_CALLS = [
    (lambda x: fp4gen.quantize_grouped(x, torch.tensor([10, 48], dtype=torch.float32)), TypeError,
     ["offsets.dtype", "int32 or torch.int64"]),
    (lambda x: fp4gen.quantize_grouped(x, torch.tensor([[10, 48]])), ValueError, ["offsets has shape (1, 2)", "1-D"]),
    (lambda x: fp4gen.quantize_grouped(x, torch.tensor([], dtype=torch.int64)), ValueError, ["offsets has shape (0,)"]),
    (lambda x: fp4gen.quantize_grouped(x, torch.tensor([10, 48], device="meta")), ValueError,
     ["offsets is on meta", "cpu"]),
    (lambda x: fp4gen.quantize_grouped(x, [30, 10, 48]), ValueError, ["non-decreasing", "offsets[1] = 10"]),
    (lambda x: fp4gen.quantize_grouped(x, [10, 40]), ValueError, ["offsets[-1] = 40", "48 tokens"]),
    (lambda x: fp4gen.quantize_grouped(x, []), ValueError, ["offsets is empty"]),
    (lambda x: fp4gen.quantize_grouped(x, [10.0, 48]), TypeError, ["offsets must hold ints"]),
    (lambda x: fp4gen.quantize_grouped(x, "10,48"), TypeError, ["offsets must be a tensor", "str"]),
    (lambda x: fp4gen.quantize_grouped(x, torch.tensor([30, 10, 48])), ValueError, ["offsets[1] = 10"]),
    (lambda x: fp4gen.quantize_grouped(x, [48], block=(16, 16), scaling="tensor"), ValueError,
     ["block=(16, 16) is for stacked weights"]),
    (lambda x: fp4gen.quantize_grouped(x, None), ValueError, ["offsets=None", "[E, N, K]"]),
    (lambda x: fp4gen.quantize_grouped(x.reshape(2, 24, 32), [48]), ValueError, ["x [T, K]", "offsets=None"]),
    (lambda x: fp4gen.quantize_grouped(x.reshape(3, 16, 32)[:, :10], None), ValueError, ["N = 10", "multiple of 16"]),
    (lambda x: fp4gen.quantize_grouped(x, [48], scaling="expert"), ValueError, ["scaling='expert'"]),
    (lambda x: fp4gen.quantize_grouped(x, [48], hadamard=True, columnwise=False), ValueError, ["columnwise copy only"]),
    (lambda x: fp4gen.quantize_grouped(x, [48], rounding="stochastc"), ValueError, ["rounding='stochastc'"]),
    (lambda x: fp4gen.quantize_grouped(x.to(torch.int32), [48]), TypeError, ["x.dtype is torch.int32"]),
]


@pytest.mark.parametrize("call,error,fragments", BAD_CALLS)
def test_bad_arguments_are_clear_errors(call, error, fragments):
    with pytest.raises(error) as info:
        call(torch.randn(48, 32))
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


# --- grouped_gemm and GroupedLinear on the reference backend ---

def _grouped_operands(sizes, k=64, n=48, seed=3):
    torch.manual_seed(seed)
    ends = _ends(sizes)
    t, e = ends[-1], len(sizes)
    x, dy, w = torch.randn(t, k), torch.randn(t, n), torch.randn(e, n, k)
    gx = fp4gen.quantize_grouped(x, ends, hadamard=True)
    gdy = fp4gen.quantize_grouped(dy, ends, scaling="tensor", hadamard=True)
    gw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16))
    return ends, gx, gdy, gw


@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_gemm_is_the_dense_gemm_of_each_group(routing):
    ends, gx, gdy, gw = _grouped_operands(ROUTINGS[routing])
    starts = [0] + ends[:-1]
    y = fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, out_dtype=torch.float32)
    dx = fp4gen.grouped_gemm(gdy.rowwise, gw.columnwise, ends, out_dtype=torch.float32)
    dw = fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, torch.tensor(ends), out_dtype=torch.float32)
    assert y.shape == (ends[-1], 48) and dx.shape == (ends[-1], 64) and dw.shape == (len(ends), 48, 64)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            assert torch.equal(y[s:e], fp4gen.gemm(gx.rowwise.group(g), gw.rowwise.group(g), torch.float32))
            assert torch.equal(dx[s:e], fp4gen.gemm(gdy.rowwise.group(g), gw.columnwise.group(g), torch.float32))
            want = fp4gen.gemm(gdy.columnwise.group(g), gx.columnwise.group(g), torch.float32)
            assert torch.equal(dw[g], want)
        else:
            assert not dw[g].any()


def test_grouped_gemm_against_float64_of_the_dequantized_operands():
    ends, gx, _, gw = _grouped_operands([10, 0, 54], seed=4)
    y = fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, out_dtype=torch.float32)
    starts = [0] + ends[:-1]
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            a = fp4gen.dequantize(gx.rowwise.group(g), torch.float32).double()
            b = fp4gen.dequantize(gw.rowwise.group(g), torch.float32).double()
            want = a @ b.T
            assert ((y[s:e].double() - want).norm() / want.norm()).item() < 1e-6


def test_grouped_gemm_accumulates_and_adds_bias():
    ends, gx, gdy, gw = _grouped_operands([16, 32, 0])
    base = fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, out_dtype=torch.float32)
    main_grad = torch.ones(3, 48, 64)
    got = fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, out=main_grad, accumulate=True)
    assert got is main_grad and torch.allclose(main_grad, base + 1)
    bias = torch.randn(3, 48)
    y = fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, out_dtype=torch.float32)
    yb = fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, out_dtype=torch.float32, bias=bias)
    assert torch.allclose(yb[:16], y[:16] + bias[0]) and torch.allclose(yb[16:], y[16:] + bias[1])


GEMM_ERRORS = [
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx, gw.rowwise), TypeError, ["GroupedNVFP4Data", "a.rowwise"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx.rowwise, gx.columnwise), ValueError, ["'rows' copy", "'columns'"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx.rowwise, gw.columnwise), ValueError, ["their K must match"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, [10, 64]), ValueError, ["2 group ends", "3"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, out_dtype=torch.float16), TypeError,
     ["out_dtype is torch.float16"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, accumulate=True), ValueError,
     ["accumulate=True", "out is None"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, bias=torch.zeros(3, 48)), ValueError,
     ["takes none"]),
    (lambda gx, gdy, gw: fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, bias=torch.zeros(48)), ValueError,
     ["bias must be [E, N] = [3, 48]"]),
]


@pytest.mark.parametrize("call,error,fragments", GEMM_ERRORS)
def test_grouped_gemm_errors(call, error, fragments):
    _, gx, gdy, gw = _grouped_operands([10, 0, 54])
    with pytest.raises(error) as info:
        call(gx, gdy, gw)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_equals_a_loop_of_linear_layers(bias):
    """Group sizes multiple of 16 (so that each fp4gen.nn.Linear can run wgrad on its slice): every output
    and gradient equals the loop's, since each group is quantized exactly as a dense call on its slice."""
    torch.manual_seed(5)
    sizes = [16, 0, 48, 32]
    ends, starts = _ends(sizes), [0] + _ends(sizes)[:-1]
    layer = fp4gen.nn.GroupedLinear(4, 64, 128, bias=bias)
    x = torch.randn(ends[-1], 64, requires_grad=True)
    dy = torch.randn(ends[-1], 128)
    layer(x, torch.tensor(ends)).backward(dy)
    x_loop = x.detach().clone().requires_grad_(True)
    for e, (s, t) in enumerate(zip(starts, ends)):
        linear = fp4gen.nn.Linear(64, 128, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(layer.weight[e])
            if bias:
                linear.bias.copy_(layer.bias[e])
        if t == s:
            assert not layer.weight.grad[e].any()
            continue
        y = linear(x_loop[s:t])
        y.backward(dy[s:t])
        assert torch.equal(layer.weight.grad[e], linear.weight.grad)
        if bias:
            assert torch.allclose(layer.bias.grad[e], linear.bias.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(x.grad, x_loop.grad)


UNKEPT_RECIPES = {"1x16-4o6": fp4gen.Recipe(weight_block=(1, 16), four_over_six="weights"),  # options on W's copies
                  "default": fp4gen.Recipe()}  # 16x16 blocks


def check_a_grouped_layer_that_keeps_no_quantized_weight(device, dtype, recipe):
    """GroupedLinear(keep_quantized_weight=False) (for FSDP2): over steps with optimizer updates, the same outputs
    and gradients, byte for byte, as a layer that keeps its quantized weight; no cache is held, and the forward
    saves the weight itself instead of W's columnwise NVFP4 copy (the kept layer saves the copy)."""
    torch.manual_seed(12)
    # no bias: its gradient's index_add_ runs in no fixed order on CUDA, which would part the two runs' weights
    layers = [fp4gen.nn.GroupedLinear(3, 64, 128, recipe=recipe, device=device, dtype=dtype,
                                      keep_quantized_weight=keep) for keep in (True, False)]
    layers[1].load_state_dict(layers[0].state_dict())
    offsets = torch.tensor([16, 16, 40], device=device)
    inputs = [(torch.randn(40, 64, device=device, dtype=dtype), torch.randn(40, 128, device=device, dtype=dtype))
              for _ in range(3)]
    from test_linear import train_recording_saved
    results, saved = zip(*(train_recording_saved(layer, inputs, offsets) for layer in layers))
    for kept, made_again in zip(*results):
        assert torch.equal(kept, made_again)
    assert layers[1]._weight_cache.entry is None
    w_codes = [3, 64, 64]  # W's columnwise codes [E, in, out / 2]
    assert w_codes in [list(t.shape) for t in saved[0] if t.dtype == torch.uint8]
    assert w_codes not in [list(t.shape) for t in saved[1] if t.dtype == torch.uint8]
    assert sum(t.data_ptr() == layers[1].weight.data_ptr() for t in saved[1]) == len(inputs)


@pytest.mark.parametrize("recipe", UNKEPT_RECIPES)
def test_a_grouped_layer_that_keeps_no_quantized_weight_computes_the_same_bytes(recipe):
    check_a_grouped_layer_that_keeps_no_quantized_weight("cpu", torch.float32, UNKEPT_RECIPES[recipe])


def test_a_second_backward_through_the_grouped_layer_raises():
    from test_linear import check_a_second_backward_raises
    torch.manual_seed(8)
    check_a_second_backward_raises(fp4gen.nn.GroupedLinear(3, 64, 64), torch.randn(40, 64), torch.tensor([9, 9, 40]))


def test_grouped_linear_checks_its_arguments():
    with pytest.raises(ValueError, match="multiple of 64"):
        fp4gen.nn.GroupedLinear(2, 48, 64)
    with pytest.raises(ValueError, match="num_experts"):
        fp4gen.nn.GroupedLinear(0, 64, 64)
    with pytest.raises(TypeError, match="keep_quantized_weight must be True or False"):
        fp4gen.nn.GroupedLinear(2, 64, 64, keep_quantized_weight=None)
    layer = fp4gen.nn.GroupedLinear(2, 64, 64)
    with pytest.raises(ValueError, match="2 experts"):
        layer(torch.randn(32, 64), [10, 20, 32])
    with pytest.raises(ValueError, match=r"tokens \[T, 64\]"):
        layer(torch.randn(2, 16, 64), [16, 32])
    with pytest.raises(ValueError, match="offsets\\[-1\\] = 30"):
        layer(torch.randn(32, 64), [10, 30])


@pytest.mark.parametrize("keep", [True, False], ids=["kept weight", "weight quantized in backward"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_grouped_linear_under_torch_compile_matches_eager(stochastic, keep):
    """fullgraph: any graph break raises; the grouped ops are custom ops with fake implementations. With stochastic
    rounding both steps draw from the default state from the same offset."""
    def model(seed):
        torch.manual_seed(seed)
        return fp4gen.nn.GroupedLinear(3, 64, 128, bias=True, recipe=fp4gen.Recipe(stochastic_rounding=stochastic),
                                       keep_quantized_weight=keep)

    eager, compiled_model = model(7), model(7)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(40, 64)
    offsets = torch.tensor([16, 16, 40])
    for layer in (eager, compiled):
        fp4gen.RNGState.default("cpu").reset()
        layer(x, offsets).square().mean().backward()
        assert fp4gen.RNGState.default("cpu").offset.item() == (2 if stochastic else 0)
    for p_eager, p_compiled in zip(eager.parameters(), compiled_model.parameters()):
        assert torch.equal(p_eager.grad, p_compiled.grad)
    torch.optim.SGD(compiled_model.parameters(), lr=0.1).step()  # the next compiled step sees new weights
    loss = compiled(x, torch.tensor([0, 24, 40])).square().mean()
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("op,args", [
    ("quantize_grouped", lambda: (torch.randn(40, 64), torch.tensor([7, 7, 40]), "row", [1, 16], True, True,
                                  "nearest", True, None, torch.empty(0, dtype=torch.int64))),
    ("quantize_grouped", lambda: (torch.randn(3, 32, 64), None, "tensor", [16, 16], True, True, "nearest", False,
                                  "mae", torch.empty(0, dtype=torch.int64))),
])
def test_grouped_custom_ops_pass_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.fp4gen, op), args(), test_utils=_OPCHECKS)


# test_schema is left out: its checks run float8 arithmetic that PyTorch's CPU kernels lack
_OPCHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


def test_grouped_gemm_custom_ops_pass_opcheck():
    no_rng = torch.empty(0, dtype=torch.int64)
    offsets = torch.tensor([7, 7, 40])
    qx = torch.ops.fp4gen.quantize_grouped(torch.randn(40, 64), offsets, "row", [1, 16], True, True, "nearest", True,
                                           None, no_rng)
    qdy = torch.ops.fp4gen.quantize_grouped(torch.randn(40, 32), offsets, "tensor", [1, 16], True, True, "nearest",
                                            True, None, no_rng)
    qw = torch.ops.fp4gen.quantize_grouped(torch.randn(3, 32, 64), None, "tensor", [16, 16], True, True, "nearest",
                                           False, None, no_rng)
    rows, stacked = ("rows", True, 448.0), ("stacked", False, 448.0)
    torch.library.opcheck(torch.ops.fp4gen.grouped_gemm,
                          (*qx[:3], *qw[:3], offsets, *rows, *stacked, torch.float32, torch.randn(3, 32)),
                          test_utils=_OPCHECKS)
    columns_dy, columns_x = ("columns", False, 448.0), ("columns", True, 448.0)
    torch.library.opcheck(torch.ops.fp4gen.grouped_gemm,
                          (*qdy[3:6], *qx[3:6], offsets, *columns_dy, *columns_x, torch.bfloat16),
                          test_utils=_OPCHECKS)
    torch.library.opcheck(torch.ops.fp4gen.grouped_gemm_accumulate,
                          (torch.zeros(3, 32, 64), *qdy[3:6], *qx[3:6], offsets, *columns_dy, *columns_x),
                          test_utils=_OPCHECKS)


def test_grouped_data_checks_what_it_is_given():
    g = fp4gen.quantize_grouped(torch.randn(3, 32, 64), None, scaling="tensor")
    row = g.rowwise
    with pytest.raises(ValueError, match="amax has shape"):
        fp4gen.GroupedNVFP4Data(row.data, row.scale, torch.zeros(5), "stacked", False)
    with pytest.raises(ValueError, match="layout='rowz'"):
        fp4gen.GroupedNVFP4Data(row.data, row.scale, row.amax, "rowz", False)
    with pytest.raises(ValueError, match="must be contiguous"):
        fp4gen.GroupedNVFP4Data(row.data.transpose(0, 1).contiguous().transpose(0, 1), row.scale, row.amax,
                                "stacked", False)
    with pytest.raises(TypeError, match="offsets must be a torch.Tensor"):  # a "rows" copy locates its groups
        fp4gen.GroupedNVFP4Data(row.data[0], row.scale[0], row.amax, "rows", False)
    copy = fp4gen.GroupedNVFP4Data(row.data, row.scale, row.amax, "stacked", False)
    assert copy.groups == 3 and torch.equal(copy.group(1).data, row.data[1])
