"""Mixture-of-experts layers: fp4gen.nn.GroupedLinear forward+backward (quantization included) against
torch.nn.functional.grouped_mm in bf16 (one launch per GEMM, autograd backward) and against a loop of
fp4gen.nn.Linear over the experts (split sizes on the host), on the current GPU.

Shapes (tokens routed to experts, experts, in -> out): Qwen3-30B-A3B's expert FC1 and FC2 (E = 128, 65536
routed tokens) and a Mixtral expert FC1 (E = 8, 16384 tokens). Routings: uniform, and skewed (group sizes
proportional to 1 / rank, a Zipf law, shuffled over the experts). Group sizes are rounded to multiples of 16
so that the fp4gen.nn.Linear loop can run wgrad on every expert; the grouped paths take any sizes.

Times are CUDA-event medians of the whole step replayed from a CUDA graph (device time; the grouped paths
never synchronize, so the graph holds the whole step; the weight is quantized inside the step, as after
every optimizer step), "ratio" = fp4gen time / grouped_mm time. "static us" is the same step with the layer's
weight cache static (fp4gen.nn.static_weight_caches): the graph reads the quantized weight kept from an eager
warm-up, what the micro-steps of gradient accumulation cost between two optimizer steps.

`python moe.py --parts` times each operation of the fp4gen step instead (uniform routing): the three
quantizations and the three grouped GEMMs, beside grouped_mm's three GEMMs and the dense fp4gen.quantize of
the same tokens.

`python moe.py --families` times each grouped GEMM on both Hopper grouped GEMM families (the dispatcher's
threshold, runtime/cuda/grouped.py TMA_MIN_ROWS_PER_GROUP, forced either way), uniform and skewed routing; "wgrad
fp32 acc" accumulates into an fp32 [E, N, K] main gradient."""
import sys

import torch

import fp4gen
from timing import graph_median_ms

SHAPES = [  # (name, routed tokens, experts, in, out)
    ("qwen3-30b-a3b fc1", 65536, 128, 2048, 1536),
    ("qwen3-30b-a3b fc2", 65536, 128, 768, 2048),
    ("mixtral fc1", 16384, 8, 4096, 28672),
]


def routing(tokens: int, experts: int, skewed: bool, seed: int = 0) -> list:
    """Group sizes summing to `tokens`, multiples of 16."""
    if not skewed:
        weights = torch.ones(experts)
    else:
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        weights = weights[torch.randperm(experts, generator=torch.Generator().manual_seed(seed))]
    sizes = (weights / weights.sum() * tokens / 16).floor().long() * 16
    sizes[int(torch.argmax(weights))] += tokens - int(sizes.sum())
    return sizes.tolist()


def grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        sys.exit("this PyTorch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    return fn


def parts():
    mm = grouped_mm()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'layer':>18} {'operation':>34} {'us':>8} {'TFLOP/s':>8}")
    for name, tokens, experts, k, n in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ends = torch.tensor(routing(tokens, experts, False), device="cuda").cumsum(0)
        recipe = fp4gen.Recipe()
        gx = fp4gen.quantize_grouped(x, ends, hadamard=True)
        gdy = fp4gen.quantize_grouped(dy, ends, scaling=recipe.gradient_scaling, hadamard=True)
        gw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=recipe.weight_block)
        steps = {
            "quantize X (row, both, RHT)": (lambda: fp4gen.quantize_grouped(x, ends, hadamard=True), 0),
            "quantize dY (tensor, both, RHT)": (
                lambda: fp4gen.quantize_grouped(dy, ends, scaling="tensor", hadamard=True), 0),
            "quantize W (16x16, both)": (
                lambda: fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16)), 0),
            "dense fp4gen.quantize of X": (lambda: fp4gen.quantize(x, hadamard=True), 0),
            "fprop grouped_gemm": (lambda: fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, ends), 1),
            "dgrad grouped_gemm": (lambda: fp4gen.grouped_gemm(gdy.rowwise, gw.columnwise, ends), 1),
            "wgrad grouped_gemm (bf16 out)": (lambda: fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, ends), 1),
            "bf16 grouped_mm forward": (lambda: mm(x, w.transpose(-2, -1), offs=ends.to(torch.int32)), 1),
            "bf16 grouped_mm dgrad": (lambda: mm(dy, w, offs=ends.to(torch.int32)), 1),
            "bf16 grouped_mm wgrad": (lambda: mm(dy.t(), x, offs=ends.to(torch.int32)), 1),
        }
        for label, (fn, is_gemm) in steps.items():
            ms = graph_median_ms(fn)
            rate = f"{2 * tokens * k * n / ms / 1e9:>8.0f}" if is_gemm else ""
            print(f"{name:>18} {label:>34} {ms * 1e3:>8.1f} {rate}", flush=True)
        del x, dy, w, gx, gdy, gw
        torch.cuda.empty_cache()


