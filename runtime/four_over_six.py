"""4over6 adaptive block scaling, bit-exact with TransformerEngine's definition.

Each block is quantized twice, once with its scale mapping the block maximum to 4 ("map-to-4") and once to
6 ("map-to-6", the standard mapping), and keeps whichever candidate reconstructs the block with the smaller
error (absolute or squared). E2M1's widest gap is between 4 and 6, so values near a block's maximum often
land closer with the map-to-4 scale. The map-to-4 scale is 1.5 times the standard one; 4over6 tensors use
Emax = 256 instead of 448 so that scale still fits in E4M3 (256 * 1.5 = 384 <= 448).

As in reference.py every formula is one fp32 operation per step, in the spec's order.
"""
from __future__ import annotations

import torch

from .reference import E2M1_MAX, FLT_MAX, _f32, _to_e4m3_satfinite, e2m1_decode, e2m1_encode

FOUR_OVER_SIX_E4M3_MAX = 256.0
MODES = ("mae", "mse")
_ROW = 16  # a 1x16 block is one row; a 16x16 tile is 16 rows of 16, each accumulating its own error


def global_encode_scale(amax: torch.Tensor, emax: float) -> torch.Tensor:
    """reference.global_encode_scale with Emax as a parameter: fl(fl(6 * Emax) / amax), capped at FLT_MAX
    with fminf (so a NaN amax gives FLT_MAX), and 1 where amax is 0 or the quotient is 0 (amax = +Inf)."""
    dev = amax.device
    s = (_f32(E2M1_MAX, dev) * _f32(emax, dev)) / amax
    s = torch.fmin(s, _f32(FLT_MAX, dev))
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _codes(x: torch.Tensor, sf: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """E2M1_RN codes of blocks x [..., n, B] under E4M3 scale sf [..., n]; s_dec = fl(1 / S_enc)."""
    inv = torch.clamp(_f32(1.0, x.device) / (sf.float() * s_dec), max=FLT_MAX)  # sf = 0: 1/0 = inf -> FLT_MAX
    return e2m1_encode(x * inv.unsqueeze(-1))


def block_error(x: torch.Tensor, codes: torch.Tensor, sf: torch.Tensor, amax: torch.Tensor, mode: str,
                emax: float = FOUR_OVER_SIX_E4M3_MAX) -> torch.Tensor:
    """The exact-mode error [..., n] of blocks x [..., n, B] encoded as (sf [..., n], codes [..., n, B]).

    v = fl(fl(fl(e2m1 * sf) * a) / fl(6 * Emax)) (a true division, as the selection defines it; dequantize
    multiplies by fl(1/fl(6 * Emax)) instead, so this is not always the dequantized error bit for bit).
    Each 16-element row sums |v - x| or (v - x)^2 left to right from 0; a 16x16 tile's 16 row sums are then
    added as a tree (rows r and r+8, then r and r+4, r+2, r+1), as the rules specify (not left to right).
    """
    a = torch.broadcast_to(amax.float(), sf.shape).unsqueeze(-1)
    scaled = e2m1_decode(codes) * sf.float().unsqueeze(-1)
    v = (scaled * a) / (_f32(E2M1_MAX, x.device) * _f32(emax, x.device))
    d = v - x
    term = d.abs() if mode == "mae" else d * d
    term = term.reshape(*term.shape[:-1], term.shape[-1] // _ROW, _ROW)  # [..., n, rows, 16] (also with n = 0)
    err = torch.zeros(term.shape[:-1], dtype=torch.float32, device=x.device)
    for k in range(_ROW):  # sequential: fp32 addition is not associative
        err = err + term[..., k]
    while err.shape[-1] > 1:
        half = err.shape[-1] // 2
        err = err[..., :half] + err[..., half:]
    return err[..., 0]


def candidates(x: torch.Tensor, bamax: torch.Tensor, amax: torch.Tensor, emax: float = FOUR_OVER_SIX_E4M3_MAX):
    """((sf4, q4), (sf6, q6)): each block's map-to-4 and map-to-6 scales (E4M3 [..., n]) and codes."""
    dev = x.device
    a = torch.broadcast_to(amax.float(), bamax.shape)
    s_enc = global_encode_scale(a, emax)
    # bamax / 6 is a true division here, unlike the standard path's fl(S_enc * fl(1/6))
    base = (bamax.float() / _f32(E2M1_MAX, dev)) * s_enc
    sf4 = _to_e4m3_satfinite(base * _f32(1.5, dev))  # 6 / 4: the block maximum lands on 4
    sf6 = _to_e4m3_satfinite(base)
    s_dec = _f32(1.0, dev) / s_enc
    return (sf4, _codes(x, sf4, s_dec)), (sf6, _codes(x, sf6, s_dec))


def encode_blocks_4over6(x: torch.Tensor, bamax: torch.Tensor, amax: torch.Tensor, mode: str,
                         emax: float = FOUR_OVER_SIX_E4M3_MAX):
    """4over6 encoding of blocks: (E4M3 scales [..., n], uint8 codes [..., n, B]).

    x: [..., n, B], each block's elements (B = 16 for 1x16 blocks, 256 for a 16x16 tile row-major: element
    16 r + k is the tile's row r, column k); bamax [..., n]: block amax ignoring NaN; amax: broadcastable to
    [..., n], each block's second-level amax (for the encode scale and the error); mode: "mae" or "mse".
    A block takes map-to-4 only if its error is strictly smaller: ties, and NaN errors (which compare false),
    keep map-to-6. Dequantize with 6 * emax.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {', '.join(map(repr, MODES))}")
    if x.shape[-1] not in (_ROW, _ROW * _ROW):
        raise ValueError(f"blocks of {x.shape[-1]} elements; 4over6 takes 16 (1x16) or 256 (16x16 tiles)")
    x = x.float()  # exact for every input dtype
    (sf4, q4), (sf6, q6) = candidates(x, bamax, amax, emax)
    pick4 = block_error(x, q4, sf4, amax, mode, emax) < block_error(x, q6, sf6, amax, mode, emax)
    # select the scale bytes, not their values: where() on float8 is not supported everywhere
    sdec = torch.where(pick4, sf4.view(torch.uint8), sf6.view(torch.uint8)).view(torch.float8_e4m3fn)
    return sdec, torch.where(pick4.unsqueeze(-1), q4, q6)
