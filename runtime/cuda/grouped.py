"""The CUDA backend's grouped operations: outputs from the PyTorch allocator, one library call on the current
stream, the group offsets passed as device pointers (never read on the host)."""
from __future__ import annotations

import torch

from ..formats import BLOCK, GroupedNVFP4Data
from ..grouped import capacity, padded_offsets
from ..options import QuantizeOptions
from .ops import _empty, _launch, _ptr, _row_start_bits, _kernel_for

_FOUR_OVER_SIX = {None: 0, "mae": 1, "mse": 2}


def quantize_grouped(x: torch.Tensor, offsets: torch.Tensor, rows_per_group: int | None, scaling: str,
                     block: tuple, rowwise: bool, columnwise: bool, options: QuantizeOptions):
    """(rowwise, columnwise) GroupedNVFP4Data or None each (layouts: fp4gen.formats.GroupedNVFP4Data) from the
    quantize_grouped kernel: its amax pass, then the encode pass of the options."""
    tokens, cols = x.shape
    if tokens > 0 and cols > 1 and x.stride(1) != 1:
        raise ValueError(f"x has strides {tuple(x.stride())}: the CUDA quantize kernels read rows of contiguous "
                         f"elements (last stride 1); pass x.contiguous()")
    device = x.device
    groups, stacked, row_scaled = offsets.shape[0], rows_per_group is not None, scaling == "row"
    kernel = _kernel_for("quantize_grouped", device, {"in_dtype": x.dtype}, cols,
                         {"x": _row_start_bits(x)} if x.numel() else {})
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
    row = col = None
    row_args = col_args = (None, None, None)
    if rowwise:
        amax = _empty(device, tokens if row_scaled else groups, dtype=f32)
        data, scale = _empty(device, tokens, cols // 2), _empty(device, tokens, cols // BLOCK)
        row_args = (amax, data, scale)
        if stacked:
            shape = (groups, rows_per_group)
            row = GroupedNVFP4Data._made_by_fp4gen(
                data.view(*shape, -1), scale.view(torch.float8_e4m3fn).view(*shape, -1),
                amax.view(shape) if row_scaled else amax, "stacked", row_scaled, None, None, e4m3_max)
        else:
            row = GroupedNVFP4Data._made_by_fp4gen(data, scale.view(torch.float8_e4m3fn), amax, "rows", row_scaled,
                                                   offsets, None, e4m3_max)
    if columnwise:
        amax = _empty(device, *((groups, cols) if row_scaled else (groups,)), dtype=f32)
        copy_rows = groups * cols if stacked else cols
        data, scale = _empty(device, copy_rows, width // 2), _empty(device, copy_rows, width // BLOCK)
        col_args = (amax, data, scale)
        if stacked:
            col = GroupedNVFP4Data._made_by_fp4gen(
                data.view(groups, cols, -1), scale.view(torch.float8_e4m3fn).view(groups, cols, -1), amax, "stacked",
                row_scaled, None, None, e4m3_max)
        else:
            col = GroupedNVFP4Data._made_by_fp4gen(data, scale.view(torch.float8_e4m3fn), amax, "columns", row_scaled,
                                                   offsets, padded, e4m3_max)
    stride = x.stride(0) if tokens > 1 else cols
    rng_state = options.rng.tensor if options.rounding == "stochastic" else None
    _launch(kernel, device, x.data_ptr(), stride, tokens, cols, offsets.data_ptr(), padded.data_ptr(), groups, rows,
            _ptr(row_args[0]), _ptr(col_args[0]), _ptr(row_args[1]), _ptr(row_args[2]), _ptr(col_args[1]),
            _ptr(col_args[2]), cols * width // 2 if stacked else 0, width // 2, int(stacked), _ptr(rng_state),
            int(row_scaled), int(block == (16, 16)), int(options.hadamard), _FOUR_OVER_SIX[options.four_over_six],
            int(options.rounding == "stochastic"))
    return row, col
