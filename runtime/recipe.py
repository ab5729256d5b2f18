"""How fp4gen.nn.Linear quantizes each tensor it multiplies (docs/recipes.md)."""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT_BLOCKS = ((1, 16), (16, 16))
GRADIENT_SCALINGS = ("tensor", "row")
FOUR_OVER_SIX_TENSORS = (None, "weights", "activations", "all")
FOUR_OVER_SIX_ERRORS = ("mae", "mse")


@dataclass(frozen=True)
class Recipe:
    """Which NVFP4 options each operand of fp4gen.nn.Linear's three GEMMs gets.

    row_scaled_activation: X is quantized with one amax per row (per token) for fprop and one per column for
    wgrad; otherwise per tensor. weight_block: (16, 16) tiles make the weight's columnwise copy the exact
    transpose of its rowwise copy; (1, 16) is per-row blocks. gradient_scaling: dY per "tensor" or per
    "row" (per token for dgrad, per column for wgrad), always in (1, 16) blocks. The weight is always scaled
    per tensor.

    stochastic_rounding: dY's copies are rounded stochastically (unbiased gradients), from the device's
    default fp4gen.RNGState. hadamard_wgrad: the wgrad operands, X's and dY's columnwise copies, are both
    quantized from their 16-point random Hadamard transform along the tokens (together or not at all: only
    the pair leaves dYᵀX unchanged). four_over_six: the tensors whose blocks each choose between the map-to-4
    and map-to-6 scale ("weights", "activations" = X, or "all" = both; never gradients), by
    four_over_six_error ("mae" or "mse").
    """

    row_scaled_activation: bool = True
    weight_block: tuple = (16, 16)
    gradient_scaling: str = "tensor"
    stochastic_rounding: bool = False
    hadamard_wgrad: bool = True
    four_over_six: str | None = None
    four_over_six_error: str = "mae"

    def __post_init__(self):
        for name in ("row_scaled_activation", "stochastic_rounding", "hadamard_wgrad"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        block = tuple(self.weight_block) if isinstance(self.weight_block, (tuple, list)) else self.weight_block
        if block not in WEIGHT_BLOCKS:
            raise ValueError(f"weight_block={self.weight_block!r} is not supported; choose (16, 16) or (1, 16)")
        object.__setattr__(self, "weight_block", block)
        if self.gradient_scaling not in GRADIENT_SCALINGS:
            raise ValueError(f"gradient_scaling={self.gradient_scaling!r} is not supported; choose 'tensor' or "
                             f"'row'")
        if self.four_over_six not in FOUR_OVER_SIX_TENSORS:
            hint = " (gradients never take 4over6: its choice is biased, and gradients need unbiased rounding)" \
                if self.four_over_six in ("gradients", "grads") else ""
            raise ValueError(f"four_over_six={self.four_over_six!r} is not supported; choose None, 'weights', "
                             f"'activations' or 'all'{hint}")
        if self.four_over_six_error not in FOUR_OVER_SIX_ERRORS:
            raise ValueError(f"four_over_six_error={self.four_over_six_error!r} is not supported; choose 'mae' "
                             f"or 'mse'")

    @property
    def activation_scaling(self) -> str:
        return "row" if self.row_scaled_activation else "tensor"

    def _four_over_six_for(self, tensor: str) -> str | None:
        return self.four_over_six_error if self.four_over_six in (tensor, "all") else None

    @property
    def activation_four_over_six(self) -> str | None:
        """X's four_over_six argument to fp4gen.quantize."""
        return self._four_over_six_for("activations")

    @property
    def weight_four_over_six(self) -> str | None:
        """W's four_over_six argument to fp4gen.quantize."""
        return self._four_over_six_for("weights")

    @property
    def gradient_rounding(self) -> str:
        return "stochastic" if self.stochastic_rounding else "nearest"
