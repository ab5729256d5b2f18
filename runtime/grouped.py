"""Grouped (mixture-of-experts) entry points: argument checks, the group offsets, backend choice.

Tokens sorted by expert come with `offsets`, the cumulative ends of the groups (the convention of
torch.nn.functional.grouped_mm's `offs`): group g is rows offsets[g-1] .. offsets[g]-1 (group 0 starts at row 0).
A device tensor of offsets is never read on the host, so a call neither synchronizes nor depends on the routing
when captured in a CUDA graph; a host list is checked (non-decreasing, ending at T) and copied to the device.
"""
from __future__ import annotations

import torch

from . import api
from .formats import BLOCK, GroupedNVFP4Data, GroupedNVFP4Tensor
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


def group_offsets(offsets, tokens: int | None, device: torch.device) -> torch.Tensor:
    """The offsets argument as an int64 tensor on `device`, with every check that needs no synchronization:
    a tensor's dtype, device and shape; a host list's values too (ending at `tokens` unless that is None)."""
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
        if tokens is not None and offsets[-1] != tokens:
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
    api.refuse_function_transforms("fp4gen.quantize_grouped")
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


def _require_grouped(name: str, value) -> GroupedNVFP4Data:
    if not isinstance(value, GroupedNVFP4Data):
        hint = f" (use {name}.rowwise or {name}.columnwise)" if isinstance(value, GroupedNVFP4Tensor) else ""
        raise TypeError(f"{name} must be an fp4gen.GroupedNVFP4Data copy, got {type(value).__name__}{hint}")
    return value


def grouped_gemm(a: GroupedNVFP4Data, b: GroupedNVFP4Data, offsets=None, out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None, accumulate: bool = False, backend: str | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per group g, D_g = A_g @ B_g.T with the bilateral scale of fp4gen.gemm (each group's own amaxes):

    - a "rows" [T, K] (tokens sorted by group) x b "stacked" [E, N, K] -> D [T, N]: fprop (X rowwise, W
      rowwise) and dgrad (dY rowwise, W columnwise). bias: optional [E, N], group g's row added to its rows.
    - a "columns" [N, C] x b "columns" [K, C] (the groups along the padded token axis) -> D [E, N, K]: wgrad
      (dY columnwise, X columnwise), both quantized with the same offsets. accumulate=True adds into `out`
      (fp32 main grads [E, N, K]); an expert without tokens gets a zero gradient (or `out` unchanged).

    offsets: the token offsets both operands were quantized with (None: a.offsets), never read on the host.
    out_dtype: bfloat16 or float32 (default: out.dtype, else bfloat16)."""
    a, b = _require_grouped("a", a), _require_grouped("b", b)
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}; both operands must be on one device")
    if a.layout == "rows" and b.layout == "stacked":
        along_k = False
        (tokens, k), (groups, n, kb) = (a.data.shape[0], 2 * a.data.shape[1]), (*b.data.shape[:2], 2 * b.data.shape[2])
        if k != kb:
            raise ValueError(f"a is [T, K] = [{tokens}, {k}] and b is [E, N, K] = [{groups}, {n}, {kb}]; their K "
                             f"must match")
        if groups != a.groups:
            raise ValueError(f"a has {a.groups} groups but b stacks {groups} experts; they must match")
        shape = (tokens, n)
    elif a.layout == "columns" and b.layout == "columns":
        along_k = True
        (n, width), (k, width_b) = (a.data.shape[0], 2 * a.data.shape[1]), (b.data.shape[0], 2 * b.data.shape[1])
        if width != width_b or a.groups != b.groups:
            raise ValueError(f"a [N, C] = [{n}, {width}] with {a.groups} groups and b [K, C] = [{k}, {width_b}] with "
                             f"{b.groups} groups: both must be columnwise copies of one routing (equal C and E)")
        groups = a.groups
        shape = (groups, n, k)
        if bias is not None:
            raise ValueError("bias is added along N of a grouped GEMM over rows; the wgrad form takes none")
    else:
        raise ValueError(f"a is a {a.layout!r} copy and b a {b.layout!r} one; grouped_gemm multiplies a 'rows' copy "
                         f"by a 'stacked' one (fprop, dgrad) or two 'columns' copies (wgrad)")
    offsets = a.offsets if offsets is None else group_offsets(offsets, shape[0] if not along_k else None, a.device)
    if offsets.shape[0] != groups:
        raise ValueError(f"offsets has {offsets.shape[0]} group ends but the operands have {groups} groups")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        out_dtype = out.dtype if out_dtype is None else out_dtype
        if out.dtype != out_dtype:
            raise TypeError(f"out.dtype is {out.dtype} but out_dtype is {out_dtype}; they must agree")
        if tuple(out.shape) != shape or not out.is_contiguous() or out.device != a.device:
            raise ValueError(f"out must be a contiguous {list(shape)} tensor on {a.device}, got "
                             f"{list(out.shape)} on {out.device}")
    elif accumulate:
        raise ValueError("accumulate=True adds into `out`, but out is None; pass the tensor to add into")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in api.GEMM_OUT_DTYPES:
        raise TypeError(f"out_dtype is {out_dtype}; fp4gen.grouped_gemm produces "
                        f"{api.dtype_names(api.GEMM_OUT_DTYPES)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a floating-point tensor [E, N] or None")
        if tuple(bias.shape) != (groups, shape[1]) or bias.device != a.device:
            raise ValueError(f"bias must be [E, N] = [{groups}, {shape[1]}] on {a.device}, got {list(bias.shape)} on "
                             f"{bias.device}")
    name = api.choose_backend(a.device, backend)
    if name == "reference":
        from . import reference_grouped as impl
    else:
        from .cuda import grouped as impl
    return impl.grouped_gemm(a, b, offsets, along_k, shape, out_dtype, out, accumulate, bias)
