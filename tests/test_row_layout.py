"""The one rule for inputs the CUDA kernels read row by row (fp4gen.row_layout): which layouts it takes where they
lie, which it copies, and that its alignment is the one the manifest declares for every quantize kernel's x."""
import pytest
import torch

from fp4gen import row_layout
from fp4gen.cuda.manifest import load_manifest
from fp4gen.cuda.ops import check_rows_readable


def strided(rows, cols, row_stride, col_stride=1, offset=0, dtype=torch.bfloat16):
    storage = torch.zeros(offset + rows * max(row_stride, 1) + cols * col_stride + 64, dtype=dtype)
    return storage.as_strided((rows, cols), (row_stride, col_stride), offset)


@pytest.mark.parametrize("t, readable", [
    (strided(4, 32, 32), True),           # contiguous
    (strided(4, 32, 40), True),           # a slice of wider rows
    (strided(4, 32, 31), False),          # rows overlapping by one element
    (strided(4, 32, 0), False),           # every row the first one's
    (strided(4, 32, 1, 4), False),        # transposed
    (strided(1, 32, 0), True),            # one row: its stride is never used
    (strided(4, 1, 1, 7), True),          # one column: its stride is never used
    (strided(0, 32, 1, 9), True),         # no rows: nothing is read
])
def test_rows_readable(t, readable):
    assert row_layout.rows_readable(t) is readable
    if readable:
        check_rows_readable(t)
    else:
        with pytest.raises(ValueError, match="read rows of contiguous elements"):
            check_rows_readable(t)


@pytest.mark.parametrize("t, in_place", [
    (strided(4, 32, 32), True),            # 64-byte rows from an aligned start
    (strided(4, 32, 40), True),            # 80-byte row stride: a multiple of 16
    (strided(4, 32, 36), False),           # 72-byte row stride: rows 1 and 3 start off 16 bytes
    (strided(4, 32, 32, offset=1), False),  # the start two bytes in
    (strided(4, 32, 32, offset=8), True),  # the start 16 bytes in
    (strided(1, 32, 36, offset=8), True),  # one row, aligned: its stride does not count
    (strided(4, 32, 0), False),            # not readable at all
    (strided(4, 32, 1, 4), False),
])
def test_readable_copy_reads_in_place_only_what_the_kernels_take(t, in_place):
    out = row_layout.readable_copy(t)
    assert torch.equal(out, t)
    assert (out is t) is in_place
    assert row_layout.rows_readable(out) and row_layout.row_start_bits(out) % row_layout.ROW_ALIGNMENT == 0


def test_row_alignment_is_the_manifests():
    """Every quantize kernel that declares an alignment for x asks for ROW_ALIGNMENT or less, and one asks for
    exactly that: the layers' copies satisfy all of them and are made no more often than needed."""
    asked = {kernel["alignment"]["x"] for kernel in load_manifest()["kernels"].values()
             if "x" in kernel.get("alignment", {})}
    assert asked and max(asked) == row_layout.ROW_ALIGNMENT
