"""Grouped (mixture-of-experts) entry points: argument checks, the group offsets, backend choice.

Tokens sorted by expert come with `offsets`, the cumulative ends of the groups (the convention of
torch.nn.functional.grouped_mm's `offs`): group g is rows offsets[g-1] .. offsets[g]-1 (group 0 starts at row 0).
A device tensor of offsets is never read on the host, so a call neither synchronizes nor depends on the routing
when captured in a CUDA graph; a host list is checked (non-decreasing, ending at T) and copied to the device.
"""
from __future__ import annotations

import torch

from . import api
from .formats import BLOCK, GroupedNVFP4Tensor
from .rng import RNGState

OFFSET_DTYPES = (torch.int32, torch.int64)


# Tokens of a group in a columnwise copy are padded with zeros to a multiple of this: no 16-token NVFP4 block
# straddles two groups, and neither does a k-tile of the grouped GEMM, which contracts over tokens 64 at a time.
GROUP_PAD = 64


def capacity(tokens: int, groups: int) -> int:
    """Columns of a grouped columnwise copy: every group's tokens rounded up to GROUP_PAD fit, whatever the
    routing (the sum of the rounded sizes is at most T + (GROUP_PAD - 1) E, and a multiple of GROUP_PAD)."""
    return (tokens + (GROUP_PAD - 1) * groups) // GROUP_PAD * GROUP_PAD


def padded_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """int64 [E]: the cumulative ends of the group sizes rounded up to GROUP_PAD, computed on the offsets'
    device."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).clamp_min(0)
    return torch.cumsum((sizes + (GROUP_PAD - 1)) // GROUP_PAD * GROUP_PAD, 0)


def group_offsets(offsets, tokens: int, device: torch.device) -> torch.Tensor:
    """The offsets argument as an int64 tensor on `device`, with every check that needs no synchronization:
    a tensor's dtype, device and shape; a host list's values too."""
    if isinstance(offsets, (list, tuple)):
        if not offsets:
            raise ValueError("offsets is empty; it needs one cumulative end per group (at least one group)")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in offsets):
            raise TypeError(f"offsets must hold ints, got {offsets!r}")
        previous = 0
        for g, end in enumerate(offsets):
            if end < previous:
                raise ValueError(f"offsets must be non-decreasing cumulative group ends starting from 0; "
                                 f"offsets[{g}] = {end} follows {previous}")
            previous = end
        if offsets[-1] != tokens:
            raise ValueError(f"offsets[-1] = {offsets[-1]}, but x has {tokens} tokens; the groups must cover them all")
        return torch.tensor(offsets, dtype=torch.int64, device=device)
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a tensor of cumulative group ends or a list of ints, got "
                        f"{type(offsets).__name__}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"offsets.dtype is {offsets.dtype}; it must be torch.int32 or torch.int64")
    if offsets.dim() != 1 or offsets.shape[0] == 0:
        raise ValueError(f"offsets has shape {tuple(offsets.shape)}; it must be 1-D with one entry per group")
    if offsets.device != device:
        raise ValueError(f"offsets is on {offsets.device} but x is on {device}; keep them on one device "
                         f"(a CUDA tensor of offsets is never read on the host)")
    return offsets.to(torch.int64).contiguous()


def quantize_grouped(x: torch.Tensor, offsets, scaling: str = "row", block=(1, 16), rowwise: bool = True,
                     columnwise: bool = True, backend: str | None = None, *, rounding: str = "nearest",
                     rng: RNGState | None = None, hadamard: bool = False,
                     four_over_six: str | None = None) -> GroupedNVFP4Tensor:
    """Quantize a grouped tensor to NVFP4, each group as the dense fp4gen.quantize would quantize its slice.

    x [T, K] with offsets (int32/int64 tensor [E] on x's device, or a host list): tokens sorted by group.
    The rowwise copy ("rows" layout) has per-token amaxes (scaling="row") or one amax per group
    ("tensor"); the columnwise copy ("columns" layout) holds each group's transpose, its tokens padded with
    zeros to a multiple of 64, with per-(group, column) amaxes or one per group. Any group sizes, 0 included.

    x [E, N, K] with offsets=None: stacked expert weights, one group per expert ("stacked" layouts:
    rowwise [E, N, K/2], columnwise [E, K, N/2]); block=(16, 16) is allowed here (with scaling="tensor").

    rounding, rng, hadamard and four_over_six as in fp4gen.quantize. Stochastic rounding keys each block's bits
    by its position in the grouped copy, so its bytes equal the reference backend's for the same state (not a
    dense quantization of one group's slice).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in api.INPUT_DTYPES:
        raise TypeError(f"x.dtype is {x.dtype}; fp4gen.quantize_grouped takes {api.dtype_names(api.INPUT_DTYPES)}")
    if scaling not in api.SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not supported; choose 'row' or 'tensor'")
    block = api._block_pair(block)
    for name, value in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: it must be True or False")
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False; ask for at least one output")
    stacked = offsets is None
    if stacked and x.dim() != 3:
        raise ValueError(f"offsets=None means stacked expert weights x [E, N, K]; x has shape {tuple(x.shape)} "
                         f"(tokens x [T, K] need their group offsets)")
    if not stacked and x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; grouped tokens are x [T, K] (stacked weights [E, N, K] "
                         f"take offsets=None)")
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"x has K = x.shape[-1] = {k}; K must be a multiple of {BLOCK} (the NVFP4 block)")
    if block == (16, 16):
        if not stacked or scaling != "tensor":
            raise ValueError("block=(16, 16) is for stacked weights x [E, N, K] (offsets=None) with "
                             "scaling='tensor': a 16x16 tile shares one scale across 16 rows of one expert")
    if stacked and x.shape[0] == 0:
        raise ValueError("x [E, N, K] has E = 0 experts; there must be at least one")
    if stacked and (columnwise or block == (16, 16)) and x.shape[1] % BLOCK:
        raise ValueError(f"x [E, N, K] has N = {x.shape[1]}; the columnwise copy blocks N in 16s, so N must be a "
                         f"multiple of {BLOCK}")
    options = api._options(x, block, columnwise, rounding, rng, hadamard, four_over_six)
    name = api.choose_backend(x.device, backend)
    if stacked:
        groups, rows_per_group = x.shape[0], x.shape[1]
        x2d = x.reshape(groups * rows_per_group, k)
        ends = torch.arange(1, groups + 1, dtype=torch.int64, device=x.device) * rows_per_group
    else:
        x2d = x
        ends = group_offsets(offsets, x.shape[0], x.device)
    if name == "reference":
        from . import reference_grouped as impl
    else:
        from .cuda import grouped as impl
    row, col = impl.quantize_grouped(x2d, ends, x.shape[1] if stacked else None, scaling, block, rowwise, columnwise,
                                     options)
    if options.rng is not None:
        options.rng.advance()  # on the device, after the kernels that read the offset (stream order)
    return GroupedNVFP4Tensor(row, col, tuple(x.shape), x.dtype, scaling, block)
