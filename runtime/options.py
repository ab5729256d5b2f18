"""The per-call quantization options beyond scaling and block shape, validated once by fp4gen.quantize and
handed to a backend as one frozen object."""
from __future__ import annotations

from dataclasses import dataclass

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
