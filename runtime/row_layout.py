"""How the CUDA kernels read a 2-D input: row by row, as it lies in memory.

One rule, two uses: the functional API refuses a layout the kernels cannot read and says why
(cuda.ops.check_rows_readable), while the layers, which take whatever a model hands them as torch.nn.Linear
does, copy such a tensor into new memory first (nn.kernel_readable_rows).
"""
from __future__ import annotations

import torch

# The row alignment, in bytes, that the quantize kernels declare for x in the manifest (16 for every one: their
# 16-byte vector loads); tests/test_row_layout.py checks the manifest against it.
ROW_ALIGNMENT = 16


def rows_readable(t: torch.Tensor) -> bool:
    """Whether the kernels can read t [rows, cols] row by row where it lies: each row's elements contiguous (last
    stride 1) and rows that do not overlap (a row stride of at least cols; rows broadcast from one, stride 0, do).
    Alignment is apart: row_start_bits."""
    rows, cols = t.shape
    return rows == 0 or ((cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols))


def row_start_bits(t: torch.Tensor) -> int:
    """The base address OR-ed with the row stride in bytes: alignment is a power of two, so this is a multiple of
    an alignment iff every row start is."""
    return t.data_ptr() | (t.stride(0) * t.element_size() if t.shape[0] > 1 else 0)


def readable_copy(t: torch.Tensor) -> torch.Tensor:
    """t [rows, cols] itself where the kernels can read it as it lies (rows_readable, every row start aligned to
    ROW_ALIGNMENT), else a contiguous copy in new memory (aligned, as the allocator's blocks are; differentiable,
    as any copy)."""
    if not (t.is_contiguous() or rows_readable(t)):  # the common case first: a contiguous t, one address check
        return t.contiguous()
    return t if not row_start_bits(t) % ROW_ALIGNMENT else t.clone(memory_format=torch.contiguous_format)
