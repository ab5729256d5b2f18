"""The 128x4 scale swizzle against the layout's offset formula (docs/numerics.md, scale layouts)."""
import pytest
import torch

from fp4gen.swizzle import swizzle_scales, swizzled_scale_shape


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (100, 3), (384, 20), (1, 1), (300, 17)])
def test_swizzle_matches_the_offset_formula(rows, cols):
    g = torch.Generator().manual_seed(rows * 31 + cols)
    scale = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=g)
    out = swizzle_scales(scale)
    rows_pad, cols_pad = swizzled_scale_shape(rows, cols)
    assert out.numel() == rows_pad * cols_pad
    expected = torch.zeros(rows_pad * cols_pad, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * (cols_pad // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            expected[offset] = scale[r, c]
    assert torch.equal(out, expected)  # every byte placed, padding zero
