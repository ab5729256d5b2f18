"""What fp4gen.nn.Linear's keep_quantized_weight costs and saves under FSDP2, on the current GPU: a stack of
Linear(4096, 4096) layers in bf16 (default recipe), each under fully_shard, over a single rank (NCCL, one process),
trained with Adam on 4096 tokens.

Per configuration: the memory allocated before a forward (FSDP2's shards, Adam's state, whatever a layer keeps
between steps), what the forward adds to it (the activations and copies saved for backward, caches made), the
peak over the whole step, and the median step time (fwd + bwd + Adam). torch.nn.Linear in bf16 under the same
FSDP2 is the baseline. With one rank FSDP2 still frees each gathered weight after its forward and gathers it again
for backward, as with many ranks, so what a layer keeps of its weight shows; the shards themselves are the whole
weights here (over N ranks they would be 1/N)."""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import fp4gen
from timing import median_ms

LAYERS, WIDTH, TOKENS = 8, 4096, 4096


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        if kind == "bf16":
            layers.append(torch.nn.Linear(WIDTH, WIDTH, device="cuda", dtype=torch.bfloat16))
        else:
            layers.append(fp4gen.nn.Linear(WIDTH, WIDTH, device="cuda", dtype=torch.bfloat16,
                                           keep_quantized_weight=kind == "fp4gen, kept"))
        layers.append(torch.nn.GELU())
    stack = torch.nn.Sequential(*layers)
    for layer in stack:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(stack)
    return stack


def measure(kind: str) -> tuple:
    stack = model(kind)
    opt = torch.optim.Adam(stack.parameters(), lr=1e-4)
    x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        stack(x).float().square().mean().backward()
        opt.step()

    for _ in range(3):  # optimizer state made, caches and plans built
        step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = stack(x).float().square().mean()
    added = torch.cuda.memory_allocated() - before
    loss.backward()
    opt.step()
    peak = torch.cuda.max_memory_allocated()
    return before, added, peak, median_ms(step)


def main():
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(rendezvous, 'store')}", rank=0,
                                world_size=1)
        try:
            print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
                  f"{LAYERS} x Linear({WIDTH}, {WIDTH}) bf16, {TOKENS} tokens, FSDP2 over one rank, Adam")
            print(f"{'layers':>22} {'MiB before fwd':>14} {'MiB added by fwd':>16} {'MiB peak':>9} {'step ms':>8}")
            for kind in ("bf16", "fp4gen, kept", "fp4gen, not kept"):
                gc.collect()  # the previous configuration's model and optimizer state, before measuring
                torch.cuda.empty_cache()
                before, added, peak, ms = measure(kind)
                print(f"{kind:>22} {before / 2**20:>14.0f} {added / 2**20:>16.0f} {peak / 2**20:>9.0f} {ms:>8.2f}")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
