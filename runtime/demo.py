"""fp4gen demo: train the same small MLP twice on synthetic data, once with fp4gen.nn.Linear (NVFP4,
row-scaled activations) and once with torch.nn.Linear in bf16, and compare the loss curves.

    python -m fp4gen.demo [--steps 200] [--device cpu|cuda|cuda:N] [--out fp4gen_demo_loss.png] [--no-plot]

Both students start from the same weights and learn a fixed random bf16 MLP (the teacher) from the same
batches. The demo prints both losses as a table and the final-loss ratio NVFP4 / bf16 (close to 1 means
NVFP4 trains as well as bf16), and saves the two curves as a PNG. The plot needs matplotlib
(`pip install "fp4gen[plot]"`); pass --no-plot to skip it.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from . import nn as fp4nn

WIDTH, DEPTH, BATCH = 256, 4, 256
BF16, NVFP4 = "bf16 torch.nn.Linear", "NVFP4 fp4gen.nn.Linear"


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


def plot(curves: dict, title: str, path: str) -> None:
    """Save the loss curves as a PNG. matplotlib is imported here so the demo runs without it (--no-plot),
    and through Figure rather than pyplot so no GUI backend is ever selected and no window opens."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator

    fig = Figure(figsize=(8, 5), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    for (name, losses), color in zip(curves.items(), ("tab:blue", "tab:red")):
        # markers keep a short run (a handful of steps) readable; on long runs they would blur the line
        ax.plot(range(len(losses)), losses, color=color, label=name, marker="o" if len(losses) <= 20 else None)
    ax.set_yscale("log")
    # the curves usually span one or two decades: also label some minor ticks, else only 1e-3, 1e-4 show
    ax.yaxis.set_minor_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_title(title)
    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even on short runs
    ax.set_ylabel("loss (MSE, log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fp4gen.demo",
        description="Train a small MLP twice on synthetic data, with fp4gen.nn.Linear (NVFP4) and with "
                    "torch.nn.Linear (bf16); print both loss curves and the final-loss ratio, and plot them.",
        epilog="example: python -m fp4gen.demo --steps 100 --device cpu --out /tmp/loss.png",
    )
    p.add_argument("--steps", type=int, default=200,
                   help="number of optimizer steps per run (default: %(default)s; must be >= 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to train: cpu, cuda or cuda:N (default: cuda when a CUDA device is available, "
                        "else cpu)")
    p.add_argument("--out", default="fp4gen_demo_loss.png",
                   help="PNG path for the loss plot (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true",
                   help="skip the plot; then matplotlib is not needed")
    return p


def device_argument(p: argparse.ArgumentParser, name: str) -> torch.device:
    """The torch.device a --device NAME option names, or a parser error that says what is wrong with it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        p.error(f"--device {name!r} is not a device; use cpu, cuda or cuda:N")
    if not ((device.type == "cpu" and device.index is None) or device.type == "cuda"):
        p.error(f"--device {name!r} is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {name}: CUDA is not available (torch.cuda.is_available() is False); "
                    "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            p.error(f"--device {name}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return device


def _check_plot(p: argparse.ArgumentParser, out: str) -> None:
    # checked before training so a typo does not cost a full run and then fail in savefig
    path = Path(out)
    parent = path.parent
    if path.suffix.lower() != ".png":
        p.error(f"--out {out}: the plot is written as PNG, so the name must end in .png")
    if path.is_dir():
        p.error(f"--out {out} is a directory; give a file name ending in .png")
    if not parent.is_dir():
        p.error(f"--out {out}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        p.error(f"--out {out}: not writable")
    try:
        import matplotlib  # noqa: F401  (only to learn whether plot() will work)
    except ImportError:
        p.error('the plot needs matplotlib: install it with `pip install matplotlib` or '
                '`pip install "fp4gen[plot]"`, or pass --no-plot')


def main(argv=None) -> float:
    p = _parser()
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1 (got {args.steps})")
    device = device_argument(p, args.device)
    if not args.no_plot:
        _check_plot(p, args.out)

    print(f"training a {DEPTH}-layer MLP (width {WIDTH}, batch {BATCH}) for {args.steps} steps on {device}")
    curves = {}
    for name, linear in ((BF16, torch.nn.Linear), (NVFP4, fp4nn.Linear)):
        start = time.time()
        curves[name] = train(linear, args.steps, device)
        print(f"  {name}: {time.time() - start:.1f} s")
    names = list(curves)
    print(f"\n{'step':>6} " + " ".join(f"{n:>24}" for n in names))
    every = max(1, args.steps // 10)
    for step in sorted({*range(0, args.steps, every), args.steps - 1}):  # a set: the last step only once
        print(f"{step:>6} " + " ".join(f"{curves[n][step]:>24.5f}" for n in names))
    tail = max(1, args.steps // 10)  # average the last 10% of steps: single-step losses are noisy
    final = {n: sum(curves[n][-tail:]) / tail for n in names}
    ratio = final[NVFP4] / final[BF16]
    print(f"\nfinal loss (mean of the last {tail} steps): bf16 {final[BF16]:.5f}, "
          f"NVFP4 {final[NVFP4]:.5f}, ratio NVFP4/bf16 = {ratio:.3f}")
    if not args.no_plot:
        plot(curves, f"fp4gen demo: NVFP4 vs bf16, {DEPTH}-layer MLP, width {WIDTH} ({device})", args.out)
        print(f"loss curves saved to {args.out}")
    return ratio


if __name__ == "__main__":
    main()
