"""fp4gen: generated NVFP4 kernels for row-scaled low-precision training.

Public API (design.md section 2): quantize, dequantize, gemm, NVFP4Tensor, NVFP4Data, Recipe, nn.Linear,
BuildError.
"""
from . import nn
from .api import dequantize, gemm, quantize
from .errors import BuildError, KernelError
from .formats import NVFP4Data, NVFP4Tensor
from .recipe import Recipe

__all__ = ["quantize", "dequantize", "gemm", "NVFP4Data", "NVFP4Tensor", "Recipe", "nn", "BuildError",
           "KernelError"]
