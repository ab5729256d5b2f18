"""How fp4gen.nn.Linear quantizes each tensor it multiplies (docs/recipes.md)."""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT_BLOCKS = ((1, 16), (16, 16))


@dataclass(frozen=True)
class Recipe:
    """row_scaled_activation: the input X is quantized with one amax per row (per token) for fprop and
    one per column for wgrad; otherwise per tensor. weight_block: (16, 16) tiles make the weight's
    columnwise copy the exact transpose of its rowwise copy; (1, 16) is per-row blocks. Weights and
    gradients are always scaled per tensor, and gradients use (1, 16) blocks, as upstream."""

    row_scaled_activation: bool = True
    weight_block: tuple = (16, 16)

    def __post_init__(self):
        if not isinstance(self.row_scaled_activation, bool):
            raise TypeError(f"row_scaled_activation must be a bool, got {self.row_scaled_activation!r}")
        block = tuple(self.weight_block) if isinstance(self.weight_block, (tuple, list)) else self.weight_block
        if block not in WEIGHT_BLOCKS:
            raise ValueError(f"weight_block={self.weight_block!r} is not supported; choose (16, 16) or (1, 16)")
        object.__setattr__(self, "weight_block", block)

    @property
    def activation_scaling(self) -> str:
        return "row" if self.row_scaled_activation else "tensor"
