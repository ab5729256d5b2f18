"""4over6 block scaling (runtime/four_over_six.py) against a scalar re-implementation written from the rules, and
the properties of its per-block choice."""
import math

import numpy as np
import pytest
import torch

from fp4gen import four_over_six as fos
from fp4gen import reference

FLT_MAX = float(np.finfo(np.float32).max)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes by code


# ---- scalar re-implementation: Python floats, each operation rounded to fp32 ------------------------------
# A single +, -, *, / done in double and then rounded to fp32 is correctly rounded fp32 (double has more than
# 2 * 24 + 2 bits), so f32(a op b) is fl(a op b) for fp32 operands.


def f32(v: float) -> float:
    with np.errstate(all="ignore"):
        return float(np.float32(v))


def e4m3(v: float):
    """RNE to E4M3 of v in [0, 448] (or NaN): (byte, value)."""
    if math.isnan(v):
        return 0x7F, math.nan
    if v == 0:
        return 0, 0.0
    exp = max(math.frexp(v)[1] - 1, -6)  # v in [2^exp, 2^(exp+1)); below 2^-6 the subnormal step 2^-9
    step = 2.0 ** (exp - 3)
    r = round(v / step) * step  # v / step is exact; round() breaks ties to even
    if r < 2.0 ** -6:
        return int(r / 2.0 ** -9), r
    e = math.frexp(r)[1] - 1
    return ((e + 7) << 3) | (int(r / 2.0 ** e * 8) - 8), r


def e2m1(y: float) -> int:
    """Round to the nearest E2M1 value, ties to the even code, saturating; NaN -> 0x7; sign bit iff y < 0."""
    if math.isnan(y):
        return 0x7
    mag = abs(y)
    code = 7 if mag >= 6 else min(range(8), key=lambda c: (abs(GRID[c] - mag), c % 2))
    return code | (8 if y < 0 else 0)


def e2m1_value(code: int) -> float:
    return -GRID[code & 7] if code & 8 else GRID[code & 7]


