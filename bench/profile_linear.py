"""Where the time of one fp4gen.nn.Linear forward+backward goes (8192x4096 -> 4096, bf16): the CUDA
kernels of a few warm steps under torch.profiler, summed by kernel name, largest first. Run on a GPU:
    python bench/profile_linear.py [--out 14336]"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fp4gen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--out", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    layer = fp4gen.nn.Linear(args.in_features, args.out, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, args.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.tokens, args.out, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    print(f"{args.tokens}x{args.in_features} -> {args.out}, per step (mean of {args.steps}):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
