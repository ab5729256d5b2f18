"""fp4gen.gemm on the current GPU against cuBLAS bf16 and a compiled dequantize-then-matmul.

For each (M, N, K): fp4gen.gemm (the whole call: for M <= 128 the fused kernel that reads the packed
operands, else operand dequantization to block-scaled fp16 scratch plus the wgmma GEMM; both with the
bilateral epilogue), cuBLAS bf16 (`a @ b.T` on bf16 operands of the same shapes), and a `torch.compile`d
reference dequantize-then-matmul; TFLOP/s counts 2*M*N*K. The last column names the kernel chosen (the
autotuner's measured choice, made by the first call of each shape: see docs/kernel-selection.md). The
shapes of issue 4 come first, then two around the fused/wgmma crossover (M = 64 and 256).

--candidates: instead, every built kernel that can take each shape, forced by FP4GEN_KERNEL, its graph time
against cuBLAS bf16, fastest first, and which one the deterministic rule (no measurement) picks.
"""
import os
import sys

import torch

import fp4gen
from fp4gen import reference
from fp4gen.cuda import ops
from fp4gen.cuda.manifest import load_manifest
from fp4gen.cuda.ops import gemm_kernel
from fp4gen.cuda.select import Problem, viable
from timing import graph_median_ms, median_ms

SHAPES = [(8192, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096), (128, 8192, 8192), (16, 8192, 8192),
          (64, 8192, 8192), (256, 8192, 8192)]


def emulation(a, b):
    return reference.dequantize(a, torch.bfloat16) @ reference.dequantize(b, torch.bfloat16).t()


def operands(m, n, k):
    """bf16 x [m, k] and w [n, k], and their NVFP4 copies as the training GEMMs take them (X row-scaled,
    W a per-tensor 16x16-block weight)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a = fp4gen.quantize(x, scaling="row", columnwise=False).rowwise
    b = fp4gen.quantize(w, scaling="tensor", block=(16, 16), columnwise=False).rowwise
    return x, w, a, b


def main():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'M x N x K':>18} {'fp4gen us':>9} {'graph us':>8} {'TFLOP/s':>7} {'cuBLAS us':>9} {'vs cuBLAS':>9} "
          f"{'emul. us':>9} {'vs emul.':>8}  kernel")
    compiled = torch.compile(emulation, dynamic=False)
    for m, n, k in SHAPES:
        x, w, a, b = operands(m, n, k)
        ms = median_ms(lambda: fp4gen.gemm(a, b))
        graph_ms = graph_median_ms(lambda: fp4gen.gemm(a, b))
        cublas_ms = median_ms(lambda: x @ w.t())
        emul_ms = median_ms(lambda: compiled(a, b))
        tflops = 2 * m * n * k / ms / 1e9
        print(f"{m:>6}x{n}x{k:<5} {ms * 1e3:>9.1f} {graph_ms * 1e3:>8.1f} {tflops:>7.0f} {cublas_ms * 1e3:>9.1f} "
              f"{cublas_ms / ms:>9.2f} {emul_ms * 1e3:>9.1f} {emul_ms / ms:>8.2f}  {gemm_kernel(a, b, torch.bfloat16).name}")


CANDIDATE_SHAPES = SHAPES + [(8192, 4096, 4096), (8192, 14336, 4096), (512, 8192, 8192), (1024, 1024, 1024)]


def candidates():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    capability = torch.cuda.get_device_capability()
    for m, n, k in CANDIDATE_SHAPES:
        x, w, a, b = operands(m, n, k)
        cublas_us = graph_median_ms(lambda: x @ w.t()) * 1e3
        os.environ["FP4GEN_AUTOTUNE"] = "0"
        ops.clear_plans()
        rule = gemm_kernel(a, b, torch.bfloat16).name
        rows = []
        for name in viable(Problem("gemm", capability, {"out_dtype": "bfloat16"}, {}, k, m), load_manifest()):
            os.environ["FP4GEN_KERNEL"] = name
            ops.clear_plans()
            rows.append((graph_median_ms(lambda: fp4gen.gemm(a, b)) * 1e3, name))
        del os.environ["FP4GEN_KERNEL"]
        print(f"{m}x{n}x{k}: cuBLAS bf16 {cublas_us:.1f} us")
        for us, name in sorted(rows):
            print(f"    {us:9.1f} us  {cublas_us / us:5.2f}x cuBLAS  {name}{'  <- rule' if name == rule else ''}")


if __name__ == "__main__":
    candidates() if "--candidates" in sys.argv[1:] else main()
