"""The reference backend: NVFP4 numerics in plain PyTorch, bit-exact with TransformerEngine's quantization.

Every formula below is one fp32 operation per step, in the order docs/numerics.md gives (PyTorch fp32
elementwise ops are IEEE round-to-nearest-even). Runs on any device.

fp4gen's deliberate difference from upstream (docs/numerics.md): second-level amaxes propagate
NaN. Block amaxes ignore NaN as upstream's kernels do, and a NaN element encodes as +6 (code 0x7,
what the hardware `cvt.rn.satfinite` gives), so the stored bytes are defined for every input and the
NaN amax makes the whole row (or tensor) dequantize to NaN.
"""
from __future__ import annotations

import torch

from .formats import BLOCK, NVFP4Data
from .hadamard import apply_rht
from .options import DEFAULT_OPTIONS, QuantizeOptions, check_column_sums

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# fl(6 * 448) = 2688 exactly; the encode scale divides by it, the decode scale multiplies by fl(1/2688).
GLOBAL_ENCODE_NUMERATOR = E4M3_MAX * E2M1_MAX

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _f32(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """GES: fl(2688 / amax), capped at FLT_MAX with C's fminf (a NaN quotient gives
    FLT_MAX), and 1 where amax is 0 or the quotient is 0 (amax = +Inf)."""
    s = _f32(GLOBAL_ENCODE_NUMERATOR, amax.device) / amax
    s = torch.fmin(s, _f32(FLT_MAX, amax.device))
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _to_e4m3_satfinite(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 with RNE and saturation to 448; NaN stays NaN (`E4M3(v)`).

    PyTorch's conversion rounds correctly but maps values above 464 to NaN, so clamp first; values in
    (448, 464] round to 448 either way, so the clamp changes nothing else.
    """
    return torch.clamp(v, max=E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """E2M1_RN: round to nearest, ties to the even code, saturate to +-6.

    Returns uint8 codes. The sign bit is set iff y < 0 (so -0.0 gives code 0, as the reference does);
    NaN gives code 0x7 (+6).
    """
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(torch.float32)
    v = torch.clamp(torch.round(a / step) * step, max=E2M1_MAX)  # torch.round: half to even
    # value -> code: [0, 2) -> 2v, [2, 4) -> v + 2, 4 -> 6, 6 -> 7
    code = torch.where(v < 2, v * 2, torch.where(v < 4, v + 2, torch.where(v == 4, 6.0, 7.0)))
    code = torch.where(torch.isnan(y), 7.0, code).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (one per element) -> their exact float32 values."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] uint8 codes -> [R, C/2] bytes, element 2j in the low nibble of byte j."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """[R, C/2] bytes -> [R, C] uint8 codes (inverse of pack_nibbles)."""
    out = torch.stack((data & 0xF, data >> 4), dim=-1)
    return out.reshape(data.shape[0], 2 * data.shape[1])


def _abs_max(x: torch.Tensor, dims) -> torch.Tensor:
    """NaN-propagating max |x| over `dims`; 0 over an empty extent."""
    if x.numel() == 0:
        shape = [s for d, s in enumerate(x.shape) if d not in dims]
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return x.abs().amax(dim=dims)


def _abs_max_ignore_nan(x: torch.Tensor, dims) -> torch.Tensor:
    """Block amax as upstream's kernels compute it: max |x| with NaN elements ignored."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=dims)


def _encode_blocks(x: torch.Tensor, bamax: torch.Tensor, s_enc: torch.Tensor, rbytes: torch.Tensor | None = None):
    """Q1D steps 2.2-2.3 for blocks of x.

    x: fp32 [..., n, 16] (the elements of each block), bamax: [..., n] block amax,
    s_enc: broadcastable to bamax, the block's global encode scale; rbytes: None for round-to-nearest, else
    each element's random byte (shaped like x) for stochastic rounding. Returns (E4M3 scales [..., n], uint8
    codes [..., n, 16]).
    """
    dev = x.device
    m = s_enc * _f32(1.0 / 6.0, dev)  # fl(S_enc * fl(1/6))
    sdec = _to_e4m3_satfinite(torch.clamp(bamax * m, max=FLT_MAX))
    s_dec_global = _f32(1.0, dev) / s_enc  # IEEE division
    r = torch.clamp(_f32(1.0, dev) / (sdec.float() * s_dec_global), max=FLT_MAX)  # 1/0 = inf -> FLT_MAX
    y = x * r.unsqueeze(-1)
    if rbytes is None:
        return sdec, e2m1_encode(y)
    from .stochastic import e2m1_encode_stochastic  # here: stochastic.py builds on this module's encoder
    return sdec, e2m1_encode_stochastic(y, rbytes)


def _encode(blocks: torch.Tensor, amax: torch.Tensor, rbytes, four_over_six):
    """(scales, codes, e4m3_max) of blocks [..., n, B] whose second-level amax broadcasts to [..., n]."""
    bamax = _abs_max_ignore_nan(blocks, -1)
    if four_over_six is not None:
        from .four_over_six import FOUR_OVER_SIX_E4M3_MAX, encode_blocks_4over6  # builds on this module
        sdec, codes = encode_blocks_4over6(blocks, bamax, amax, four_over_six)
        return sdec, codes, FOUR_OVER_SIX_E4M3_MAX
    sdec, codes = _encode_blocks(blocks, bamax, global_encode_scale(amax), rbytes)
    return sdec, codes, E4M3_MAX


def _quantize_1d(x: torch.Tensor, amax: torch.Tensor, rbytes=None, four_over_six=None) -> NVFP4Data:
    """Rowwise 1x16 quantization of fp32 x [R, C] with amax [R] (row-scaled) or [1] (per-tensor); rbytes
    [R, C] for stochastic rounding."""
    rows, cols = x.shape
    shape = (rows, cols // BLOCK, BLOCK)
    sdec, codes, e4m3_max = _encode(x.reshape(shape), amax.reshape(-1, 1),  # [R or 1, 1] broadcasts over blocks
                                    None if rbytes is None else rbytes.reshape(shape), four_over_six)
    return NVFP4Data(pack_nibbles(codes.reshape(rows, cols)), sdec.contiguous(), amax, e4m3_max)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M/16, K/16, 256]: each 16x16 tile's elements, row-major within the tile (sizes spelled out, not -1:
    an empty M or K has no size to infer)."""
    m, k = t.shape
    tiles = t.reshape(m // BLOCK, BLOCK, k // BLOCK, BLOCK).permute(0, 2, 1, 3)
    return tiles.reshape(m // BLOCK, k // BLOCK, BLOCK * BLOCK)


def _quantize_2d(x: torch.Tensor, amax: torch.Tensor, rowwise: bool, columnwise: bool, rbytes=None,
                 four_over_six=None):
    """16x16 quantization of fp32 x [M, K] with a per-tensor amax [1]; rbytes [M, K] for stochastic rounding.

    One scale per 16x16 tile, replicated on each of the tile's 16 rows (rowwise) or 16 transposed rows
    (columnwise); the columnwise codes are the exact transpose of the rowwise codes.
    """
    m, k = x.shape
    sdec, codes, e4m3_max = _encode(_tiles(x), amax, None if rbytes is None else _tiles(rbytes), four_over_six)
    codes = codes.reshape(m // BLOCK, k // BLOCK, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(m, k)
    row = col = None
    if rowwise:
        row = NVFP4Data(pack_nibbles(codes), sdec.repeat_interleave(BLOCK, dim=0).contiguous(), amax, e4m3_max)
    if columnwise:
        col = NVFP4Data(pack_nibbles(codes.t().contiguous()),
                        sdec.t().repeat_interleave(BLOCK, dim=0).contiguous(), amax, e4m3_max)
    return row, col


def _random_bytes(rng, copy: int, shape) -> torch.Tensor | None:
    """Stochastic rounding's bytes for one copy (0 rowwise, 1 columnwise) of [rows, cols], or None."""
    if rng is None:
        return None
    from .stochastic import random_bytes  # builds on this module
    return random_bytes(rng.seed, rng.offset + copy, shape[0], shape[1], rng.device)


def quantize(x2d: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
             options: QuantizeOptions = DEFAULT_OPTIONS, column_sums: torch.dtype | None = None):
    """Quantize a validated 2-D input; returns (rowwise, columnwise) NVFP4Data or None each, and with column_sums
    (tensor scaling; torch.float32 or x2d's dtype) x2d's column sums in that dtype after them: summed in fp32,
    rounded once.

    options (validated by fp4gen.quantize): stochastic rounding draws each copy's bits from options.rng (which
    fp4gen.quantize then advances); hadamard quantizes the columnwise copy from the transform of x.T, with its own amax;
    four_over_six picks each block's map-to-4 or map-to-6 scale."""
    check_column_sums(column_sums, scaling, x2d.dtype)
    x = x2d.float().contiguous()  # elementwise results then come out row-major too
    rng, fos = options.rng, options.four_over_six
    if block == (16, 16):
        result = _quantize_2d(x, _abs_max(x, (0, 1)).reshape(1), rowwise, columnwise, _random_bytes(rng, 0, x.shape),
                              fos)
    else:
        xt = None
        if columnwise:  # x.T, transformed when asked (always to bf16 values)
            xt = apply_rht(x.t()).float() if options.hadamard else x.t().contiguous()
        amax_dims = (1,) if scaling == "row" else (0, 1)
        row = col = None
        if rowwise:
            row = _quantize_1d(x, _abs_max(x, amax_dims).reshape(-1), _random_bytes(rng, 0, x.shape), fos)
        if columnwise:  # per-column amax of x when row-scaled; shared with the rowwise copy unless transformed
            shared = rowwise and scaling == "tensor" and not options.hadamard
            amax = row.amax if shared else _abs_max(xt, amax_dims).reshape(-1)
            col = _quantize_1d(xt, amax, _random_bytes(rng, 1, xt.shape), fos)
        result = row, col
    if column_sums is not None:
        result = (*result, x2d.sum(0, dtype=torch.float32).to(column_sums))
    return result


def inverse_decode_numerator(operand: NVFP4Data) -> torch.Tensor:
    """fl(1 / fl(6 * e4m3_max)): fl(1/2688) for standard operands, fl(1/1536) for 4over6 ones."""
    return _f32(1.0 / (E2M1_MAX * operand.e4m3_max), operand.device)


def decode_factor(operand: NVFP4Data) -> torch.Tensor:
    """Per-block dequantization factor fs = fl(fl(sdec * amax) * fl(1/2688)) (upstream's order), [R, C/16]."""
    amax = operand.amax.reshape(-1, 1)
    return (operand.scale.float() * amax) * inverse_decode_numerator(operand)


def dequantize(operand: NVFP4Data, dtype: torch.dtype) -> torch.Tensor:
    """out = OType(fl(e2m1 * fs)) in upstream's order, [rows, cols].

    fp4gen's difference: where fl(sdec * amax) overflows for a finite amax (amax within a factor 448 of
    FLT_MAX), upstream's factor is inf although the true value, at most amax, is finite. Those blocks take the
    factor in the other order, fl(fl(amax * fl(1/2688)) * sdec), which stays finite (checked for the largest
    amaxes and every scale), as the CUDA kernels do; every other block keeps upstream's bits."""
    rows, cols = operand.shape
    values = e2m1_decode(unpack_nibbles(operand.data)).reshape(rows, cols // BLOCK, BLOCK)
    factor = decode_factor(operand)
    amax = operand.amax.reshape(-1, 1).expand_as(factor)
    sdec = operand.scale.float()
    overflow = torch.isinf(sdec * amax) & torch.isfinite(amax)
    finite_factor = (amax * inverse_decode_numerator(operand)) * sdec
    out = values * torch.where(overflow, finite_factor, factor).unsqueeze(-1)  # no branch: no host sync
    return out.reshape(rows, cols).to(dtype)


def block_scaled_values(operand: NVFP4Data) -> torch.Tensor:
    """e2m1 * E4M3 block scale for every element (exact in fp32), without the second-level amax."""
    rows, cols = operand.shape
    values = e2m1_decode(unpack_nibbles(operand.data)).reshape(rows, cols // BLOCK, BLOCK)
    return (values * operand.scale.float().unsqueeze(-1)).reshape(rows, cols)


def bilateral_scale(operand: NVFP4Data) -> torch.Tensor:
    """The per-row or per-column factor the GEMM epilogue applies: fl(amax * fl(1/fl(6 * e4m3_max)))."""
    return operand.amax * inverse_decode_numerator(operand)


def gemm(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, out: torch.Tensor | None,
         accumulate: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """D[i, j] = fl(fl(fl(acc[i, j] * col_scale[j]) * row_scale[i]) + bias[j]) (+ out when accumulating),
    rounded once to out_dtype at the end.

    acc is the block-scaled product sum_k A[i,k] B[j,k], accumulated here in float64 and rounded once
    to fp32 (the GPU kernels accumulate in fp32 in their own order, so GEMMs are compared, not bit-matched).
    """
    acc = (block_scaled_values(a).double() @ block_scaled_values(b).double().t()).float()
    d = (acc * bilateral_scale(b).reshape(1, -1)) * bilateral_scale(a).reshape(-1, 1)
    if bias is not None:
        d = d + bias.to(device=d.device, dtype=torch.float32).reshape(1, -1)
    return finish_gemm(d, out_dtype, out, accumulate)


def finish_gemm(d: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    """The fp32 result d (+ out when accumulating), rounded once to out_dtype, written into `out` if given."""
    if accumulate:
        d = d + out.float()
    d = d.to(out_dtype)
    if out is None:
        return d
    out.copy_(d)
    return out
