"""Random cases on the CUDA backend, seeded: shapes drawn with tails (row counts off the 16 grid, no rows at all,
rows wide enough for several row-pass CTAs), every dtype, option, scaling, block and copy, row strides wider than
the rows, skewed and empty routings. Each case is checked as the fixed-shape tests check theirs: quantization
byte for byte against the reference backend, and GEMMs against a float64 product of the dequantized operands
(allowing for an fp32 sum's rounding). Linear and GroupedLinear steps with random recipes, token counts and
input ranks are compared with the same steps on the CPU (the reference backend). A failure names its case."""
import random

import pytest
import torch

import fp4gen
from conftest import bit_patterns, dequantize_f64, relative_error

pytestmark = pytest.mark.gpu

OPTIONS = [{}, dict(rounding="stochastic"), dict(hadamard=True), dict(rounding="stochastic", hadamard=True),
           dict(four_over_six="mae"), dict(four_over_six="mse"), dict(four_over_six="mse", hadamard=True)]
SEEDS = range(12)
RECIPES = [dict(), dict(stochastic_rounding=True), dict(gradient_scaling="row"), dict(hadamard_wgrad=False),
           dict(weight_block=(1, 16)), dict(four_over_six="all"), dict(row_scaled_activation=False),
           dict(gradient_scaling="row", stochastic_rounding=True)]


def _same_copies(got, want, case):
    for copy in ("rowwise", "columnwise"):
        a, b = getattr(got, copy), getattr(want, copy)
        assert (a is None) == (b is None), f"{case}: {copy}"
        if a is None:
            continue
        assert a.e4m3_max == b.e4m3_max, f"{case}: {copy}.e4m3_max"
        for field in ("data", "scale", "amax"):
            x, y = bit_patterns(getattr(a, field)), bit_patterns(getattr(b, field))
            assert x.shape == y.shape, f"{case}: {copy}.{field} shape {tuple(x.shape)} against {tuple(y.shape)}"
            assert torch.equal(x, y), f"{case}: {copy}.{field} differs in {(x != y).sum().item()} of {x.numel()}"


def _assert_product(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *addends: torch.Tensor, tol: float,
                    case: str):
    """got against a @ b.T + addends (a, b float64): relative Frobenius error below tol, plus 1e-6 of the size of
    what is summed, || |a| @ |b|.T + |addends| ||. An fp32 sum is only exact to a fraction of its terms' size:
    with the transform, a token 2^60 larger than the rest of its 16 makes the products cancel to 1e-17 of their
    size, where the result's relative error measures only the cancellation (a CPU fp32 matmul misses it by 1e8)."""
    got, a, b = got.double().cpu(), a.cpu(), b.cpu()
    want, size = a @ b.t(), a.abs() @ b.abs().t()
    for addend in addends:
        want, size = want + addend.double().cpu(), size + addend.double().cpu().abs()
    err, bound = (got - want).norm().item(), tol * want.norm().item() + 1e-6 * size.norm().item()
    assert err <= bound, f"{case}: error {err:.3g}, relative {err / max(want.norm().item(), 1e-300):.3g}, " \
                         f"bound {bound:.3g}"


def _data(rng, rows, cols, dtype, stride_pad=0):
    """Random rows: normal, with row magnitudes spread by 2^+-8 or (with column spreads too) 2^+-30, or sparse."""
    g = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    kind = rng.choice(["plain", "rows", "heavy", "sparse"])
    x = torch.randn(rows, cols + stride_pad, device="cuda", generator=g)
    if kind in ("rows", "heavy"):
        spread = 8 if kind == "rows" else 30
        x *= torch.exp2(torch.randint(-spread, spread + 1, (rows, 1), device="cuda", generator=g).float())
    if kind == "heavy":
        x *= torch.exp2(torch.randint(-20, 21, (1, cols + stride_pad), device="cuda", generator=g).float())
    if kind == "sparse":
        x *= torch.rand(rows, cols + stride_pad, device="cuda", generator=g) < 0.1
    x = x.to(dtype)
    return x[:, :cols] if stride_pad else x