def families():
    from fp4gen.cuda import grouped as cuda_grouped
    mm = grouped_mm()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, tokens, experts, k, n in SHAPES:
        for skewed in (False, True):
            torch.manual_seed(0)
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ends = torch.tensor(routing(tokens, experts, skewed), device="cuda").cumsum(0)
            gx = fp4gen.quantize_grouped(x, ends, hadamard=True)
            gdy = fp4gen.quantize_grouped(dy, ends, scaling="tensor", hadamard=True)
            gw = fp4gen.quantize_grouped(w, None, scaling="tensor", block=(16, 16))
            main_grad = torch.zeros(experts, n, k, device="cuda")
            gemms = {
                "fprop": lambda: fp4gen.grouped_gemm(gx.rowwise, gw.rowwise, ends),
                "dgrad": lambda: fp4gen.grouped_gemm(gdy.rowwise, gw.columnwise, ends),
                "wgrad bf16": lambda: fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, ends,
                                                          out_dtype=torch.bfloat16),
                "wgrad fp32 acc": lambda: fp4gen.grouped_gemm(gdy.columnwise, gx.columnwise, ends, out=main_grad,
                                                              accumulate=True),
            }
            flops = 2 * tokens * k * n
            rule = cuda_grouped.TMA_MIN_ROWS_PER_GROUP
            try:
                for label, fn in gemms.items():
                    row = []
                    for family, threshold in (("wgmma", float("inf")), ("tma", 0)):
                        cuda_grouped.TMA_MIN_ROWS_PER_GROUP = {"along M": threshold, "along K": threshold}
                        ms = graph_median_ms(fn)
                        row.append(f"{family} {ms * 1e3:8.1f} us {flops / ms / 1e9:4.0f} TF")
                    print(f"{name:>18} {'skew' if skewed else 'unif':>4} {label:>15}  " + "   ".join(row), flush=True)
            finally:
                cuda_grouped.TMA_MIN_ROWS_PER_GROUP = rule
            if not skewed:
                ms = graph_median_ms(lambda: mm(x, w.transpose(-2, -1), offs=ends.to(torch.int32)))
                print(f"{name:>18} unif grouped_mm fwd {ms * 1e3:8.1f} us {flops / ms / 1e9:4.0f} TF", flush=True)
            del x, dy, w, gx, gdy, gw, main_grad
            torch.cuda.empty_cache()


def main():
    if "--parts" in sys.argv:
        return parts()
    if "--families" in sys.argv:
        return families()
    mm = grouped_mm()
    with_loop = "--no-loop" not in sys.argv
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'layer':>18} {'routing':>8} {'bf16 grouped_mm us':>18} {'fp4gen us':>10} {'ratio':>6} "
          f"{'static us':>10} {'ratio':>6} {'bf16 TFLOP/s':>12} {'Linear loop us':>14}")
    for name, tokens, experts, k, n in SHAPES:
        torch.manual_seed(0)
        layer = fp4gen.nn.GroupedLinear(experts, k, n, device="cuda", dtype=torch.bfloat16)
        w_ref = layer.weight.detach().clone().requires_grad_(True)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        for skewed in (False, True):
            sizes = routing(tokens, experts, skewed)
            ends = torch.tensor(sizes, device="cuda").cumsum(0)
            offs32 = ends.to(torch.int32)

            def bf16_step():
                mm(x, w_ref.transpose(-2, -1), offs=offs32).backward(dy)

            def fp4_step():
                layer(x, ends).backward(dy)

            bf16_ms, fp4_ms = graph_median_ms(bf16_step), graph_median_ms(fp4_step)
            fp4gen.nn.static_weight_caches(layer)
            fp4_step()  # fills the static cache
            static_ms = graph_median_ms(fp4_step)
            fp4gen.nn.static_weight_caches(layer, False)
            flops = 3 * 2 * tokens * k * n
            loop = ""
            if with_loop:
                linears = [fp4gen.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                           for _ in range(experts)]
                pieces = list(zip(linears, torch.split(torch.arange(tokens), sizes)))

                def loop_step():
                    for linear, rows in pieces:
                        if rows.numel():
                            linear(x[rows[0]:rows[-1] + 1]).backward(dy[rows[0]:rows[-1] + 1])

                loop = f"{graph_median_ms(loop_step) * 1e3:>14.0f}"
                del linears, pieces
            print(f"{name:>18} {'skewed' if skewed else 'uniform':>8} {bf16_ms * 1e3:>18.0f} {fp4_ms * 1e3:>10.0f} "
                  f"{fp4_ms / bf16_ms:>6.2f} {static_ms * 1e3:>10.0f} {static_ms / bf16_ms:>6.2f} "
                  f"{flops / bf16_ms / 1e9:>12.0f} {loop}", flush=True)
        del layer, w_ref, x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
