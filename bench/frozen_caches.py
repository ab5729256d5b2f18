"""A frozen model's forward after each optimizer step of another model, with normal and with frozen weight caches
(fp4gen.nn.frozen_weight_caches): the RL pattern of a reference model beside the trained policy, or LoRA's base
weights. Every optimizer step drops normal caches, so the frozen model quantizes every weight again at its next
forward; frozen caches survive the steps.

Each timed call is one step of a small optimizer (one 16 x 16 parameter: its hooks run as any optimizer's do) and
then the layer's forward without autograd. Rows: fp4gen.nn.Linear at a reference model's batch (8192 tokens) and at
a small one (256), and fp4gen.nn.GroupedLinear with Qwen3-30B-A3B's and Mixtral's expert shapes (bench/moe.py's
uniform routing). Times are eager CUDA-event medians (bench/timing.py); "vs bf16" = fp4gen time / the bf16
baseline's (torch.nn.Linear, or torch.nn.functional.grouped_mm), which runs after the same optimizer step.
"MB kept": the quantized weight the cache holds after those forwards (a frozen cache made without autograd keeps
the rowwise copy alone). Run on a GPU: python bench/frozen_caches.py"""
import torch

import fp4gen
from moe import grouped_mm, routing
from timing import median_ms


def the_other_models_step():
    """A function that takes one optimizer step of a model sharing nothing with the layers timed (the policy)."""
    policy = torch.nn.Parameter(torch.randn(16, 16, device="cuda"))
    policy.grad = torch.randn_like(policy)
    optimizer = torch.optim.SGD([policy], lr=1e-3)
    return optimizer.step


def linear_rows(step):
    rows = []
    for tokens, k, n in [(8192, 4096, 4096), (8192, 4096, 14336), (256, 4096, 4096)]:
        torch.manual_seed(0)
        ref = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer = fp4gen.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        rows.append((f"Linear {tokens}x{k} -> {n}", *times(layer, step, lambda: ref(x), lambda: layer(x))))
    return rows


def grouped_rows(step):
    mm = grouped_mm()
    rows = []
    for name, tokens, experts, k, n in [("qwen3-30b-a3b fc1", 65536, 128, 2048, 1536),
                                        ("qwen3-30b-a3b fc2", 65536, 128, 768, 2048),
                                        ("mixtral fc1", 16384, 8, 4096, 28672)]:
        torch.manual_seed(0)
        layer = fp4gen.nn.GroupedLinear(experts, k, n, device="cuda", dtype=torch.bfloat16)
        w_t = layer.weight.detach().transpose(-2, -1)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        ends = torch.tensor(routing(tokens, experts, False), device="cuda").cumsum(0)
        offs32 = ends.to(torch.int32)
        rows.append((f"GroupedLinear {name}", *times(layer, step, lambda: mm(x, w_t, offs=offs32),
                                                     lambda: layer(x, ends))))
    return rows


def kept_mb(layer) -> float:
    """MB of quantized weight in the layer's cache entry (codes, scales and amaxes of the copies it holds)."""
    entry = layer._weight_cache.entry if isinstance(layer, fp4gen.nn.GroupedLinear) else layer._weight_cache
    tensors = [t for copy in entry[1:3] if copy is not None for t in copy]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def times(layer, step, baseline, forward) -> tuple:
    """(baseline us, fp4gen us with a normal cache, with a frozen cache, MB kept by each): an optimizer step, then
    the forward."""
    def timed(fn):
        def call():
            step()
            with torch.no_grad():
                fn()
        return median_ms(call) * 1e3

    base = timed(baseline)
    normal = timed(forward)
    normal_mb = kept_mb(layer)
    fp4gen.nn.frozen_weight_caches(layer)
    layer.clear_weight_cache()  # the entry the normal forwards made holds both copies
    frozen = timed(forward)
    frozen_mb = kept_mb(layer)
    fp4gen.nn.frozen_weight_caches(layer, False)
    return base, normal, frozen, normal_mb, frozen_mb


def main():
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    step = the_other_models_step()
    alone = median_ms(step) * 1e3
    print(f"the optimizer step alone: {alone:.1f} us (in every row)")
    print(f"{'step, then forward (eager)':>36} {'bf16 us':>9} {'normal us':>10} {'vs bf16':>8} {'frozen us':>10} "
          f"{'vs bf16':>8} {'frozen/normal':>14} {'MB kept normal':>15} {'frozen':>7}")
    for label, base, normal, frozen, normal_mb, frozen_mb in linear_rows(step) + grouped_rows(step):
        print(f"{label:>36} {base:>9.1f} {normal:>10.1f} {normal / base:>8.2f} {frozen:>10.1f} "
              f"{frozen / base:>8.2f} {frozen / normal:>14.2f} {normal_mb:>15.1f} {frozen_mb:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
