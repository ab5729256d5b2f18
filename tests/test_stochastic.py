"""Stochastic rounding's building blocks on the reference backend: Philox4x32-10, the layout of a copy's
random bytes, and the E2M1 stochastic rounding rule."""
import pytest
import torch

import fp4gen
from fp4gen import reference
from fp4gen.stochastic import e2m1_encode_stochastic, philox4x32, random_bytes

M32 = 0xFFFFFFFF
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _t(*values, device="cpu"):
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in values)


def _philox_scalar(c, k):
    """Philox4x32-10 in Python integers, written from the Random123 definition (no overflow to dodge)."""
    c, k = list(c), list(k)
    for i in range(10):
        if i:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return tuple(c)


# ---- Philox4x32-10 ---------------------------------------------------------------------------------------

# Random123's known-answer tests for philox4x32_10 (kat_vectors): counter, key, output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected, device):
    out = philox4x32(_t(*counter, device=device), _t(*key, device=device))
    assert tuple(int(w) for w in out) == expected
    assert _philox_scalar(counter, key) == expected  # the test's own model agrees too


def test_philox_matches_scalar_model_on_random_words_and_broadcasts():
    g = torch.Generator().manual_seed(0)
    c = [torch.randint(0, 1 << 32, (64,), generator=g) for _ in range(4)]
    k = _t(0xDEADBEEF, 0x12345678)  # 0-d key broadcasts over the counters
    out = torch.stack(philox4x32(c, k), dim=-1)
    assert out.dtype == torch.int64 and out.shape == (64, 4) and (out >= 0).all() and (out <= M32).all()
    for i in range(64):
        assert tuple(out[i].tolist()) == _philox_scalar([int(w[i]) for w in c], (0xDEADBEEF, 0x12345678))


# ---- random bytes of a copy ------------------------------------------------------------------------------

def _block_bytes(seed, offset, b):
    """Block b's 16 bytes by the documented rule, from the scalar model."""
    words = _philox_scalar((b & M32, b >> 32, offset & M32, offset >> 32), (seed & M32, seed >> 32))
    return [(w >> (8 * i)) & 0xFF for w in words for i in range(4)]


def test_random_bytes_of_seed_0_offset_0_are_the_first_kat_little_endian():
    expected = [0xD5, 0xE8, 0x27, 0x66, 0x8D, 0xC5, 0x69, 0xE1, 0x4C, 0xAC, 0x57, 0xBC, 0xD8, 0xDB, 0x00, 0x9B]
    out = random_bytes(0, 0, 1, 16, "cpu")
    assert out.dtype == torch.uint8 and out.shape == (1, 16) and out[0].tolist() == expected


