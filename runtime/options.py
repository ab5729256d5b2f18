"""The per-call quantization options beyond scaling and block shape, validated once by fp4gen.quantize and
handed to a backend as one frozen object."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rng import RNGState

ROUNDINGS = ("nearest", "stochastic")
FOUR_OVER_SIX_MODES = (None, "mae", "mse")


@dataclass(frozen=True)
class QuantizeOptions:
    rounding: str = "nearest"  # "stochastic": random bits from `rng`
    rng: RNGState | None = None  # set exactly when rounding == "stochastic"
    hadamard: bool = False  # the 16-point random Hadamard transform on the columnwise copy
    four_over_six: str | None = None  # None, "mae" or "mse": per-block choice of map-to-4 or map-to-6


DEFAULT_OPTIONS = QuantizeOptions()


def check_column_sums(column_sums, scaling: str, x_dtype: torch.dtype) -> None:
    """A backend's check of its quantize's column_sums argument (a gradient's bias gradient, made by the pass
    that reads the gradient for its tensor amax): None, or torch.float32 or x's dtype with tensor scaling."""
    if column_sums is None:
        return
    if scaling != "tensor":
        raise ValueError("column_sums are made with tensor scaling; scaling is " + repr(scaling))
    if column_sums not in (torch.float32, x_dtype):
        raise ValueError(f"column_sums={column_sums} is neither torch.float32 nor x's dtype {x_dtype}")


def column_sums_dtype(bias_dtype: torch.dtype, dy_dtype: torch.dtype) -> torch.dtype:
    """The dtype in which dY's quantization writes its column sums for a bias gradient in bias_dtype: the bias's
    own where the kernels can write it (dY's dtype, or fp32), so that db needs no conversion; else fp32."""
    return bias_dtype if bias_dtype in (dy_dtype, torch.float32) else torch.float32
