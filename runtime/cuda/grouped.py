"""The CUDA backend's grouped operations: outputs from the PyTorch allocator, one library call on the current
stream, the group offsets passed as device pointers (never read on the host)."""
from __future__ import annotations

import torch

from ..formats import BLOCK, GroupedNVFP4Data
from ..grouped import capacity, padded_offsets
from ..options import QuantizeOptions
from ..row_layout import row_start_bits
from .ops import _capability, _kernel_for, _launch, check_rows_readable, gemm_alpha

_FOUR_OVER_SIX = {None: 0, "mae": 1, "mse": 2}


def _empty(device, *shape, dtype=torch.uint8):
    return torch.empty(*shape, dtype=dtype, device=device)


def _zeros(device, *shape, dtype=torch.uint8):
    return torch.zeros(*shape, dtype=dtype, device=device)


def _ptr(t):
    return t.data_ptr() if t is not None else None


def quantize_grouped(x: torch.Tensor, offsets: torch.Tensor, rows_per_group: int | None, scaling: str,
                     block: tuple, rowwise: bool, columnwise: bool, options: QuantizeOptions):
    """(rowwise, columnwise) GroupedNVFP4Data or None each (layouts: fp4gen.formats.GroupedNVFP4Data) from the
    quantize_grouped kernel: its amax pass, then the encode pass of the options."""
    tokens, cols = x.shape
    check_rows_readable(x)
    device = x.device
    groups, stacked, row_scaled = offsets.shape[0], rows_per_group is not None, scaling == "row"
    kernel = _kernel_for("quantize_grouped", device, {"in_dtype": x.dtype}, cols,
                         {"x": row_start_bits(x)} if x.numel() else {})
    width = rows_per_group if stacked else capacity(tokens, groups)
    # The padded row space the kernel tiles, and the groups' ends in it: stacked groups start every N rows
    # rounded up to 16 (N itself whenever there is a columnwise copy), token groups as the columnwise copy
    # lays them out.
    if stacked:
        per_group = -(-rows_per_group // BLOCK) * BLOCK
        padded = torch.arange(1, groups + 1, dtype=torch.int64, device=device) * per_group
        rows = groups * per_group
    else:
        padded, rows = padded_offsets(offsets), width
    e4m3_max = 448.0 if options.four_over_six is None else 256.0
    f32 = torch.float32
    # no elements (no tokens, or no columns): nothing to launch (the kernel refuses empty outputs); every extent is
    # empty, its amaxes 0 as the reference's, and the columnwise copy's columns, which no group owns, zeros
    alloc = _empty if x.numel() else _zeros
    row = col = None
    row_args = col_args = (None, None, None)
    if rowwise:
        amax = alloc(device, tokens if row_scaled else groups, dtype=f32)
        data, scale = alloc(device, tokens, cols // 2), alloc(device, tokens, cols // BLOCK)
        row_args = (amax, data, scale)
        if stacked:
            shape = (groups, rows_per_group)  # views spelled out: an expert of no rows leaves no size to infer
            row = GroupedNVFP4Data._made_by_fp4gen(
                data.view(*shape, cols // 2), scale.view(torch.float8_e4m3fn).view(*shape, cols // BLOCK),
                amax.view(shape) if row_scaled else amax, "stacked", row_scaled, None, None, e4m3_max)
        else:
            row = GroupedNVFP4Data._made_by_fp4gen(data, scale.view(torch.float8_e4m3fn), amax, "rows", row_scaled,
                                                   offsets, None, e4m3_max)
    if columnwise:
        amax = alloc(device, *((groups, cols) if row_scaled else (groups,)), dtype=f32)
        copy_rows = groups * cols if stacked else cols
        data, scale = alloc(device, copy_rows, width // 2), alloc(device, copy_rows, width // BLOCK)
        col_args = (amax, data, scale)
        if stacked:
            col = GroupedNVFP4Data._made_by_fp4gen(
                data.view(groups, cols, width // 2), scale.view(torch.float8_e4m3fn).view(groups, cols, width // BLOCK),
                amax, "stacked", row_scaled, None, None, e4m3_max)
        else:
            col = GroupedNVFP4Data._made_by_fp4gen(data, scale.view(torch.float8_e4m3fn), amax, "columns", row_scaled,
                                                   offsets, padded, e4m3_max)
    if not x.numel():
        return row, col
    stride = x.stride(0) if tokens > 1 else cols
    rng_state = options.rng.tensor if options.rounding == "stochastic" else None
    args = (x.data_ptr(), stride, tokens, cols, offsets.data_ptr(), padded.data_ptr(), groups, rows,
            _ptr(row_args[0]), _ptr(col_args[0]), _ptr(row_args[1]), _ptr(row_args[2]), _ptr(col_args[1]),
            _ptr(col_args[2]), cols * width // 2 if stacked else 0, width // 2, int(stacked), _ptr(rng_state),
            int(row_scaled), int(block == (16, 16)), int(options.hadamard), _FOUR_OVER_SIX[options.four_over_six],
            int(options.rounding == "stochastic"))
    workspace_bytes = kernel.workspace_size(*args, None)
    workspace = _empty(device, workspace_bytes) if workspace_bytes else None
    _launch(kernel, device, *args, _ptr(workspace))
    return row, col


# The grouped GEMM families (both one library call, the same arguments):
#  - gemm_grouped_tma: CUTLASS's SM90 grouped GEMM over fp16 copies of both operands (a TMA warp-specialized
#    mainloop), wherever D's rows can be TMA-stored (16-byte aligned) and the groups average at least
#    TMA_MIN_ROWS_PER_GROUP[grouping] rows;
#  - gemm_grouped_wgmma (the packed weight dequantized on chip, no weight copy) otherwise: its 64-row tile when
#    the groups average at most 64 rows (fewer CTAs idle past a group's end), else the 128-row one.
# On the H200 (bench/RESULTS.md, 2026-12-02) the TMA family ran every wgrad (groups along K, where the fp16
# copies are of tokens) 1.2-1.6x faster; along M it needs the experts' weights as fp16 (E * N * K * 2 bytes of
# traffic and workspace), which 2048 tokens an expert repaid (Mixtral FC1 fprop 1.53x faster). With its pingpong
# tile (2026-12-03, fprop and dgrad, uniform and skewed routing) it was 3-26% faster from 384 tokens an expert on
# (one tie: Mixtral's skewed dgrad at 384) and the packed kernel 4-17% faster at 256 on Qwen3-30B-A3B's FC1 and
# Mixtral's experts (FC2 split), so fewer than 384 keep the packed kernel.
# Within gemm_grouped_tma (tma_variant): the 128x128 pingpong tile along M when the groups average fewer than
# TMA_PINGPONG_BELOW_ROWS rows, else the 128x256 cooperative tile in pairs of CTAs. On the H200 (bench/RESULTS.md,
# 2026-12-03) pingpong ran Qwen3-30B-A3B's fprop and dgrad (512 tokens an expert) 4-8% faster and Mixtral's
# (2048) 2-43% slower; from 768 to 1024 tokens the two were within 6% either way. Along K (wgrad) they were
# within a few percent either way, and the cooperative tile stays.
# On Blackwell (compute capability 10.0) one family, gemm_grouped_sm100: CUTLASS's grouped block-scaled GEMM on
# the packed codes. Compiled for sm_100a, never run (no Blackwell GPU was available).
TMA_COOPERATIVE = {"tile": "128x256x64", "schedule": "cooperative", "cluster": "2x1"}
TMA_PINGPONG = {"tile": "128x128x64", "schedule": "pingpong", "cluster": "1x1"}
TMA_PINGPONG_BELOW_ROWS = 1024
BLACKWELL_TILE = {"mma_tile": "128x128x256"}
TMA_MIN_ROWS_PER_GROUP = {"along M": 384, "along K": 0}


def tma_variant(rows_per_group: float, along_k: bool) -> dict:
    """The spec values of the gemm_grouped_tma kernel for the problem, by the rule above."""
    return TMA_PINGPONG if not along_k and rows_per_group < TMA_PINGPONG_BELOW_ROWS else TMA_COOPERATIVE


def _tma_can_store(d: torch.Tensor, n: int) -> bool:
    """Whether every group's rows of D start 16-byte aligned (TMA stores them; C is D when accumulating)."""
    row_bytes = d.stride(-2) * d.element_size() if d.dim() >= 2 and d.shape[-2] > 1 else 16
    return d.data_ptr() % 16 == 0 and row_bytes % 16 == 0 and (n * d.element_size()) % 16 == 0


def _grouped_gemm_kernel(device, out_dtype, k: int, pointers: dict, rows_per_group: float, along_k: bool,
                         tma_ok: bool):
    """The grouped GEMM kernel for the problem, by the rule above."""
    if _capability(device.index) >= (10, 0):
        if not tma_ok:
            raise ValueError("on Blackwell the grouped GEMM stores D's rows with TMA: out must be 16-byte aligned "
                             "with rows of a multiple of 16 bytes")
        return _kernel_for("grouped_gemm", device, {"out_dtype": out_dtype}, k, pointers, BLACKWELL_TILE)
    grouping = "along K" if along_k else "along M"
    if tma_ok and rows_per_group >= TMA_MIN_ROWS_PER_GROUP[grouping]:
        return _kernel_for("grouped_gemm", device, {"out_dtype": out_dtype}, k, pointers,
                           tma_variant(rows_per_group, along_k))
    tile = "64x128x64" if rows_per_group <= 64 else "128x128x64"
    return _kernel_for("grouped_gemm", device, {"out_dtype": out_dtype}, k, pointers, {"packed_tile": tile})


def grouped_gemm(a: GroupedNVFP4Data, b: GroupedNVFP4Data, offsets: torch.Tensor, along_k: bool, shape: tuple,
                 out_dtype: torch.dtype, out, accumulate: bool, bias) -> torch.Tensor:
    """One library call of the kernel _grouped_gemm_kernel picks (its prepasses, then the grouped GEMM), all on the
    current stream; the offsets stay on the device."""
    device = a.device
    groups = offsets.shape[0]
    m, k = a.data.shape[0], 2 * a.data.shape[1]
    n = b.data.shape[1] if not along_k else b.data.shape[0]
    if along_k:
        group_ends = padded_offsets(offsets)  # the padded token columns, as the columnwise copies lay them out
        rows_per_group = m
    else:
        group_ends = offsets
        rows_per_group = m / groups
    d = out if out is not None else torch.empty(shape, dtype=out_dtype, device=device)
    pointers = {"a_codes": a.data.data_ptr(), "a_scale": a.scale.data_ptr(), "b_codes": b.data.data_ptr(),
                "b_scale": b.scale.data_ptr()}
    kernel = _grouped_gemm_kernel(device, out_dtype, k, pointers, rows_per_group, along_k, _tma_can_store(d, n))
    if m == 0 or n == 0:
        return d
    if k == 0:  # nothing to contract: D = C when accumulating, else zeros
        return d if accumulate else d.zero_()
    output_stride = m * n if along_k else 0  # elements from one group's [M, N] output to the next
    bias32 = bias.to(torch.float32).contiguous() if bias is not None else None
    ldd = n
    args = (a.data.data_ptr(), a.scale.data_ptr(), b.data.data_ptr(), b.scale.data_ptr(),
            d.data_ptr() if accumulate else None, d.data_ptr(), a.amax.data_ptr(), b.amax.data_ptr(), _ptr(bias32),
            gemm_alpha(a, b), 1.0 if accumulate else 0.0, m, n, k, a.data.stride(0), a.scale.stride(0),
            b.data.stride(-2), b.scale.stride(-2), ldd, ldd, int(a.row_scaled), int(b.row_scaled),
            group_ends.data_ptr(), groups, int(along_k),
            0 if along_k else b.data.stride(0), 0 if along_k else b.scale.stride(0), output_stride, output_stride,
            (m if along_k else 0) if a.row_scaled else 1, n if b.row_scaled else 1,
            n if bias is not None else 0)
    workspace_bytes = kernel.workspace_size(*args, None)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
    _launch(kernel, device, *args, _ptr(workspace))
    return d
