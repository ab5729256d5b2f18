"""The 128x4 swizzled block-scale layout that Blackwell's block-scaled MMA (and cuBLAS) read
(docs/numerics.md, scale layouts). Plain PyTorch, so it runs on any device and is tested on CPU."""
from __future__ import annotations

import torch


def swizzled_scale_shape(rows: int, cols: int) -> tuple:
    """Rows padded to 128 and scale columns to 4: the allocation the swizzled layout needs."""
    return (-(-rows // 128) * 128, -(-cols // 4) * 4)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Compact [R, C] scale bytes -> the swizzled layout as a flat uint8 tensor of R_pad * C_pad bytes.

    Byte (r, c) lands at ((r // 128) * (C_pad // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
    + c % 4, i.e. the padded matrix reshaped to [R/128, 4, 32, C/4, 4] and permuted to (0, 3, 2, 1, 4).
    Padding is zero.
    """
    rows, cols = scale.shape
    rows_pad, cols_pad = swizzled_scale_shape(rows, cols)
    padded = torch.zeros(rows_pad, cols_pad, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = scale.view(torch.uint8)
    blocks = padded.reshape(rows_pad // 128, 4, 32, cols_pad // 4, 4).permute(0, 3, 2, 1, 4)
    return blocks.reshape(-1)
