"""fp4gen: generated NVFP4 kernels for row-scaled low-precision training.

Public API: quantize, dequantize, gemm, quantize_grouped, grouped_gemm, NVFP4Tensor, NVFP4Data, GroupedNVFP4Tensor,
GroupedNVFP4Data, Recipe, RNGState, nn.Linear, nn.GroupedLinear, convert, unconvert, ConversionReport, BuildError,
KernelError; and the submodule fp4gen.hf_experts (imported explicitly: it needs Hugging Face transformers), the
experts of transformers' mixture-of-experts models in NVFP4. docs/api.md in the source tree describes each.
"""
from importlib import metadata as _metadata

from . import nn
from .api import dequantize, gemm, quantize
from .convert import ConversionReport, convert, unconvert
from .errors import BuildError, KernelError
from .formats import GroupedNVFP4Data, GroupedNVFP4Tensor, NVFP4Data, NVFP4Tensor
from .grouped import grouped_gemm, quantize_grouped
from .recipe import Recipe
from .rng import RNGState

try:
    __version__ = _metadata.version("fp4gen")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never pip-installed
    __version__ = "0+unknown"

__all__ = ["quantize", "dequantize", "gemm", "quantize_grouped", "grouped_gemm", "NVFP4Data", "NVFP4Tensor", "GroupedNVFP4Data",
           "GroupedNVFP4Tensor", "Recipe", "RNGState", "nn", "convert", "unconvert",
           "ConversionReport", "BuildError", "KernelError", "__version__"]
