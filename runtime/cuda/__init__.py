"""The CUDA backend: generated kernels loaded from the build output and dispatched by the manifest."""
from .ops import dequantize, gemm, quantize

__all__ = ["quantize", "dequantize", "gemm"]
