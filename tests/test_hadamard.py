"""The 16-point random Hadamard transform (fp4gen.hadamard) against independent computations and the
TransformerEngine golden vector."""
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_check_program
from fp4gen.hadamard import RHT_SIGN_MASK, apply_rht, rht_matrix
from fp4gen.reference import _quantize_1d

GOLDEN = Path(__file__).parent / "golden" / "rht_bf16_64x128_normal.npz"
SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # the recipe's s, written out


def _rht_f64(xt: torch.Tensor) -> torch.Tensor:
    """g @ H for every 16-element group of every row, in float64 (no rounding anywhere for our data)."""
    rows, cols = xt.shape
    groups = xt.double().reshape(rows, cols // 16, 16)
    return (groups @ rht_matrix().double()).reshape(rows, cols)


def _grid_normal(shape, dtype, seed) -> torch.Tensor:
    """Normal values rounded to multiples of 2^-6 (|x| < 8): every group sum is exact in fp32 in any order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.round(torch.randn(shape, generator=g) * 64) / 64).to(dtype)


# ---- the matrix ---------------------------------------------------------------------------------------------


def test_matrix_is_quarter_sign_rows_times_sylvester():
    h = rht_matrix()
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    h16 = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    assert torch.equal(h16[:2, :2], torch.tensor([[1.0, 1.0], [1.0, -1.0]]))  # Sylvester's first step
    signs = torch.tensor([-1.0 if (RHT_SIGN_MASK >> i) & 1 else 1.0 for i in range(16)])
    assert signs.tolist() == SIGNS
    assert torch.equal(h, signs.reshape(-1, 1) * h16 / 4)  # diag(s) on the rows
    assert not torch.equal(h, h.t())


def test_matrix_is_orthogonal():
    h = rht_matrix().double()
    assert torch.equal(h @ h.t(), torch.eye(16, dtype=torch.float64))


# ---- the transform ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_float64_rounded_to_bf16(dtype):
    xt = _grid_normal((48, 256), dtype, seed=1)
    exact = _rht_f64(xt)
    assert torch.equal(exact.float().double(), exact)  # the precondition: fp32 holds every sum exactly
    out = apply_rht(xt)
    assert out.dtype == torch.bfloat16 and out.shape == xt.shape
    assert torch.equal(out.view(torch.int16), exact.float().to(torch.bfloat16).view(torch.int16))


def _butterfly_by_hand(g):
    """The documented order, element by element in fp32: u_j = g_j s_j / 4, then stages h = 1, 2, 4, 8."""
    signs = [-1.0 if (0xD7E8 >> j) & 1 else 1.0 for j in range(16)]
    u = [g[j] * (0.25 * signs[j]) for j in range(16)]  # 0-d fp32 tensors: fp32 arithmetic
    for h in (1, 2, 4, 8):
        for j in range(16):
            if not j & h:
                u[j], u[j + h] = u[j] + u[j + h], u[j] - u[j + h]
    return torch.stack(u).to(torch.bfloat16)


def test_sums_in_butterfly_order():
    # 2^26 swamps the small terms in fp32 (its ulp after the 1/4 is 2), so the order of the sum shows
    g = torch.tensor([2.0 ** 26] + [1.5, -3.0, 0.75, 2.5, -1.25, 3.5, 1.0, -0.5, 2.25, 1.75, -2.75, 0.25, 3.25, 1.0]
                     + [-(2.0 ** 26)], dtype=torch.float32)
    h = rht_matrix()
    expected = _butterfly_by_hand(g)
    out = apply_rht(g.reshape(1, 16)).reshape(16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # and the order mattered: the exact sum rounds differently for some output
    exact = (g.double() @ h.double()).float().to(torch.bfloat16)
    assert not torch.equal(exact, expected)


def test_groups_are_independent_and_layout_free():
    xt = _grid_normal((32, 128), torch.bfloat16, seed=2)
    out = apply_rht(xt)
    assert torch.equal(apply_rht(xt.t().contiguous().t()), out)  # a non-contiguous view gives the same
    assert torch.equal(apply_rht(xt[:, 32:64]), out[:, 32:64])
    assert apply_rht(torch.zeros(0, 16)).shape == (0, 16)


def test_non_finite_values_spread_over_their_group_only():
    xt = torch.ones(2, 48)
    xt[0, 20] = float("nan")
    xt[1, 40] = float("inf")
    out = apply_rht(xt).float()
    assert torch.isnan(out[0, 16:32]).all() and torch.isinf(out[1, 32:48]).all()
    clean = apply_rht(torch.ones(2, 48)).float()
    assert torch.equal(out[0, :16], clean[0, :16]) and torch.equal(out[0, 32:], clean[0, 32:])
    assert torch.equal(out[1, :32], clean[1, :32])


@pytest.mark.parametrize("bad, error", [
    (torch.zeros(16), ValueError),
    (torch.zeros(2, 2, 16), ValueError),
    (torch.zeros(4, 24), ValueError),
    (torch.zeros(4, 16, dtype=torch.float64), TypeError),
    (torch.zeros(4, 16, dtype=torch.int32), TypeError),
])
def test_rejects_bad_inputs(bad, error):
    with pytest.raises(error):
        apply_rht(bad)


# ---- why it is allowed: the wgrad product is invariant ------------------------------------------------------


def test_wgrad_product_is_invariant():
    g = torch.Generator().manual_seed(3)
    m, k, n = 256, 96, 80
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    want = dy.double().t() @ x.double()
    # unrounded, the transform changes nothing but float64 rounding
    exact = _rht_f64(dy.t()) @ _rht_f64(x.t()).t()
    assert torch.allclose(exact, want, rtol=0, atol=1e-10)
    # rounded to bf16, it changes the product only by about bf16's precision
    got = apply_rht(dy.t()).double() @ apply_rht(x.t()).double().t()
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-2


# ---- the golden vector --------------------------------------------------------------------------------------


def test_golden_vector_bytes():
    z = np.load(GOLDEN)
    x = torch.from_numpy(z["x_f32"]).to(torch.bfloat16)

    def check(q, suffix):
        assert np.array_equal(q.data.numpy(), z["data" + suffix])
        assert np.array_equal(q.scale.view(torch.uint8).numpy(), z["scale" + suffix])
        assert np.array_equal(q.amax.numpy().view(np.uint32), z["amax" + suffix].view(np.uint32))

    # columnwise: plain 1x16 per-tensor quantization of RHT(x.T), with the amax taken after the transform
    xt = apply_rht(x.t()).float()
    check(_quantize_1d(xt, xt.abs().amax().reshape(1)), "_t")
    # rowwise: untouched, with the amax of x itself
    xf = x.float()
    check(_quantize_1d(xf, xf.abs().amax().reshape(1)), "")
    assert z["amax_t"][0] != z["amax"][0]  # the two copies really do use different amaxes


def test_nan_outputs_are_the_canonical_quiet_nan():
    # +Inf meeting -Inf makes NaNs; whatever payload the arithmetic gives, the output is bf16 0x7FC0, so that
    # the post-transform amax has the same bits on every backend
    g = torch.zeros(1, 16)
    g[0, 3], g[0, 5] = float("inf"), -float("inf")
    out = apply_rht(g).view(torch.int16)[0]
    nan = torch.isnan(apply_rht(g)[0])
    assert nan.any() and (out[nan] == 0x7FC0).all()


# ---- the kernels' first butterfly stage -----------------------------------------------------------------------

@pytest.mark.nvcc
def test_kernels_fused_first_stage_gives_the_quartered_values(tmp_path):
    """The kernels' transform of 16-bit inputs folds the quarter into its first stage's fused multiply-adds
    (hadamard.cuh). tests/cuda/hadamard_exhaustive.cu runs that very code on the CPU: every bf16 and fp16 pattern in
    every place of a vector must give the bits of quartering first, and fp32 subnormals (the control) must not."""
    lines = run_check_program(tmp_path, "hadamard_exhaustive", timeout=600)
    assert [line.split(":")[0] for line in lines] == ["bf16", "fp16", "fp32 subnormals (control, expected to differ)"]
    assert lines[0].endswith(" 0 mismatches") and lines[1].endswith(" 0 mismatches"), lines
    assert not lines[2].endswith(" 0 mismatches"), lines
