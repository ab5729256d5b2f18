"""fp4gen.nn.Linear against torch.nn.Linear in bf16 on the current GPU: forward+backward time and the
memory saved for backward, for 8192x4096 -> 4096 and 8192x4096 -> 14336 (tokens x in -> out), for
1024x1024 -> 1024, where the eager step is bound by host time, and for 8200x4096 -> 4096: a token count off the
16-token block, which fp4gen.nn.Linear completes with zero tokens (a copy of X and one of dY more than 8192's).

Times are medians of the eager step and of the same step replayed from a CUDA graph (device time without
Python and launch overhead; in a graph the weight is quantized inside the step, as nn.Linear does under
capture)."""
import torch

import fp4gen
from timing import graph_median_ms, median_ms

SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (1024, 1024, 1024), (8200, 4096, 4096)]


def saved_bytes(layer, x) -> int:
    """Bytes of the tensors autograd saves for backward (parameters excluded: both keep the weight)."""
    params = {p.data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    del y
    return sum(seen.values())


def main():
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'tokens x in -> out':>22} {'bf16 us':>9} {'fp4gen us':>9} {'speed-up':>8} {'bf16 graph':>10} "
          f"{'fp4gen graph':>12} {'speed-up':>8} {'bf16 saved MB':>13} {'fp4gen saved MB':>15}")
    for tokens, k, n in SHAPES:
        torch.manual_seed(0)
        ref = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer = fp4gen.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer.load_state_dict(ref.state_dict())
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

        def step(module):
            return lambda: module(x).backward(dy)

        ref_ms, ms = median_ms(step(ref)), median_ms(step(layer))
        ref_graph_ms, graph_ms = graph_median_ms(step(ref)), graph_median_ms(step(layer))
        print(f"{tokens:>8}x{k} -> {n:<6} {ref_ms * 1e3:>9.0f} {ms * 1e3:>9.0f} {ref_ms / ms:>8.2f} "
              f"{ref_graph_ms * 1e3:>10.0f} {graph_ms * 1e3:>12.0f} {ref_graph_ms / graph_ms:>8.2f} "
              f"{saved_bytes(ref, x) / 1e6:>13.1f} {saved_bytes(layer, x) / 1e6:>15.1f}")


if __name__ == "__main__":
    main()