def _states(rng, options):
    """The same random state twice (one for each backend) where the options round stochastically."""
    if options.get("rounding") != "stochastic":
        return {}, {}
    seed = rng.randrange(1 << 40)
    return dict(rng=fp4gen.RNGState(seed, device="cuda")), dict(rng=fp4gen.RNGState(seed, device="cuda"))


def _ends(rng, tokens, groups):
    """Cumulative group ends: random cuts, or most tokens to a few groups and none to the others."""
    if groups > 1 and rng.random() < 0.3:
        return sorted([0] * (groups // 2) + [tokens] * (groups - 1 - groups // 2)) + [tokens]
    return sorted(rng.randint(0, tokens) for _ in range(groups - 1)) + [tokens]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_quantize_calls_equal_reference(seed):
    rng = random.Random(seed)
    for _ in range(6):
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        options = dict(rng.choice(OPTIONS))
        scaling, block = rng.choice([("row", (1, 16)), ("tensor", (1, 16)), ("tensor", (16, 16))])
        if options.get("hadamard"):
            block = (1, 16)
        rowwise, columnwise = (False, True) if options.get("hadamard") and rng.random() < 0.3 else \
            rng.choice([(True, True), (True, False), (False, True)])
        columnwise = columnwise or bool(options.get("hadamard"))
        cols = 16 * rng.choice([rng.randint(1, 64), rng.randint(1, 700), rng.randint(900, 1100)])
        rows = rng.choice([0, rng.randint(1, 300), rng.randint(1, 4000)])
        if columnwise or block == (16, 16):
            rows = rows // 16 * 16
        elem = torch.empty(0, dtype=dtype).element_size()
        pad = rng.choice([0, 0, 16 // elem * rng.randint(1, 8)])  # rows that start 16 bytes apart, wider than x
        x = _data(rng, rows, cols, dtype, pad)
        gpu_state, ref_state = _states(rng, options)
        kwargs = dict(scaling=scaling, block=block, rowwise=rowwise, columnwise=columnwise, **options)
        case = f"quantize {tuple(x.shape)} row stride {x.stride(0)} {dtype} {kwargs}"
        _same_copies(fp4gen.quantize(x, **kwargs, **gpu_state),
                     fp4gen.quantize(x, backend="reference", **kwargs, **ref_state), case)


def _operand(rng, rows, k):
    x = _data(rng, rows, k, rng.choice([torch.bfloat16, torch.float32]))
    scaling = rng.choice(["row", "tensor"])
    options = rng.choice([{}, {}, dict(four_over_six="mae")])
    if rows % 16 == 0 and rng.random() < 0.3:  # the columnwise copy of x.T, an operand of `rows` rows too
        return fp4gen.quantize(x.t().contiguous(), scaling=scaling, rowwise=False, **options).columnwise
    return fp4gen.quantize(x, scaling=scaling, columnwise=False, **options).rowwise


@pytest.mark.parametrize("seed", SEEDS)
def test_random_gemms_match_float64(seed):
    rng = random.Random(seed)
    for _ in range(4):
        m = rng.choice([rng.randint(1, 40), rng.randint(1, 300), rng.randint(200, 5000)])
        n = rng.choice([rng.randint(1, 300), rng.randint(16, 4000)])
        k = 16 * rng.choice([rng.randint(1, 16), rng.randint(1, 300)])
        a, b = _operand(rng, m, k), _operand(rng, n, k)
        out_dtype = rng.choice([torch.bfloat16, torch.float32])
        bias = torch.randn(n, device="cuda").to(rng.choice([torch.bfloat16, torch.float32])) \
            if rng.random() < 0.3 else None
        out = torch.randn(m, n, device="cuda").to(out_dtype) if rng.random() < 0.2 else None
        addends = [t for t in (bias, None if out is None else out.clone()) if t is not None]
        case = (f"gemm {m}x{n}x{k} a row-scaled {a.row_scaled} e4m3_max {a.e4m3_max}, b row-scaled {b.row_scaled} "
                f"e4m3_max {b.e4m3_max}, {out_dtype}, bias {bias is not None}, accumulate {out is not None}")
        d = fp4gen.gemm(a, b, out_dtype=out_dtype, out=out, accumulate=out is not None, bias=bias)
        assert d.shape == (m, n) and d.dtype == out_dtype, case
        assert torch.isfinite(d).all(), case
        _assert_product(d, dequantize_f64(a), dequantize_f64(b), *addends,
                        tol=1e-2 if out_dtype == torch.bfloat16 else 1e-5, case=case)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_grouped_quantize_calls_equal_reference(seed):
    rng = random.Random(seed)
    for _ in range(4):
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        options = dict(rng.choice(OPTIONS))
        scaling = rng.choice(["row", "tensor"])
        k = 16 * rng.randint(1, 200)
        if rng.random() < 0.3:  # stacked expert weights
            experts, n = rng.randint(1, 12), 16 * rng.randint(0, 40)
            x = torch.stack([_data(rng, n, k, dtype) for _ in range(experts)])
            ends = None
            block = rng.choice([(1, 16), (16, 16)]) if scaling == "tensor" and not options.get("hadamard") \
                else (1, 16)
        else:
            tokens, groups = rng.choice([0, rng.randint(1, 3000)]), rng.randint(1, 20)
            x = _data(rng, tokens, k, dtype)
            ends = _ends(rng, tokens, groups)
            block = (1, 16)
        gpu_state, ref_state = _states(rng, options)
        case = f"quantize_grouped {tuple(x.shape)} {dtype} {scaling} {block} {options} ends {ends}"
        offsets = None if ends is None else torch.tensor(ends, dtype=torch.int32, device="cuda")
        got = fp4gen.quantize_grouped(x, offsets, scaling=scaling, block=block, **options, **gpu_state)
        want = fp4gen.quantize_grouped(x, ends, scaling=scaling, block=block, backend="reference", **options,
                                       **ref_state)
        _same_copies(got, want, case)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_grouped_gemms_match_float64(seed):
    rng = random.Random(seed)
    for _ in range(3):
        groups, tokens = rng.randint(1, 12), rng.choice([0, rng.randint(1, 2500)])
        ends = _ends(rng, tokens, groups)
        offsets = torch.tensor(ends, dtype=torch.int64, device="cuda")
        starts = [0] + ends[:-1]
        n, k = 64 * rng.randint(1, 12), 64 * rng.randint(1, 12)
        out_dtype = rng.choice([torch.bfloat16, torch.float32])
        tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
        scaling = rng.choice(["row", "tensor"])
        if rng.random() < 0.5:  # groups along M: tokens [T, K] times stacked weights [E, N, K]
            x = _data(rng, tokens, k, torch.bfloat16)
            w = torch.stack([_data(rng, n, k, torch.bfloat16) for _ in range(groups)])
            qx = fp4gen.quantize_grouped(x, offsets, scaling=scaling, columnwise=False).rowwise
            qw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16), columnwise=False).rowwise
            case = f"grouped_gemm along M, {tokens} tokens x {k} -> {n}, {scaling}, {out_dtype}, ends {ends}"
            d = fp4gen.grouped_gemm(qx, qw, offsets, out_dtype=out_dtype)
            assert d.shape == (tokens, n), case
            for g in range(groups):
                if ends[g] > starts[g]:
                    _assert_product(d[starts[g]:ends[g]], dequantize_f64(qx.group(g)), dequantize_f64(qw.group(g)),
                                    tol=tol, case=f"{case}: group {g}")
        else:  # groups along K: dY's and X's columnwise copies -> one [N, K] matrix a group
            options = rng.choice([{}, dict(hadamard=True)])
            qdy = fp4gen.quantize_grouped(_data(rng, tokens, n, torch.bfloat16), offsets, scaling=scaling,
                                          rowwise=False, **options).columnwise
            qx = fp4gen.quantize_grouped(_data(rng, tokens, k, torch.bfloat16), offsets, scaling=scaling,
                                         rowwise=False, **options).columnwise
            case = f"grouped_gemm along K, {tokens} tokens, {n} x {k}, {scaling} {options}, {out_dtype}, ends {ends}"
            d = fp4gen.grouped_gemm(qdy, qx, offsets, out_dtype=out_dtype)
            assert d.shape == (groups, n, k), case
            for g in range(groups):
                if ends[g] == starts[g]:
                    assert torch.count_nonzero(d[g]) == 0, f"{case}: group {g} has no tokens but a nonzero result"
                    continue
                _assert_product(d[g], dequantize_f64(qdy.group(g)), dequantize_f64(qx.group(g)), tol=tol,
                                case=f"{case}: group {g}")


def _layer_steps(cpu_layer, gpu_layer, x, dy, *args):
    """(y, dx, dw, db) of a forward and backward of each layer, the random state of each device reset alike."""
    results = []
    for layer, device in ((cpu_layer, "cpu"), (gpu_layer, "cuda")):
        fp4gen.RNGState.default(torch.device(device)).reset(1234)
        xi = x.to(device, copy=True).requires_grad_()  # a copy on the CPU too: x itself never requires grad
        y = layer(xi, *(a.to(device) for a in args))
        y.backward(dy.to(device))
        results.append([y, xi.grad, layer.weight.grad] + ([layer.bias.grad] if layer.bias is not None else []))
    return results


def _assert_close_steps(cpu, gpu, case):
    for name, want, got in zip(("y", "dx", "dw", "db"), cpu, gpu):
        assert got.shape == want.shape and got.dtype == want.dtype, f"{case}: {name}"
        assert torch.isfinite(got).all(), f"{case}: {name} is not finite"
        if want.numel() == 0 or not want.any():
            assert not got.any(), f"{case}: {name} should be zeros"
            continue
        err = relative_error(got, want)
        assert err < 2e-2, f"{case}: {name} relative difference {err:.3g}"


@pytest.mark.parametrize("seed", SEEDS)
def test_random_linear_steps_match_the_cpu(seed):
    rng = random.Random(seed)
    for _ in range(2):
        fin, fout = 16 * rng.randint(1, 40), 16 * rng.randint(1, 40)
        tokens = rng.choice([0, rng.randint(1, 40), rng.randint(1, 700)])
        dtype = rng.choice([torch.bfloat16, torch.float32])
        recipe = fp4gen.Recipe(**rng.choice(RECIPES))
        bias = rng.random() < 0.5
        torch.manual_seed(rng.randrange(1 << 30))
        cpu = fp4gen.nn.Linear(fin, fout, bias=bias, recipe=recipe, dtype=dtype)
        gpu = fp4gen.nn.Linear(fin, fout, bias=bias, recipe=recipe, dtype=dtype, device="cuda")
        gpu.load_state_dict(cpu.state_dict())
        shape = (tokens, fin) if rng.random() < 0.5 else (2, tokens, fin)
        x, dy = torch.randn(*shape, dtype=dtype) * 3, torch.randn(*shape[:-1], fout, dtype=dtype)
        cpu_out, gpu_out = _layer_steps(cpu, gpu, x, dy)
        _assert_close_steps(cpu_out, gpu_out, f"Linear {shape} -> {fout} {dtype} bias {bias} {recipe}")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_grouped_linear_steps_match_the_cpu(seed):
    rng = random.Random(seed)
    groups, fin, fout = rng.randint(1, 10), 64 * rng.randint(1, 6), 64 * rng.randint(1, 6)
    tokens = 0 if rng.random() < 0.2 else rng.randint(1, 1500)
    ends = _ends(rng, tokens, groups)
    recipe = fp4gen.Recipe(**rng.choice(RECIPES[:4]))
    bias = rng.random() < 0.5
    torch.manual_seed(rng.randrange(1 << 30))
    cpu = fp4gen.nn.GroupedLinear(groups, fin, fout, bias=bias, recipe=recipe, dtype=torch.bfloat16)
    gpu = fp4gen.nn.GroupedLinear(groups, fin, fout, bias=bias, recipe=recipe, dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x, dy = torch.randn(tokens, fin, dtype=torch.bfloat16) * 2, torch.randn(tokens, fout, dtype=torch.bfloat16)
    cpu_out, gpu_out = _layer_steps(cpu, gpu, x, dy, torch.tensor(ends))
    _assert_close_steps(cpu_out, gpu_out, f"GroupedLinear {groups} x {fin} -> {fout}, {tokens} tokens, bias {bias}, "
                                          f"{recipe}, ends {ends}")
