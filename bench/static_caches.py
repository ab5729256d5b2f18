"""Steps captured in CUDA graphs with normal and with static weight caches (fp4gen.nn.static_weight_caches): a
normal cache is bypassed in a graph, so every replay quantizes the weights; a static one is read instead.

Rows: fp4gen.nn.Linear 4096 -> 4096 forwards without autograd at rollout-like token counts, the same layer's and a
larger one's fwd+bwd, and fp4gen.nn.GroupedLinear with Qwen3-30B-A3B's expert FC1 (E = 128, 65536 tokens routed
uniformly, 2048 -> 1536), forward and fwd+bwd. Times are CUDA-event medians of graph replays (bench/timing.py);
"vs bf16" = fp4gen time / the bf16 baseline's (torch.nn.Linear, or torch.nn.functional.grouped_mm with autograd).
The weights do not change between replays (no optimizer step in the graph): the static rows are the micro-steps of
gradient accumulation and the rollouts between two optimizer steps. Run on a GPU: python bench/static_caches.py"""
import torch

import fp4gen
from moe import grouped_mm, routing
from timing import graph_median_ms


def linear_rows():
    rows = []
    for tokens, k, n, train in [(16, 4096, 4096, False), (64, 4096, 4096, False), (256, 4096, 4096, False),
                                (8192, 4096, 4096, True), (8192, 4096, 14336, True)]:
        torch.manual_seed(0)
        ref = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer = fp4gen.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

        def step(module):
            if train:
                module(x).backward(dy)
            else:
                with torch.no_grad():
                    module(x)

        label = f"Linear {tokens}x{k} -> {n} {'fwd+bwd' if train else 'forward'}"
        rows.append((label, *times(layer, lambda: step(ref), lambda: step(layer))))
    return rows


def grouped_rows():
    mm = grouped_mm()
    tokens, experts, k, n = 65536, 128, 2048, 1536
    torch.manual_seed(0)
    layer = fp4gen.nn.GroupedLinear(experts, k, n, device="cuda", dtype=torch.bfloat16)
    w_ref = layer.weight.detach().clone().requires_grad_(True)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(routing(tokens, experts, False), device="cuda").cumsum(0)
    offs32 = ends.to(torch.int32)
    rows = []
    for train in (False, True):
        def bf16():
            if train:
                mm(x, w_ref.transpose(-2, -1), offs=offs32).backward(dy)
            else:
                with torch.no_grad():
                    mm(x, w_ref.transpose(-2, -1), offs=offs32)

        def fp4():
            if train:
                layer(x, ends).backward(dy)
            else:
                with torch.no_grad():
                    layer(x, ends)

        label = f"GroupedLinear qwen3 fc1 {'fwd+bwd' if train else 'forward'}"
        rows.append((label, *times(layer, bf16, fp4)))
    return rows


def times(layer, baseline, step) -> tuple:
    """(baseline us, fp4gen us with a normal cache, with a static cache), graph replays."""
    base = graph_median_ms(baseline)
    fp4gen.nn.static_weight_caches(layer, False)
    normal = graph_median_ms(step)
    fp4gen.nn.static_weight_caches(layer)
    step()  # the eager warm-up that fills the static cache
    static = graph_median_ms(step)
    fp4gen.nn.static_weight_caches(layer, False)
    return base * 1e3, normal * 1e3, static * 1e3


def main():
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'step (CUDA graph)':>40} {'bf16 us':>9} {'normal us':>10} {'vs bf16':>8} {'static us':>10} "
          f"{'vs bf16':>8} {'static/normal':>14}")
    for label, base, normal, static in linear_rows() + grouped_rows():
        print(f"{label:>40} {base:>9.1f} {normal:>10.1f} {normal / base:>8.2f} {static:>10.1f} "
              f"{static / base:>8.2f} {static / normal:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