def scalar_4over6(xs, a, mode, emax):
    """One block (16 values, or a 16x16 tile row-major) with second-level amax a: its map-to-4 and map-to-6
    candidates as (scale byte, codes, error) each, and whether map-to-4 is picked."""
    bamax = max((abs(v) for v in xs if not math.isnan(v)), default=0.0)
    six_emax = f32(6 * emax)
    if a == 0:
        s_enc = 1.0
    elif math.isnan(a):
        s_enc = FLT_MAX  # fminf(NaN, FLT_MAX)
    else:
        s_enc = min(f32(six_emax / a), FLT_MAX)
        s_enc = 1.0 if s_enc == 0 else s_enc
    base = f32(f32(bamax / 6) * s_enc)
    s_dec = f32(1 / s_enc)
    results = []
    for scale_in in (min(f32(base * 1.5), 448.0), min(base, 448.0)):  # map-to-4, map-to-6
        byte, sf = e4m3(scale_in)
        denom = f32(sf * s_dec)
        inv = FLT_MAX if denom == 0 else min(f32(1 / denom), FLT_MAX)
        codes = [e2m1(f32(v * inv)) for v in xs]
        row_errs = []
        for r in range(len(xs) // 16):
            err = 0.0
            for k in range(16):
                x = xs[16 * r + k]
                v = f32(f32(f32(e2m1_value(codes[16 * r + k]) * sf) * a) / six_emax)
                d = f32(v - x)
                err = f32(err + (abs(d) if mode == "mae" else f32(d * d)))
            row_errs.append(err)
        while len(row_errs) > 1:
            h = len(row_errs) // 2
            row_errs = [f32(row_errs[r] + row_errs[r + h]) for r in range(h)]
        results.append((byte, codes, row_errs[0]))
    return results, results[0][2] < results[1][2]


# ---- helpers -----------------------------------------------------------------------------------------------


def run(x, amax, mode, emax=fos.FOUR_OVER_SIX_E4M3_MAX):
    bamax = reference._abs_max_ignore_nan(x, -1)
    return fos.encode_blocks_4over6(x, bamax, amax, mode, emax)


def random_blocks(n, size, seed, emax=256.0):
    """n blocks of `size` values spanning many magnitudes, with zero, NaN and partly-zero blocks, and each
    block's amax: mostly at or above its block amax (row or tensor amaxes), some tiny, 0, Inf or NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, size, generator=g) * torch.exp2(torch.randint(-40, 20, (n, 1), generator=g).float())
    x[0] = 0.0
    x[1, ::3] = 0.0
    x[2, 5] = float("nan")
    x[3] = float("nan")
    # blocks of small integers with a little noise: near the map-to-4 grid, so tiles pick it too
    ints = torch.randint(-4, 5, (n // 4, size), generator=g).float()
    x[10:10 + n // 4] = ints * (1 + 1e-3 * torch.randn(n // 4, size, generator=g)) * x[10:10 + n // 4, :1].abs()
    bamax = reference._abs_max_ignore_nan(x, -1)
    # row or tensor amaxes: at or above the block's, by any factor
    amax = bamax * (1 + torch.rand(n, generator=g)) * torch.exp2(torch.randint(-1, 24, (n,), generator=g).float())
    amax[:n // 8] = bamax[:n // 8]  # and equal to it
    # the integer blocks' base scale 256 * 2^-k for either Emax, so their map-to-4 scale is exact in E4M3
    ints = slice(10, 10 + n // 4)
    amax[ints] = bamax[ints] * (emax / 256.0) * torch.exp2(torch.randint(0, 8, (n // 4,), generator=g).float())
    amax[4::9] = bamax[4::9] * 0.25  # a second-level amax below the block's: the map-to-4 scale saturates
    amax[5::17] = 1e-40
    amax[6], amax[7], amax[8] = 0.0, float("inf"), float("nan")
    return x, amax


def as_bytes(sdec):
    return sdec.view(torch.uint8).tolist()


# ---- bit-exactness ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", fos.MODES)
@pytest.mark.parametrize("emax", [256.0, 448.0])
@pytest.mark.parametrize("size,n", [(16, 300), (256, 40)])
def test_matches_scalar_reimplementation(mode, emax, size, n):
    x, amax = random_blocks(n, size, seed=size + int(emax), emax=emax)
    bamax = reference._abs_max_ignore_nan(x, -1)
    sdec, codes = fos.encode_blocks_4over6(x, bamax, amax, mode, emax)
    (sf4, q4), (sf6, q6) = fos.candidates(x, bamax, amax, emax)
    errs = [fos.block_error(x, q4, sf4, amax, mode, emax), fos.block_error(x, q6, sf6, amax, mode, emax)]
    chose4 = 0
    for i in range(n):
        cands, pick4 = scalar_4over6(x[i].tolist(), amax[i].item(), mode, emax)
        for (byte, q, err), sf, qc, e in zip(cands, (sf4, sf6), (q4, q6), errs):
            assert as_bytes(sf[i:i + 1]) == [byte], i
            assert qc[i].tolist() == q, i
            assert e[i].item() == err or (math.isnan(err) and math.isnan(e[i].item())), i  # error bits too
        byte, q, _ = cands[0 if pick4 else 1]
        assert as_bytes(sdec[i:i + 1]) == [byte], i
        assert codes[i].tolist() == q, i
        chose4 += pick4 and byte != cands[1][0]
    assert 0 < chose4 < n  # both candidates were exercised


@pytest.mark.parametrize("bamax,a,map_to,expect,standard", [(11.15625, 2688.0, 6, 1.0, 1.125),
                                                             (6.25, 1536.0, 4, 1.5, 1.625)])
def test_base_divides_by_6(bamax, a, map_to, expect, standard):
    # base = fl(fl(bamax / 6) * S_enc), not the standard path's fl(bamax * fl(S_enc * fl(1/6))): values where
    # the two land on opposite sides of an E4M3 rounding midpoint (Emax 256)
    x, amax = block(bamax), torch.tensor([a])
    (sf4, _), (sf6, _) = fos.candidates(x, torch.tensor([bamax]), amax)
    assert (sf4 if map_to == 4 else sf6).float().item() == expect
    standard_base = torch.tensor([bamax]) * (fos.global_encode_scale(amax, 256.0) * torch.tensor(1 / 6))
    assert reference._to_e4m3_satfinite(standard_base * (1.5 if map_to == 4 else 1.0)).item() == standard


def test_amax_broadcasts_over_blocks():
    x = torch.randn(3, 5, 16)
    row_amax = x.abs().amax(dim=(1, 2))
    full = run(x, row_amax.reshape(3, 1).expand(3, 5).contiguous(), "mse")
    broadcast = run(x, row_amax.reshape(3, 1), "mse")
    assert as_bytes(full[0]) == as_bytes(broadcast[0]) and torch.equal(full[1], broadcast[1])
    tensor_amax = x.abs().amax().reshape(1)
    assert torch.equal(run(x, tensor_amax, "mae")[1], run(x, tensor_amax.expand(3, 5), "mae")[1])


def test_invalid_mode_and_block_size():
    x = torch.ones(2, 16)
    with pytest.raises(ValueError, match="'mae', 'mse'"):
        run(x, torch.ones(1), "l1")
    with pytest.raises(ValueError, match="16"):
        run(torch.ones(2, 32), torch.ones(1), "mae")


# ---- the choice ---------------------------------------------------------------------------------------------
# Emax = 256 and a = block amax: S_enc = 1536 / a. With a = 4, base = 256, so the map-to-6 scale is 256 and the
# map-to-4 scale 384; the map-to-4 grid is then exactly E2M1 (v = e * 384 * 4 / 1536 = e). With a = 6, base =
# 256 again and the map-to-6 grid is exactly E2M1 while the map-to-4 grid is 1.5 * E2M1.


def block(*values):
    return torch.tensor([list(values) + [0.0] * (16 - len(values))])


@pytest.mark.parametrize("mode", fos.MODES)
def test_picks_map_to_4_when_it_errs_less(mode):
    x = block(4.0, 3.0, 2.0, 1.0, -0.5)  # all on the map-to-4 grid; 3 is off the map-to-6 grid (0.75 * 6 = 4.5)
    sdec, codes = run(x, torch.tensor([4.0]), mode)
    assert sdec.float().tolist() == [384.0]
    assert reference.e2m1_decode(codes).tolist() == x.tolist()


@pytest.mark.parametrize("mode", fos.MODES)
def test_picks_map_to_6_when_it_errs_less(mode):
    x = block(6.0, 0.5)  # exact on the map-to-6 grid; 0.5 is off the map-to-4 grid {0, 0.75, ...}
    sdec, codes = run(x, torch.tensor([6.0]), mode)
    assert sdec.float().tolist() == [256.0]
    assert reference.e2m1_decode(codes).tolist() == x.tolist()


@pytest.mark.parametrize("mode", fos.MODES)
def test_exact_tie_keeps_map_to_6(mode):
    # 6, 3, 1.5 and 0 lie on both grids (1.5 * {4, 2, 1, 0} and {6, 3, 1.5, 0}): both errors are exactly 0
    x = block(6.0, 3.0, -1.5, 0.0, 6.0)
    (sf4, q4), (sf6, q6) = fos.candidates(x, reference._abs_max_ignore_nan(x, -1), torch.tensor([6.0]))
    assert fos.block_error(x, q4, sf4, torch.tensor([6.0]), mode).item() == 0.0
    assert fos.block_error(x, q6, sf6, torch.tensor([6.0]), mode).item() == 0.0
    sdec, codes = run(x, torch.tensor([6.0]), mode)
    assert sdec.float().tolist() == [256.0] and torch.equal(codes, q6)
    # an all-zero block (amax 0): both candidates are scale 0 with zero codes, error 0
    sdec, codes = run(torch.zeros(1, 256), torch.tensor([0.0]), mode)
    assert as_bytes(sdec) == [0] and not codes.any()


@pytest.mark.parametrize("mode", fos.MODES)
def test_tile_error_is_summed_over_its_rows(mode):
    # one row of the tile decides: the map-to-4 row from above in row 9, the rest zero -> map-to-4
    x = torch.zeros(16, 16)
    x[9, :5] = torch.tensor([4.0, 3.0, 2.0, 1.0, -0.5])
    sdec, codes = run(x.reshape(1, 256), torch.tensor([4.0]), mode)
    assert sdec.float().tolist() == [384.0]
    assert torch.equal(reference.e2m1_decode(codes).reshape(16, 16), x)


# ---- properties on random data ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", fos.MODES)
@pytest.mark.parametrize("emax", [256.0, 448.0])
@pytest.mark.parametrize("size", [16, 256])
def test_chosen_error_never_exceeds_map_to_6(mode, emax, size):
    # the standard-style candidate is always available, so the chosen error is min(err4, err6) <= err6
    torch.manual_seed(3)
    x = torch.randn(2048 // size * 8, size)
    amax = x.abs().amax().reshape(1)
    bamax = reference._abs_max_ignore_nan(x, -1)
    sdec, codes = fos.encode_blocks_4over6(x, bamax, amax, mode, emax)
    _, (sf6, q6) = fos.candidates(x, bamax, amax, emax)
    chosen = fos.block_error(x, codes, sdec, amax, mode, emax)
    err6 = fos.block_error(x, q6, sf6, amax, mode, emax)
    assert (chosen <= err6).all()
    if size == 16:  # on Gaussian data 256-element tiles almost never favour map-to-4; 1x16 blocks do
        assert (chosen < err6).any()
    assert chosen.double().mean() <= err6.double().mean()


@pytest.mark.parametrize("mode", fos.MODES)
@pytest.mark.parametrize("emax", [256.0, 448.0])
def test_map_to_4_blocks_top_out_at_4(mode, emax):
    # Not true of every map-to-4 block: where fl(base * 1.5) is clamped to 448 (Emax = 448, or a second-level
    # amax below the block's) or the scale rounds in E4M3's subnormal range, the scale can be far below
    # 1.5 * base and codes up to 6 occur (next test). Where the scale is normal (>= 2^-6) and below 448, it is
    # within a factor 1 +- 1/15 of 1.5 * base (3 mantissa bits), so the block maximum scales to about
    # 4 / (1 +- 1/15), inside (3.5, 5), and rounds to exactly 4, with every other element at or below it.
    # (NaN elements encode as 6, but their error is NaN, so such blocks keep map-to-6.)
    x, amax = random_blocks(600, 16, seed=7, emax=emax)
    sdec, codes = run(x, amax, mode, emax)
    (sf4, _), (sf6, _) = fos.candidates(x, reference._abs_max_ignore_nan(x, -1), amax, emax)
    chose4 = (sdec.view(torch.uint8) == sf4.view(torch.uint8)) & (sf4.view(torch.uint8) != sf6.view(torch.uint8))
    regular = chose4 & (sdec.float() >= 2.0 ** -6) & (sdec.float() < 448.0)
    assert regular.sum() > 20
    top = reference.e2m1_decode(codes).abs().amax(-1)
    assert (top[regular] == 4.0).all()


def test_saturated_map_to_4_scale_can_hold_a_6():
    # why the property above needs its conditions: Emax 448, bamax 6, a = 6.72 gives base = 400, so the map-to-4
    # scale fl(400 * 1.5) clamps to 448 and the block maximum scales to 6 * 400 / 448 = 5.36 -> code 6; that
    # candidate (grid 1.12 * E2M1) still has the smaller absolute error than map-to-6 (scale 384, grid 0.96 * E2M1)
    sdec, codes = run(block(6.0, 3.36, 1.12), torch.tensor([6.72]), "mae", 448.0)
    assert sdec.float().tolist() == [448.0]
    assert reference.e2m1_decode(codes)[0, :3].tolist() == [6.0, 3.0, 1.0]


@pytest.mark.parametrize("mode", fos.MODES)
def test_nan_element(mode):
    x = block(4.0, 3.0, 2.0, float("nan"), 1.0)  # without the NaN this block picks map-to-4 (test above)
    bamax = reference._abs_max_ignore_nan(x, -1)
    assert bamax.tolist() == [4.0]  # the block amax ignores NaN
    sdec, codes = run(x, torch.tensor([4.0]), mode)
    assert sdec.float().tolist() == [256.0]  # the NaN error compares false: map-to-6
    assert codes[0, 3].item() == 0x7  # as the round-to-nearest encoder encodes NaN
    _, (sf6, q6) = fos.candidates(x, bamax, torch.tensor([4.0]))
    assert torch.equal(codes, q6)
    # a NaN second-level amax (fp4gen propagates it): S_enc = FLT_MAX (fminf), every error NaN -> map-to-6.
    # A block of tiny values, so that base = bamax / 6 * FLT_MAX stays below 448 and the candidates differ.
    x, nan = block(4.0, 3.0, 2.0, 1.0) * 1e-37, torch.tensor([float("nan")])
    bamax = reference._abs_max_ignore_nan(x, -1)
    (sf4, q4), (sf6, q6) = fos.candidates(x, bamax, nan)
    assert as_bytes(sf4) != as_bytes(sf6)
    assert torch.isnan(fos.block_error(x, q4, sf4, nan, mode)).all()
    sdec, codes = run(x, nan, mode)
    assert as_bytes(sdec) == as_bytes(sf6) and torch.equal(codes, q6)


def test_two_divisions_give_the_eight_error_values_where_the_kernels_take_them():
    """The CUDA kernels' error values v_m = fl(fl(fl(e2m1_m * scale) * amax) / 1536) come from two divisions,
    v_m = 2^j * fl(p / 1536) with p = fl(scale * amax) or fl(fl(1.5 * scale) * amax), wherever
    fl(scale * amax) >= 2^-114 and fl(1.5 * scale * amax) <= 2^125 (four_over_six.cuh); elsewhere they divide
    eight times. Checked here in fp32 for every finite E4M3 scale against amaxes across the whole float range."""
    f = np.float32
    magnitudes = np.array(GRID, dtype=f)
    scales = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # 0x7F is NaN
    rng = np.random.default_rng(0)
    amaxes = np.concatenate([rng.integers(0, 0x7F800000, size=20000, dtype=np.uint32).view(f),
                             np.array([2.0 ** k for k in range(-149, 128)], dtype=f)])
    in_range = 0
    with np.errstate(all="ignore"):
        for scale in scales:
            eight = (magnitudes[:, None] * scale).astype(f) * amaxes[None, :] / f(1536)
            unit, unit_and_half = scale * amaxes, (scale * f(1.5)) * amaxes
            taken = (unit >= f(2.0 ** -114)) & (unit_and_half <= f(2.0 ** 125))
            v1, v15 = unit / f(1536), unit_and_half / f(1536)
            two = np.stack([np.zeros_like(v1), v1 * f(0.5), v1, v15, v1 * f(2), v15 * f(2), v1 * f(4), v15 * f(4)])
            assert two.dtype == eight.dtype == np.float32
            assert np.array_equal(two[:, taken], eight[:, taken])
            in_range += int(taken.sum())
    assert in_range > len(scales) * len(amaxes) // 2  # most pairs take the two divisions
