"""Public entry points: argument checks, backend choice, then the backend does the work."""
from __future__ import annotations

import math
import os

import torch

from . import reference
from .formats import BLOCK, NVFP4Data, NVFP4Tensor
from .options import FOUR_OVER_SIX_MODES, ROUNDINGS, QuantizeOptions
from .rng import RNGState

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEQUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GEMM_OUT_DTYPES = (torch.bfloat16, torch.float32)
SCALINGS = ("row", "tensor")
BLOCKS = ((1, 16), (16, 16))
BACKENDS = ("reference", "cuda")


def dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def choose_backend(device: torch.device, backend: str | None) -> str:
    """`backend=` wins, then FP4GEN_BACKEND, then the device: CUDA tensors -> cuda, others -> reference."""
    source = "backend"
    if backend is None and os.environ.get("FP4GEN_BACKEND"):
        backend, source = os.environ["FP4GEN_BACKEND"], "FP4GEN_BACKEND"
    if backend is None:
        return "cuda" if device.type == "cuda" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"{source}={backend!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"{source}='cuda' needs CUDA tensors, but the input is on {device}")
    return backend


def refuse_function_transforms(caller: str) -> None:
    """Raise a clear error for a call made inside a torch.func transform (torch.func.grad, vmap, jacrev, ...).
    fp4gen's kernels read tensors' memory, and there the transform's wrapped tensors (and even the results of
    ops on plain tensors) have no storage of their own, so the call would otherwise fail deep inside ("Cannot
    access data pointer of Tensor that doesn't have storage"). torch.func.functional_call by itself is no
    transform and works. (torch.compile traces the check without a graph break.)"""
    if torch._C._functorch.maybe_current_level() is not None:
        raise RuntimeError(f"{caller} does not run under torch.func transforms (grad, vmap, jacrev, ...): its NVFP4 "
                           f"kernels read the tensors' memory, which the transforms' tensors do not expose. Take "
                           f"gradients with torch.autograd instead (loss.backward() or torch.autograd.grad); "
                           f"torch.func.functional_call without a transform works")


_cuda = None


def _cuda_backend():
    """The CUDA backend module, imported on first use (loading kernels is only needed for CUDA tensors) and
    then kept: an import statement on every call costs microseconds of import machinery."""
    global _cuda
    if _cuda is None:
        from . import cuda

        _cuda = cuda
    return _cuda


def _block_pair(block) -> tuple:
    """block as a tuple of two ints, one of BLOCKS; anything else is a clear error (a string such as "1x16"
    is not a pair, and bools or floats are not sizes)."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)):
        raise TypeError(f"block must be a pair of ints, (1, 16) or (16, 16), got {block!r}")
    block = tuple(block)
    if block not in BLOCKS:
        raise ValueError(f"block={block} is not supported; choose (1, 16) or (16, 16)")
    return block


def _options(x: torch.Tensor, block: tuple, columnwise: bool, rounding, rng, hadamard,
             four_over_six) -> QuantizeOptions:
    """The validated per-call options; rng resolved to a state on x's device when rounding is stochastic."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; choose one of {', '.join(map(repr, ROUNDINGS))}")
    if rng is not None and not isinstance(rng, RNGState):
        raise TypeError(f"rng must be an fp4gen.RNGState or None, got {type(rng).__name__}")
    if rounding == "stochastic":
        rng = rng if rng is not None else RNGState.default(x.device)
        if rng.device != x.device:
            raise ValueError(f"rng is on {rng.device} but x is on {x.device}; the state must be on x's device")
    elif rng is not None:
        raise ValueError("rng is given but rounding='nearest' draws no random bits; pass rounding='stochastic'")
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard={hadamard!r}: it must be True or False")
    if hadamard and block == (16, 16):
        raise ValueError("hadamard=True transforms activations and gradients (1x16 blocks), not 16x16 weights")
    if hadamard and not columnwise:
        raise ValueError("hadamard=True applies to the columnwise copy only; ask for it with columnwise=True")
    if four_over_six not in FOUR_OVER_SIX_MODES:
        raise ValueError(f"four_over_six={four_over_six!r} is not supported; choose None, 'mae' or 'mse'")
    if four_over_six is not None and rounding == "stochastic":
        raise ValueError("four_over_six chooses between two round-to-nearest candidates per block; it cannot "
                         "be combined with rounding='stochastic'")
    return QuantizeOptions(rounding, rng, hadamard, four_over_six)


