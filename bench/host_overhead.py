"""Host time per call of fp4gen's operations, against comparable torch operations, on tensors so small that
the GPU is idle: what Python, dispatch and kernel launches cost a caller in eager mode.

Each op is called back to back (no synchronization inside the loop) and the wall-clock time per call is the
fastest of several rounds (host timings only gain from noise); "GPU us" is the same call replayed from a CUDA graph, which shows that the device
finishes long before the host has issued the next call. "launches" counts the kernels (and memsets) one
call puts on the stream (torch.profiler). The "one thread" rows run backward on the calling thread
(torch.autograd.set_multithreading_enabled(False)) instead of autograd's device thread; the "no_grad" rows
time an inference forward, the "frozen weight" rows a step without a weight gradient, the "3-D input" rows a step
on [batch, sequence, features] input.

--launchers python,cpp times every op with each launcher (FP4GEN_LAUNCHER's two choices) in turn, round by
round in one process, and prints their host times side by side: this host's timings move by up to 1.7x from
process to process, which would swamp the difference between processes."""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp4gen
from timing import graph_median_ms

ROWS = COLS = 256
ROUNDS, CALLS = 7, 200


def host_us(fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
        torch.cuda.synchronize()
    return min(times)


def launches(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def cases():
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(ROWS, COLS, device=dev, dtype=torch.bfloat16)
    w = torch.randn(COLS, COLS, device=dev, dtype=torch.bfloat16)
    xq = fp4gen.quantize(x, scaling="row", columnwise=False).rowwise
    wq = fp4gen.quantize(w, scaling="tensor", columnwise=False).rowwise
    ref = torch.nn.Linear(COLS, COLS, device=dev, dtype=torch.bfloat16)
    layer = fp4gen.nn.Linear(COLS, COLS, device=dev, dtype=torch.bfloat16)
    frozen_ref = torch.nn.Linear(COLS, COLS, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    frozen_layer = fp4gen.nn.Linear(COLS, COLS, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(ROWS, COLS, device=dev, dtype=torch.bfloat16)
    x3 = x.view(4, ROWS // 4, COLS).clone().requires_grad_(True)  # [batch, sequence, features], as in a model
    dy3 = dy.view(4, ROWS // 4, COLS)
    return [
        ("torch: x.abs()", lambda: x.abs()),
        ("torch: F.linear (bf16)", lambda: torch.nn.functional.linear(x, w)),
        ("fp4gen.dequantize", lambda: fp4gen.dequantize(xq)),
        ("fp4gen.quantize row-scaled, rowwise", lambda: fp4gen.quantize(x, scaling="row", columnwise=False)),
        ("fp4gen.quantize row-scaled, both", lambda: fp4gen.quantize(x, scaling="row", columnwise=True)),
        ("fp4gen.quantize per-tensor, both", lambda: fp4gen.quantize(x, scaling="tensor", columnwise=True)),
        ("fp4gen.gemm", lambda: fp4gen.gemm(xq, wq)),
        ("torch.nn.Linear fwd+bwd (bf16)", lambda: ref(xg).backward(dy)),
        ("fp4gen.nn.Linear fwd+bwd", lambda: layer(xg).backward(dy)),
        ("torch.nn.Linear fwd+bwd, 3-D input", lambda: ref(x3).backward(dy3)),
        ("fp4gen.nn.Linear fwd+bwd, 3-D input", lambda: layer(x3).backward(dy3)),
        # backward on the calling thread instead of autograd's device thread: what the thread handoff costs
        ("torch.nn.Linear fwd+bwd, one thread", single_threaded(lambda: ref(xg).backward(dy))),
        ("fp4gen.nn.Linear fwd+bwd, one thread", single_threaded(lambda: layer(xg).backward(dy))),
        # inference (rollouts, evaluation) and a frozen weight (no wgrad: adapters on a frozen base)
        ("torch.nn.Linear forward, no_grad", no_grad(lambda: ref(x))),
        ("fp4gen.nn.Linear forward, no_grad", no_grad(lambda: layer(x))),
        ("torch.nn.Linear fwd+bwd, frozen weight", lambda: frozen_ref(xg).backward(dy)),
        ("fp4gen.nn.Linear fwd+bwd, frozen weight", lambda: frozen_layer(xg).backward(dy)),
    ]


def no_grad(fn):
    def call():
        with torch.no_grad():
            fn()
    return call


def single_threaded(fn):
    def call():
        with torch.autograd.set_multithreading_enabled(False):
            fn()
    return call


def host_us_by_launcher(fn, choices) -> dict:
    """host_us of fn with each launcher, their rounds interleaved: choice -> fastest round."""
    from fp4gen.cuda import launcher

    best = dict.fromkeys(choices, float("inf"))
    for _ in range(ROUNDS):
        for choice in choices:
            launcher.use(choice)
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            best[choice] = min(best[choice], (time.perf_counter() - start) / CALLS * 1e6)
            torch.cuda.synchronize()
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launchers", help="comma-separated FP4GEN_LAUNCHER choices to time side by side")
    args = parser.parse_args()
    choices = args.launchers.split(",") if args.launchers else None
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  tensors {ROWS}x{COLS} bf16")
    host_columns = "".join(f"{'host us ' + c:>16}" for c in choices) if choices else f"{'host us':>8}"
    print(f"{'op':>38} {host_columns} {'GPU us':>7} {'launches':>8}")
    for name, fn in cases():
        gpu_us = graph_median_ms(fn) * 1e3
        if choices:
            host = "".join(f"{t:>16.1f}" for t in host_us_by_launcher(fn, choices).values())
        else:
            host = f"{host_us(fn):>8.1f}"
        print(f"{name:>38} {host} {gpu_us:>7.1f} {launches(fn):>8}", flush=True)


if __name__ == "__main__":
    main()
