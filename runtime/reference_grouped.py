"""The reference backend's grouped quantization: each group through the dense reference numerics, in a loop
over groups on the host (it reads the offsets, which the CUDA backend never does).

What a group's copies are, stated here in the order the CUDA kernels reproduce byte for byte:
  rowwise    the group's rows encoded under their own amax (per row) or under the group's amax;
  columnwise the group's rows padded with zero rows to a multiple of 64 (grouped.GROUP_PAD), transposed
             (and transformed by the Hadamard transform when asked), encoded under per-column amaxes of
             that padded copy or its one amax; written at the group's padded columns of the [K, capacity]
             copy, or as its own [K, N] matrix for stacked weights;
  16x16      per group (stacked weights only), as the dense 16x16 quantization of its [N, K] slice.
Stochastic rounding draws each copy's bytes for the whole grouped copy (rowwise [T, K] at the state's offset,
columnwise at offset + 1, over the copy's storage shape), so a block's bits follow from its stored position.
"""
from __future__ import annotations

import torch

from .formats import BLOCK, GroupedNVFP4Data
from .grouped import capacity, padded_offsets
from .hadamard import apply_rht
from .options import QuantizeOptions
from . import reference
from .reference import E4M3_MAX, _abs_max, _quantize_1d, _quantize_2d, _random_bytes


def _check_host_offsets(ends: list, tokens: int) -> None:
    previous = 0
    for g, end in enumerate(ends):
        if end < previous or end > tokens:
            raise ValueError(f"offsets[{g}] = {end} breaks the rule 0 <= offsets[0] <= offsets[1] <= ... <= T = "
                             f"{tokens}")
        previous = end
    if ends[-1] != tokens:
        raise ValueError(f"offsets[-1] = {ends[-1]}, but x has {tokens} tokens; the groups must cover them all")


def _stack_scales(scales: list) -> torch.Tensor:
    """torch.stack of E4M3 scale tensors, through their bytes: under torch.autocast, stack (one of autocast's
    type-promoting ops) rejects float8 inputs."""
    return torch.stack([s.view(torch.uint8) for s in scales]).view(torch.float8_e4m3fn)


