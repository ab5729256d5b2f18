"""A single warm fp4gen.quantize call of bf16 8192x8192 (row-scaled, both directions), to run under a
profiler: ncu --clock-control none -k regex:"quantize_kernel|amax_kernel" python3 bench/profile_quantize.py"""
import torch

import fp4gen

x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
fp4gen.quantize(x)  # loads the libraries
torch.cuda.synchronize()
fp4gen.quantize(x)
torch.cuda.synchronize()
