"""The grouped operations as torch.library custom ops (namespace `fp4gen`) with fake implementations, so that
torch.compile traces fp4gen.nn.GroupedLinear as opaque, shape-known operators.

A grouped copy travels as its (data, scale, amax) tensors plus static facts, (layout, row_scaled, e4m3_max),
that the caller knows from its recipe; an absent copy is three empty tensors. The columnwise copy of tokens
also returns its padded offsets. Under torch.compile the ops go through the dispatcher; in eager mode and
under CUDA-graph capture callers use the same bodies directly (for_caller).
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from . import grouped
from .formats import BLOCK, GroupedNVFP4Data
from .rng import RNGState

Meta = tuple  # (layout, row_scaled, e4m3_max) of a grouped copy


def _empty(like: torch.Tensor, dtype) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)


def _quantize(x: torch.Tensor, offsets: Optional[torch.Tensor], scaling: str, block: list[int], rowwise: bool,
              columnwise: bool, rounding: str, hadamard: bool, four_over_six: Optional[str],
              rng_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor]:
    rng = RNGState.from_tensor(rng_state) if rounding == "stochastic" else None
    q = grouped.quantize_grouped(x, offsets, scaling=scaling, block=tuple(block), rowwise=rowwise,
                                 columnwise=columnwise, rounding=rounding, rng=rng, hadamard=hadamard,
                                 four_over_six=four_over_six)
    absent = [_empty(x, torch.uint8), _empty(x, torch.float8_e4m3fn), _empty(x, torch.float32)]
    row = [q.rowwise.data, q.rowwise.scale, q.rowwise.amax] if rowwise else absent
    col = [q.columnwise.data, q.columnwise.scale, q.columnwise.amax] if columnwise else list(absent)
    padded = q.columnwise.padded_offsets if columnwise and q.columnwise.padded_offsets is not None else \
        _empty(x, torch.int64)
    return (*row, *col, padded)


quantize = torch.library.custom_op("fp4gen::quantize_grouped", mutates_args=("rng_state",))(_quantize)


@quantize.register_fake
def _(x, offsets, scaling, block, rowwise, columnwise, rounding, hadamard, four_over_six, rng_state):
    row_scaled, k = scaling == "row", x.shape[-1]
    f32, u8, e4m3 = torch.float32, torch.uint8, torch.float8_e4m3fn
    absent = [_empty(x, u8), _empty(x, e4m3), _empty(x, f32)]
    if offsets is None:  # stacked [E, N, K]
        e, n = x.shape[0], x.shape[1]
        row = [x.new_empty(e, n, k // 2, dtype=u8), x.new_empty(e, n, k // BLOCK, dtype=e4m3),
               x.new_empty(*((e, n) if row_scaled else (e,)), dtype=f32)]
        col = [x.new_empty(e, k, n // 2, dtype=u8), x.new_empty(e, k, n // BLOCK, dtype=e4m3),
               x.new_empty(*((e, k) if row_scaled else (e,)), dtype=f32)]
        padded = _empty(x, torch.int64)
    else:
        t, e = x.shape[0], offsets.shape[0]
        c = grouped.capacity(t, e)
        row = [x.new_empty(t, k // 2, dtype=u8), x.new_empty(t, k // BLOCK, dtype=e4m3),
               x.new_empty(t if row_scaled else e, dtype=f32)]
        col = [x.new_empty(k, c // 2, dtype=u8), x.new_empty(k, c // BLOCK, dtype=e4m3),
               x.new_empty(*((e, k) if row_scaled else (e,)), dtype=f32)]
        padded = x.new_empty(e, dtype=torch.int64) if columnwise else _empty(x, torch.int64)
    return (*(row if rowwise else absent), *(col if columnwise else absent), padded)


def _copy(data, scale, amax, offsets, meta: Meta) -> GroupedNVFP4Data:
    layout, row_scaled, e4m3_max = meta
    padded = grouped.padded_offsets(offsets) if layout == "columns" else None
    return GroupedNVFP4Data._made_by_fp4gen(data, scale, amax, layout, row_scaled,
                                            None if layout == "stacked" else offsets, padded, e4m3_max)


def _gemm(a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor,
          b_scale: torch.Tensor, b_amax: torch.Tensor, offsets: torch.Tensor, a_layout: str, a_row_scaled: bool,
          a_e4m3_max: float, b_layout: str, b_row_scaled: bool, b_e4m3_max: float, out_dtype: torch.dtype,
          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    a = _copy(a_data, a_scale, a_amax, offsets, (a_layout, a_row_scaled, a_e4m3_max))
    b = _copy(b_data, b_scale, b_amax, offsets, (b_layout, b_row_scaled, b_e4m3_max))
    return grouped.grouped_gemm(a, b, offsets, out_dtype=out_dtype, bias=bias)


gemm = torch.library.custom_op("fp4gen::grouped_gemm", mutates_args=())(_gemm)


@gemm.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, offsets, a_layout, a_row_scaled, a_e4m3_max, b_layout,
      b_row_scaled, b_e4m3_max, out_dtype, bias=None):
    if a_layout == "rows":  # [T, K] x [E, N, K] -> [T, N]
        return a_data.new_empty(a_data.shape[0], b_data.shape[1], dtype=out_dtype)
    return a_data.new_empty(offsets.shape[0], a_data.shape[0], b_data.shape[0], dtype=out_dtype)  # [E, N, K]


def _gemm_accumulate(out: torch.Tensor, a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                     b_data: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor, offsets: torch.Tensor,
                     a_layout: str, a_row_scaled: bool, a_e4m3_max: float, b_layout: str, b_row_scaled: bool,
                     b_e4m3_max: float) -> None:
    a = _copy(a_data, a_scale, a_amax, offsets, (a_layout, a_row_scaled, a_e4m3_max))
    b = _copy(b_data, b_scale, b_amax, offsets, (b_layout, b_row_scaled, b_e4m3_max))
    grouped.grouped_gemm(a, b, offsets, out=out, accumulate=True)


gemm_accumulate = torch.library.custom_op("fp4gen::grouped_gemm_accumulate", mutates_args=("out",))(_gemm_accumulate)


@gemm_accumulate.register_fake
def _(out, a_data, a_scale, a_amax, b_data, b_scale, b_amax, offsets, a_layout, a_row_scaled, a_e4m3_max, b_layout,
      b_row_scaled, b_e4m3_max):
    return None


_EAGER = types.SimpleNamespace(quantize=_quantize, gemm=_gemm, gemm_accumulate=_gemm_accumulate)
_COMPILED = types.SimpleNamespace(quantize=torch.ops.fp4gen.quantize_grouped, gemm=torch.ops.fp4gen.grouped_gemm,
                                  gemm_accumulate=torch.ops.fp4gen.grouped_gemm_accumulate)


def for_caller():
    """The dispatcher's ops while torch.compile traces, the plain bodies otherwise (no dispatcher cost)."""
    return _COMPILED if torch.compiler.is_compiling() else _EAGER
