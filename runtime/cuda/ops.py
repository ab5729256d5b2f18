"""The CUDA backend's operations: choose a kernel from the manifest, allocate outputs from the PyTorch
allocator, and launch on the current stream of the tensors' device."""
from __future__ import annotations

import torch

from ..formats import NVFP4Data
from .library import load_kernel
from .manifest import load_manifest
from .select import Problem, select


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _problem(op: str, device: torch.device, dtypes: dict, cols: int = 0, pointers=None) -> Problem:
    return Problem(op, tuple(torch.cuda.get_device_capability(device)),
                   {axis: _dtype_name(d) for axis, d in dtypes.items()}, cols, pointers or {})


def dequantize(operand: NVFP4Data, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = operand.shape
    device = operand.device
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    data, scale = operand.data, operand.scale.view(torch.uint8)
    amax = operand.amax.contiguous()
    # Alignment is a power of two, so OR-ing the row stride (bytes) into the base address checks both:
    # every row start is aligned iff the base and the stride are.
    row_stride = data.stride(0) if rows > 1 else 0
    problem = _problem("dequantize", device, {"out_dtype": dtype}, cols,
                       {"data": data.data_ptr() | row_stride, "out": out.data_ptr()})
    kernel = load_kernel(select(problem, load_manifest()))
    amax_stride = 1 if operand.row_scaled else 0
    with torch.cuda.device(device):  # the launch goes to the current device: make it the tensors' device
        kernel.run(data.data_ptr(), scale.data_ptr(), amax.data_ptr(), out.data_ptr(), rows, cols, data.stride(0),
                   scale.stride(0), amax_stride, out.stride(0), stream=torch.cuda.current_stream(device).cuda_stream)
    return out


def _not_launchable(problem: Problem):
    """No spec declares quantize or gemm kernels yet: select() raises the BuildError that says so. Should a
    manifest declare one before its launcher exists, say that instead of running anything else."""
    name = select(problem, load_manifest())
    raise NotImplementedError(f"{name} is declared but this runtime has no launcher for {problem.op} yet")


def quantize(x2d: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool):
    _not_launchable(_problem("quantize", x2d.device, {"in_dtype": x2d.dtype}, x2d.shape[-1]))


def gemm(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, out, accumulate: bool):
    _not_launchable(_problem("gemm", a.device, {"out_dtype": out_dtype}, a.shape[1]))
