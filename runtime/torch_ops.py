"""fp4gen's operations as torch.library custom ops (namespace `fp4gen`) with fake implementations, so
torch.compile and CUDA graphs see opaque, shape-known operators instead of Python and ctypes calls.

Operands travel as (data, scale, amax) tensor triples; an absent direction is three empty tensors. An
operand's e4m3_max (448, or 256 after 4over6) travels beside its triple as a float: the caller knows it
from the options it quantized with.

Stochastic rounding's state travels as the RNGState's int64 [seed, offset] tensor, which the quantize op
advances in place (declared as a mutated argument); without stochastic rounding it is an empty tensor.
"""
from __future__ import annotations

import functools
import types
from typing import Optional

import torch

from . import api
from .formats import BLOCK, NVFP4Data
from .rng import RNGState

Triple = tuple  # (data uint8, scale float8_e4m3fn, amax float32)


def _absent(x: torch.Tensor) -> list:
    return [x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float8_e4m3fn),
            x.new_empty(0, dtype=torch.float32)]


def _quantize(x: torch.Tensor, scaling: str, block: list[int], rowwise: bool, columnwise: bool, rounding: str,
              hadamard: bool, four_over_six: Optional[str],
              rng_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    rng = RNGState.from_tensor(rng_state) if rounding == "stochastic" else None
    q = api.quantize(x, scaling=scaling, block=tuple(block), rowwise=rowwise, columnwise=columnwise,
                     rounding=rounding, rng=rng, hadamard=hadamard, four_over_six=four_over_six)
    row = [q.rowwise.data, q.rowwise.scale, q.rowwise.amax] if rowwise else _absent(x)
    col = [q.columnwise.data, q.columnwise.scale, q.columnwise.amax] if columnwise else _absent(x)
    if rowwise and columnwise and col[2] is row[2]:
        col[2] = col[2].clone()  # per-tensor scaling shares one amax; custom op outputs may not alias
    return (*row, *col)


quantize = torch.library.custom_op("fp4gen::quantize", mutates_args=("rng_state",))(_quantize)


@quantize.register_fake
def _(x, scaling, block, rowwise, columnwise, rounding, hadamard, four_over_six, rng_state):
    k = x.shape[-1]
    m = x.numel() // k if k else 0

    def operand(rows, cols, vector_amax):
        return [x.new_empty(rows, cols // 2, dtype=torch.uint8),
                x.new_empty(rows, cols // BLOCK, dtype=torch.float8_e4m3fn),
                x.new_empty(rows if vector_amax else 1, dtype=torch.float32)]

    row_scaled = scaling == "row"
    row = operand(m, k, row_scaled) if rowwise else _absent(x)
    col = operand(k, m, row_scaled) if columnwise else _absent(x)
    return (*row, *col)


def _gemm_with(operand, a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype, a_e4m3_max, b_e4m3_max,
               bias=None):
    """The gemm op's body, its operands built by `operand` (NVFP4Data, which checks them, or
    NVFP4Data._made_by_fp4gen for fp4gen.nn's own triples); bias (or None) added in the epilogue."""
    d = api.gemm(operand(a_data, a_scale, a_amax, a_e4m3_max), operand(b_data, b_scale, b_amax, b_e4m3_max),
                 out_dtype=out_dtype, bias=bias)
    return d.contiguous()  # a padded-N CUDA result is a strided view; the fake promises a dense tensor


def _gemm(a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor,
          b_scale: torch.Tensor, b_amax: torch.Tensor, out_dtype: torch.dtype, a_e4m3_max: float,
          b_e4m3_max: float, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _gemm_with(NVFP4Data, a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype, a_e4m3_max, b_e4m3_max,
                      bias)


gemm = torch.library.custom_op("fp4gen::gemm", mutates_args=())(_gemm)


@gemm.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype, a_e4m3_max, b_e4m3_max, bias=None):
    return a_data.new_empty(a_data.shape[0], b_data.shape[0], dtype=out_dtype)


def _gemm_accumulate_with(operand, out, a_data, a_scale, a_amax, b_data, b_scale, b_amax, a_e4m3_max, b_e4m3_max):
    api.gemm(operand(a_data, a_scale, a_amax, a_e4m3_max), operand(b_data, b_scale, b_amax, b_e4m3_max),
             out=out, accumulate=True)


def _gemm_accumulate(out: torch.Tensor, a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                     b_data: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor, a_e4m3_max: float,
                     b_e4m3_max: float) -> None:
    _gemm_accumulate_with(NVFP4Data, out, a_data, a_scale, a_amax, b_data, b_scale, b_amax, a_e4m3_max, b_e4m3_max)


gemm_accumulate = torch.library.custom_op("fp4gen::gemm_accumulate", mutates_args=("out",))(_gemm_accumulate)


@gemm_accumulate.register_fake
def _(out, a_data, a_scale, a_amax, b_data, b_scale, b_amax, a_e4m3_max, b_e4m3_max):
    return None


# The ops' Python bodies: the same computation without the dispatcher's per-call cost (about 25 us per op
# on our build machine's CPU, several percent of an eager training step), taking fp4gen.nn's triples (made by
# fp4gen's quantize) without checking them again.
_EAGER = types.SimpleNamespace(
    quantize=_quantize,
    gemm=functools.partial(_gemm_with, NVFP4Data._made_by_fp4gen),
    gemm_accumulate=functools.partial(_gemm_accumulate_with, NVFP4Data._made_by_fp4gen))


def for_caller():
    """torch.ops.fp4gen while torch.compile traces (opaque operators with fake implementations), the plain
    Python bodies in eager mode and under CUDA-graph capture."""
    return torch.ops.fp4gen if torch.compiler.is_compiling() else _EAGER
