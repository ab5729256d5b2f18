"""fp4gen's operations as torch.library custom ops (namespace `fp4gen`) with fake implementations, so
torch.compile and CUDA graphs see opaque, shape-known operators instead of Python and ctypes calls.

Operands travel as (data, scale, amax) tensor triples; an absent direction is three empty tensors. An
operand's e4m3_max (448, or 256 after 4over6) travels beside its triple as a float: the caller knows it
from the options it quantized with.

Stochastic rounding's state travels as the RNGState's int64 [seed, offset] tensor, which the quantize op
advances in place (declared as a mutated argument); without stochastic rounding it is an empty tensor.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from . import api
from .formats import BLOCK, NVFP4Data
from .options import QuantizeOptions
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
    return _triples(x, q.rowwise, q.columnwise)


def _triples(x: torch.Tensor, row, col) -> tuple:
    """The quantize op's six outputs from its two copies (NVFP4Data or None)."""
    row = [row.data, row.scale, row.amax] if row is not None else _absent(x)
    col = [col.data, col.scale, col.amax] if col is not None else _absent(x)
    if col[2] is row[2]:
        col[2] = col[2].clone()  # per-tensor scaling shares one amax; custom op outputs may not alias
    return (*row, *col)


def _quantize_unchecked(x: torch.Tensor, scaling: str, block, rowwise: bool, columnwise: bool, rounding: str,
                        hadamard: bool, four_over_six: Optional[str], rng_state: torch.Tensor,
                        column_sums: Optional[torch.dtype] = None) -> tuple:
    """The quantize op's computation for fp4gen.nn's own tensors in eager mode, without fp4gen.quantize's
    checks: the layer checked x's shape and dtype, and its Recipe the options. column_sums (tensor scaling):
    a seventh output, x's column sums in that dtype (torch.float32 or x's; the eager path only: the op itself
    has six outputs)."""
    rng = RNGState.from_tensor(rng_state) if rounding == "stochastic" else None
    result = api.quantize_checked(x, scaling, tuple(block), rowwise, columnwise,
                                  QuantizeOptions(rounding, rng, hadamard, four_over_six), column_sums=column_sums)
    # an absent copy is three Nones here, not the op's three empty tensors (allocations nothing reads)
    return (*_triple_or_nones(result[0]), *_triple_or_nones(result[1]), *result[2:])


def _triple_or_nones(operand) -> tuple:
    return (operand.data, operand.scale, operand.amax) if operand is not None else (None, None, None)


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


def _gemm(a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor,
          b_scale: torch.Tensor, b_amax: torch.Tensor, out_dtype: torch.dtype, a_e4m3_max: float,
          b_e4m3_max: float, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gemm op's body: the operands checked as NVFP4Data, bias (or None) added in the epilogue."""
    d = api.gemm(NVFP4Data(a_data, a_scale, a_amax, a_e4m3_max), NVFP4Data(b_data, b_scale, b_amax, b_e4m3_max),
                 out_dtype=out_dtype, bias=bias)
    return d.contiguous()  # a padded-N CUDA result is a strided view; the fake promises a dense tensor


gemm = torch.library.custom_op("fp4gen::gemm", mutates_args=())(_gemm)


@gemm.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype, a_e4m3_max, b_e4m3_max, bias=None):
    return a_data.new_empty(a_data.shape[0], b_data.shape[0], dtype=out_dtype)


def _gemm_accumulate(out: torch.Tensor, a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                     b_data: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor, a_e4m3_max: float,
                     b_e4m3_max: float) -> None:
    api.gemm(NVFP4Data(a_data, a_scale, a_amax, a_e4m3_max), NVFP4Data(b_data, b_scale, b_amax, b_e4m3_max),
             out=out, accumulate=True)


gemm_accumulate = torch.library.custom_op("fp4gen::gemm_accumulate", mutates_args=("out",))(_gemm_accumulate)


@gemm_accumulate.register_fake
def _(out, a_data, a_scale, a_amax, b_data, b_scale, b_amax, a_e4m3_max, b_e4m3_max):
    return None


def _gemm_unchecked(a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype, a_e4m3_max, b_e4m3_max, bias=None):
    """The gemm op's body for fp4gen.nn's own triples (made by fp4gen's quantize) in eager mode, unchecked."""
    made = NVFP4Data._made_by_fp4gen
    d = api.gemm_checked(made(a_data, a_scale, a_amax, a_e4m3_max), made(b_data, b_scale, b_amax, b_e4m3_max),
                         out_dtype, bias=bias)
    return d.contiguous()


def _gemm_accumulate_unchecked(out, a_data, a_scale, a_amax, b_data, b_scale, b_amax, a_e4m3_max, b_e4m3_max):
    made = NVFP4Data._made_by_fp4gen
    api.gemm_checked(made(a_data, a_scale, a_amax, a_e4m3_max), made(b_data, b_scale, b_amax, b_e4m3_max),
                     out.dtype, out, True)


# The ops' computations without the dispatcher's per-call cost (about 25 us per op on our build machine's CPU)
# and without the public functions' argument checks: fp4gen.nn passes its own checked tensors and the triples
# that fp4gen's quantize made, which need no second check. Host time is what an eager step of a small layer
# spends most of its time on.
EAGER = types.SimpleNamespace(
    quantize=_quantize_unchecked, gemm=_gemm_unchecked, gemm_accumulate=_gemm_accumulate_unchecked)


def for_caller():
    """torch.ops.fp4gen while torch.compile traces (opaque operators with fake implementations), the plain
    Python bodies in eager mode and under CUDA-graph capture."""
    return torch.ops.fp4gen if torch.compiler.is_compiling() else EAGER
