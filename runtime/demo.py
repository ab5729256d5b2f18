"""Train a small MLP twice on synthetic data, with fp4gen.nn.Linear (NVFP4, row-scaled activations) and
with torch.nn.Linear in bf16, and compare the loss curves.

    python -m fp4gen.demo [--steps 200] [--device cpu|cuda] [--out fp4gen_demo_loss.png]

Prints a table of both losses, the final-loss ratio (NVFP4 / bf16), and saves the curves as a PNG.
"""
from __future__ import annotations

import argparse
import time

import torch

from . import nn as fp4nn
from .plot_png import line_chart

WIDTH, DEPTH, BATCH = 256, 4, 256


def _model(linear, seed, device):
    torch.manual_seed(seed)
    layers = []
    for i in range(DEPTH):
        layers.append(linear(WIDTH, WIDTH, device=device, dtype=torch.bfloat16))
        if i < DEPTH - 1:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def _teacher_batch(teacher, step, device):
    g = torch.Generator(device=device).manual_seed(1000 + step)
    x = torch.randn(BATCH, WIDTH, device=device, generator=g, dtype=torch.bfloat16)
    with torch.no_grad():
        return x, teacher(x)


def train(linear, steps, device) -> list:
    teacher = _model(torch.nn.Linear, 0, device)  # the function to learn: a fixed random bf16 MLP
    student = _model(linear, 1, device)
    if linear is fp4nn.Linear:  # start both students from the same weights
        student.load_state_dict(_model(torch.nn.Linear, 1, device).state_dict())
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = _teacher_batch(teacher, step, device)
        loss = (student(x).float() - y.float()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="fp4gen_demo_loss.png")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(f"training a {DEPTH}-layer MLP (width {WIDTH}, batch {BATCH}) for {args.steps} steps on {device}")
    curves = {}
    for name, linear in (("bf16 torch.nn.Linear", torch.nn.Linear), ("NVFP4 fp4gen.nn.Linear", fp4nn.Linear)):
        start = time.time()
        curves[name] = train(linear, args.steps, device)
        print(f"  {name}: {time.time() - start:.1f} s")
    names = list(curves)
    print(f"\n{'step':>6} " + " ".join(f"{n:>24}" for n in names))
    every = max(1, args.steps // 10)
    for step in list(range(0, args.steps, every)) + [args.steps - 1]:
        print(f"{step:>6} " + " ".join(f"{curves[n][step]:>24.5f}" for n in names))
    tail = max(1, args.steps // 10)  # average the last 10% of steps: single-step losses are noisy
    final = {n: sum(curves[n][-tail:]) / tail for n in names}
    ratio = final[names[1]] / final[names[0]]
    print(f"\nfinal loss (mean of the last {tail} steps): bf16 {final[names[0]]:.5f}, "
          f"NVFP4 {final[names[1]]:.5f}, ratio NVFP4/bf16 = {ratio:.3f}")
    line_chart({names[0]: ((31, 119, 180), curves[names[0]]), names[1]: ((214, 39, 40), curves[names[1]])},
               args.out)
    print(f"loss curves (blue: bf16, red: NVFP4, log scale) saved to {args.out}")
    return ratio


if __name__ == "__main__":
    main()