def quantize_grouped(x2d: torch.Tensor, offsets: torch.Tensor, rows_per_group: int | None, scaling: str,
                     block: tuple, rowwise: bool, columnwise: bool, options: QuantizeOptions):
    """(rowwise, columnwise) GroupedNVFP4Data or None each, for x2d [T, K] grouped by int64 `offsets`;
    rows_per_group N for stacked weights (x2d is then their [E * N, K] view), else None."""
    x = x2d.float().contiguous()
    tokens, cols = x.shape
    ends = offsets.tolist()
    _check_host_offsets(ends, tokens)
    starts = [0] + ends[:-1]
    groups, stacked, row_scaled = len(ends), rows_per_group is not None, scaling == "row"
    rng, fos = options.rng, options.four_over_six
    e4m3_max = E4M3_MAX if fos is None else 256.0
    device = x.device
    row = col = None
    if block == (16, 16):  # stacked weights, one amax per expert; the columnwise codes are the rowwise ones
        rbytes = _random_bytes(rng, 0, x.shape)
        parts = [_quantize_2d(x[s:e], _abs_max(x[s:e], (0, 1)).reshape(1), True, columnwise,
                              None if rbytes is None else rbytes[s:e], fos) for s, e in zip(starts, ends)]
        amax = torch.cat([p[0].amax for p in parts])
        if rowwise:
            row = GroupedNVFP4Data(torch.stack([p[0].data for p in parts]), _stack_scales([p[0].scale for p in parts]),
                                   amax, "stacked", False, e4m3_max=e4m3_max)
        if columnwise:
            col = GroupedNVFP4Data(torch.stack([p[1].data for p in parts]), _stack_scales([p[1].scale for p in parts]),
                                   amax.clone(), "stacked", False, e4m3_max=e4m3_max)
        return row, col
    if rowwise:
        if row_scaled:
            amax = row_amax = _abs_max(x, (1,))
        else:
            amax = torch.stack([_abs_max(x[s:e], (0, 1)) for s, e in zip(starts, ends)]).reshape(groups)
            row_amax = torch.repeat_interleave(amax, torch.tensor([e - s for s, e in zip(starts, ends)], device=device))
        q = _quantize_1d(x, row_amax, _random_bytes(rng, 0, x.shape), fos)
        if stacked:
            row = GroupedNVFP4Data(q.data.reshape(groups, rows_per_group, cols // 2),
                                   q.scale.reshape(groups, rows_per_group, cols // BLOCK),
                                   amax.reshape(groups, rows_per_group) if row_scaled else amax, "stacked", row_scaled,
                                   e4m3_max=e4m3_max)
        else:
            row = GroupedNVFP4Data(q.data, q.scale, amax, "rows", row_scaled, offsets, e4m3_max=e4m3_max)
    if columnwise:
        padded = None if stacked else padded_offsets(offsets)
        padded_ends = None if stacked else padded.tolist()
        width = rows_per_group if stacked else capacity(tokens, groups)
        copy_rows = groups * cols if stacked else cols
        data = torch.zeros(copy_rows, width // 2, dtype=torch.uint8, device=device)
        scale = torch.zeros(copy_rows, width // BLOCK, dtype=torch.float8_e4m3fn, device=device)
        amaxes = []
        rbytes = _random_bytes(rng, 1, (copy_rows, width))
        for g, (s, e) in enumerate(zip(starts, ends)):
            start = 0 if stacked else (padded_ends[g - 1] if g else 0)
            size = e - s if stacked else padded_ends[g] - start  # stacked: N, a multiple of 16 (checked)
            xp = torch.zeros(size, cols, dtype=torch.float32, device=device)
            xp[: e - s] = x[s:e]
            xt = apply_rht(xp.t()).float() if options.hadamard else xp.t().contiguous()
            amax = _abs_max(xt, (1,) if row_scaled else (0, 1)).reshape(-1)
            amaxes.append(amax)
            if size == 0:
                continue
            rows = slice(g * cols, (g + 1) * cols) if stacked else slice(0, cols)
            q = _quantize_1d(xt, amax, None if rbytes is None else rbytes[rows, start:start + size], fos)
            data[rows, start // 2:(start + size) // 2] = q.data
            scale[rows, start // BLOCK:(start + size) // BLOCK] = q.scale
        amax = torch.stack(amaxes) if row_scaled else torch.cat(amaxes)
        if stacked:
            col = GroupedNVFP4Data(data.reshape(groups, cols, width // 2), scale.reshape(groups, cols, width // BLOCK),
                                   amax, "stacked", row_scaled, e4m3_max=e4m3_max)
        else:
            col = GroupedNVFP4Data(data, scale, amax, "columns", row_scaled, offsets, padded, e4m3_max=e4m3_max)
    return row, col


def grouped_gemm(a: GroupedNVFP4Data, b: GroupedNVFP4Data, offsets: torch.Tensor, along_k: bool, shape: tuple,
                 out_dtype: torch.dtype, out, accumulate: bool, bias) -> torch.Tensor:
    """Each group through the dense reference GEMM (float64 accumulation, one rounding to fp32, the
    bilateral epilogue), on the groups' own copies: rows along M, or the padded token columns along K."""
    ends = offsets.tolist()
    if along_k:
        padded = padded_offsets(offsets)
        a = _with_padded_offsets(a, padded)
        b = _with_padded_offsets(b, padded)
    else:
        _check_host_offsets(ends, shape[0])
    d = torch.zeros(shape, dtype=torch.float32, device=a.device)
    for g in range(len(ends)):
        part = reference.gemm(a.group(g), b.group(g), torch.float32, None, False,
                              None if bias is None else bias[g])
        if along_k:
            d[g] = part
        else:
            d[(ends[g - 1] if g else 0):ends[g]] = part
    return reference.finish_gemm(d, out_dtype, out, accumulate)


def _with_padded_offsets(copy: GroupedNVFP4Data, padded: torch.Tensor) -> GroupedNVFP4Data:
    """A "columns" copy whose groups are located by `padded` (the GEMM's offsets) rather than its own."""
    return GroupedNVFP4Data(copy.data, copy.scale, copy.amax, "columns", copy.row_scaled, copy.offsets, padded,
                            copy.e4m3_max)