def quantize(x: torch.Tensor, scaling: str = "row", block=(1, 16), rowwise: bool = True,
             columnwise: bool = True, backend: str | None = None, *, rounding: str = "nearest",
             rng: RNGState | None = None, hadamard: bool = False,
             four_over_six: str | None = None) -> NVFP4Tensor:
    """Quantize x [..., K] (flattened to [M, K]) to NVFP4.

    scaling: "row" (per-row amax for the rowwise copy, per-column amax for the columnwise copy) or
    "tensor" (one amax). block: (1, 16) or (16, 16) (16x16 tiles, per-tensor scaling only, for weights).
    rowwise gives the quantization of x [M, K]; columnwise that of x.T [K, M].

    rounding: "nearest" or "stochastic" (random bits keyed by rng's seed and offset and the element index;
    rng None uses the device's default state, fp4gen.RNGState.default). hadamard: quantize the columnwise
    copy from the 16-point random Hadamard transform of x.T (1x16 blocks), with its own amax. four_over_six:
    None, "mae" or "mse": each block takes whichever of its map-to-4 and map-to-6 scales errs less; such
    copies record e4m3_max = 256.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x.dtype is {x.dtype}; fp4gen.quantize takes {dtype_names(INPUT_DTYPES)}")
    refuse_function_transforms("fp4gen.quantize")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not supported; choose one of {', '.join(map(repr, SCALINGS))}")
    block = _block_pair(block)
    if block == (16, 16) and scaling == "row":
        raise ValueError("block=(16, 16) needs scaling='tensor': 16x16 tiles share one scale across "
                         "16 rows, so they cannot take a per-row amax")
    for name, value in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: it must be True or False")
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False; ask for at least one output")
    if x.dim() == 0:
        raise ValueError("x is a 0-d tensor; it needs at least one dimension [..., K]")
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    x2d = x.reshape(m, k)  # a view whenever the layout allows one
    if k % BLOCK:
        raise ValueError(f"x has K = x.shape[-1] = {k}; K must be a multiple of {BLOCK} (the NVFP4 block)")
    if (columnwise or block == (16, 16)) and m % BLOCK:
        why = "the columnwise copy blocks 16 rows" if columnwise else "16x16 blocks span 16 rows"
        hint = ("; append zero rows up to the next multiple (they change no amax and add nothing to a GEMM over M, "
                "as fp4gen.nn.Linear does for its tokens)" if columnwise else "")
        raise ValueError(f"x flattens to M = {m} rows; M must be a multiple of {BLOCK} because {why}{hint}")
    options = _options(x, block, columnwise, rounding, rng, hadamard, four_over_six)
    row, col = quantize_checked(x2d, scaling, block, rowwise, columnwise, options, backend)
    return NVFP4Tensor(row, col, tuple(x.shape), x.dtype, scaling, block)


def quantize_checked(x2d: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
                     options: QuantizeOptions, backend: str | None = None,
                     column_sums: torch.dtype | None = None) -> tuple:
    """fp4gen.quantize after its checks: (rowwise, columnwise) NVFP4Data (or None) of a 2-D x2d whose arguments
    already meet quantize's rules (block a tuple, options validated). fp4gen.nn calls it directly for the
    layers' own tensors, whose shapes, dtypes and options the layer checked.

    column_sums (tensor scaling): also x2d's column sums [K] in this dtype (torch.float32 or x2d's own: summed in
    fp32, rounded once), (rowwise, columnwise, sums): a gradient's bias gradient, which the CUDA backend makes in
    the amax pass that reads x2d anyway."""
    name = choose_backend(x2d.device, backend)
    impl = reference if name == "reference" else _cuda_backend()
    result = impl.quantize(x2d, scaling, block, rowwise, columnwise, options, column_sums=column_sums)
    if options.rng is not None:
        options.rng.advance()  # on the device, after the kernels that read the offset (stream order)
    return result


def _require_operand(name: str, value) -> NVFP4Data:
    if not isinstance(value, NVFP4Data):
        hint = f" (use {name}.rowwise or {name}.columnwise)" if isinstance(value, NVFP4Tensor) else ""
        raise TypeError(f"{name} must be an fp4gen.NVFP4Data operand, got {type(value).__name__}{hint}")
    return value


def dequantize(operand: NVFP4Data, dtype: torch.dtype = torch.bfloat16,
               backend: str | None = None) -> torch.Tensor:
    """Decode an NVFP4 operand to a [rows, cols] tensor of `dtype` (bfloat16, float16 or float32)."""
    operand = _require_operand("operand", operand)
    if dtype not in DEQUANTIZE_DTYPES:
        raise TypeError(f"dtype={dtype}; fp4gen.dequantize produces {dtype_names(DEQUANTIZE_DTYPES)}")
    name = choose_backend(operand.device, backend)
    impl = reference if name == "reference" else _cuda_backend()
    return impl.dequantize(operand, dtype)


def gemm(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
         accumulate: bool = False, backend: str | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """D = A @ B.T for K-major NVFP4 operands a [M, K] and b [N, K], with the bilateral scale
    D[i, j] = acc[i, j] * (a.amax[i or 0] / 2688) * (b.amax[j or 0] / 2688) applied in the epilogue.

    out_dtype defaults to out.dtype when `out` is given, else bfloat16. accumulate=True adds D into
    `out` (for fp32 main-grad accumulation) and returns it. bias, a vector of N floats (any float dtype,
    taken as its fp32 value), is added to every row in the epilogue, before the one rounding to out_dtype.
    """
    a = _require_operand("a", a)
    b = _require_operand("b", b)
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}; both operands must be on one device")
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"a is [M, K] = [{m}, {k}] and b is [N, K] = [{n}, {kb}]; their K must match "
                         f"(both operands are K-major)")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out_dtype is None:
            out_dtype = out.dtype
        if out.dtype != out_dtype:
            raise TypeError(f"out.dtype is {out.dtype} but out_dtype is {out_dtype}; they must agree")
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out has shape {tuple(out.shape)}; for a [{m}, {k}] and b [{n}, {k}] it must "
                             f"be [{m}, {n}]")
        if out.device != a.device:
            raise ValueError(f"out is on {out.device} but the operands are on {a.device}")
    elif accumulate:
        raise ValueError("accumulate=True adds into `out`, but out is None; pass the tensor to add into")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in GEMM_OUT_DTYPES:
        raise TypeError(f"out_dtype is {out_dtype}; fp4gen.gemm produces {dtype_names(GEMM_OUT_DTYPES)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if not bias.is_floating_point():
            raise TypeError(f"bias.dtype is {bias.dtype}; it must be a floating-point dtype")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; for b [{n}, {k}] it must be [{n}]")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but the operands are on {a.device}")
    return gemm_checked(a, b, out_dtype, out, accumulate, backend, bias)


def gemm_checked(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, out: torch.Tensor | None = None,
                 accumulate: bool = False, backend: str | None = None, bias: torch.Tensor | None = None):
    """fp4gen.gemm after its checks (out_dtype resolved): for operands and arguments that already meet its
    rules, such as fp4gen.nn's own."""
    name = choose_backend(a.device, backend)
    impl = reference if name == "reference" else _cuda_backend()
    return impl.gemm(a, b, out_dtype, out, accumulate, bias)