@pytest.mark.parametrize("seed,offset", [(1234, 0), (0x299F31D0A4093822, 7), (2**64 - 1, 2**40 + 3)])
def test_random_bytes_layout(seed, offset):
    rows, cols = 3, 48
    out = random_bytes(seed, offset, rows, cols, "cpu").flatten().tolist()
    for b in range(rows * cols // 16):
        assert out[16 * b:16 * b + 16] == _block_bytes(seed, offset, b)


def test_random_bytes_depend_on_flat_index_only_and_on_offset_and_seed():
    a = random_bytes(5, 9, 2, 32, "cpu")
    assert torch.equal(a.flatten(), random_bytes(5, 9, 1, 64, "cpu").flatten())
    assert torch.equal(a.flatten(), random_bytes(5, 9, 4, 16, "cpu").flatten())
    assert torch.equal(a.flatten(), random_bytes(5, 9, 8, 32, "cpu").flatten()[:64])  # a prefix of a longer copy
    assert (a != random_bytes(5, 10, 2, 32, "cpu")).float().mean() > 0.9
    assert (a != random_bytes(6, 9, 2, 32, "cpu")).float().mean() > 0.9


@pytest.mark.parametrize("device", DEVICES)
def test_random_bytes_take_device_tensors_with_the_ints_bits(device):
    def as_int64(v):  # from 2^63 up, the int64 with the same bits is negative
        return torch.tensor(v - (1 << 64) if v >= 1 << 63 else v, dtype=torch.int64, device=device)
    for seed, offset in [(42, 3), (2**64 - 5, 2**63 + 1)]:
        from_tensors = random_bytes(as_int64(seed), as_int64(offset), 4, 32, device)
        assert from_tensors.device.type == device
        assert torch.equal(from_tensors.cpu(), random_bytes(seed, offset, 4, 32, "cpu"))


def test_random_bytes_shapes():
    assert random_bytes(1, 0, 0, 32, "cpu").shape == (0, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        random_bytes(1, 0, 16, 8, "cpu")


def test_random_bytes_look_uniform():
    counts = torch.bincount(random_bytes(3, 0, 256, 256, "cpu").flatten().long(), minlength=256).double()
    chi2 = ((counts - 256) ** 2 / 256).sum()  # 255 degrees of freedom: mean 255, sd ~22.6
    assert 150 < chi2 < 380


# ---- the rounding rule -----------------------------------------------------------------------------------

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def _decode(codes):
    return reference.e2m1_decode(codes)


def _round_all(y: float):
    """y rounded with each of the 256 byte values."""
    return _decode(e2m1_encode_stochastic(torch.full((256,), y), ALL_BYTES))


def test_grid_values_stay_for_every_byte():
    for v in GRID:
        for s in (1, -1):
            codes = e2m1_encode_stochastic(torch.full((256,), s * v), ALL_BYTES)
            assert torch.equal(codes, reference.e2m1_encode(torch.full((256,), s * v)))


def _neighbours(a):
    lo = max(g for g in GRID if g <= a)
    hi = min((g for g in GRID if g > a), default=6.0)
    return lo, hi


def test_between_grid_points_only_the_two_neighbours_and_unbiased():
    # every y = k/512 in [0, 6]; steps are 0.5, 1, 2, so the rounding-up probability is floor(256 f)/256
    for k in range(0, 6 * 512 + 1):
        y = k / 512
        lo, hi = _neighbours(y)
        out = _round_all(y)
        assert set(out.tolist()) <= {lo, hi}, y
        step = hi - lo if hi > lo else 1.0
        f = (y - lo) / step
        mean = out.double().mean().item()
        assert mean == lo + step * int(256 * f) / 256, y  # exact: 256 equally likely bytes
        assert abs(mean - y) < step / 256, y
        if f * 256 == int(f * 256):  # on the step/256 lattice SR is exactly unbiased
            assert mean == y, y


def test_sign_and_saturation_and_special_values():
    y = torch.tensor([-0.3, -5.0, 7.0, -100.0, float("inf"), float("-inf"), -0.0, 0.0, float("nan"), -1e-30])
    for byte in (0, 128, 255):
        codes = e2m1_encode_stochastic(y, torch.full(y.shape, byte, dtype=torch.uint8))
        values = _decode(codes)
        assert values[0].item() in (-0.0, -0.5) and values[1].item() in (-4.0, -6.0)
        assert values[2:6].tolist() == [6.0, -6.0, 6.0, -6.0]
        assert codes[6:9].tolist() == [0, 0, 0x7]  # -0.0 gives +0, NaN gives +6 as round-to-nearest does
        assert codes[9].item() == 0x8  # a tiny negative rounds to -0 and keeps its sign bit, as in RN
    assert torch.equal(e2m1_encode_stochastic(-y, torch.zeros(y.shape, dtype=torch.uint8))[:6] ^ 8,
                       e2m1_encode_stochastic(y, torch.zeros(y.shape, dtype=torch.uint8))[:6])


def test_byte_thresholds():
    # 0.3 = 0 + 0.6 * 0.5: bytes >= 256 * 0.4 = 102.4 round up
    out = _round_all(0.3)
    assert (out[:103] == 0).all() and (out[103:] == 0.5).all()
    # 5 = 4 + 0.5 * 2: the upper half of the bytes reach 6
    out = _round_all(5.0)
    assert (out[:128] == 4).all() and (out[128:] == 6).all()
    # 3.75 crosses into the next binade: t >= 4 reads its step there
    out = _round_all(3.75)
    assert (out[:64] == 3).all() and (out[64:] == 4).all()


def test_unbiased_over_random_seeds_via_random_bytes():
    # each of 4096 rows draws independent bytes for the same 64 values (uniform in [-6.5, 6.5])
    g = torch.Generator().manual_seed(1)
    y = torch.rand(64, generator=g) * 13 - 6.5
    draws = 4096
    rbytes = random_bytes(0x5EED, 11, draws, 64, "cpu")
    values = _decode(e2m1_encode_stochastic(y.expand(draws, 64), rbytes)).double()
    mean = values.mean(0)
    target = y.double().clamp(-6, 6)
    step = torch.where(y.abs() >= 4, 2.0, torch.where(y.abs() >= 2, 1.0, 0.5)).double()
    # sd of a two-point draw is at most step / 2; the byte quantization adds a bias below step / 256
    assert ((mean - target).abs() <= 5 * (step / 2) / draws ** 0.5 + step / 256).all()


def test_reset_restarts_a_state_in_place():
    state = fp4gen.RNGState(5)
    x = torch.randn(32, 64)
    first = fp4gen.quantize(x, rounding="stochastic", rng=state).rowwise.data
    tensor = state.tensor
    state.reset(5)
    assert state.tensor is tensor and state.offset.item() == 0  # in place: captured graphs keep the tensor
    assert torch.equal(fp4gen.quantize(x, rounding="stochastic", rng=state).rowwise.data, first)
    state.reset(6)
    assert not torch.equal(fp4gen.quantize(x, rounding="stochastic", rng=state).rowwise.data, first)
    with pytest.raises(TypeError, match="seed must be an int"):
        state.reset("5")
