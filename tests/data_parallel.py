"""Data-parallel training runs of fp4gen layers for the distributed tests: the models, the batches, the training
loop and one rank's process, on CUDA (one process a GPU, NCCL) or on the CPU (gloo, the reference backend).

Every rank of a run builds the same model (same seed) and sees the same global batches, taking its own slice of
each; the rank's process saves its per-step global losses, its final full parameters and, under DDP, the last
step's gradients, for the tests to compare."""
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp4gen

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # PyTorch before FSDP2
    fully_shard = None

WORLD = 2
STEPS = 8
GLOBAL_TOKENS = 128  # each rank takes 64 tokens
LR = 1e-2  # Adam: the loss falls by about a third in STEPS steps, so a stale weight would show
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


class Experts(torch.nn.Module):
    """E experts (one GroupedLinear, 256 -> 64; four by default), each token routed by its own first feature to
    expert 0, E - 2 or E - 1 (so a token meets the same expert whichever rank holds it; with four, expert 1 gets
    none): tokens are sorted by expert, the grouped layer runs, and the outputs go back to the tokens' order."""

    def __init__(self, device, num_experts=4, keep_quantized_weight=True):
        super().__init__()
        self.experts = fp4gen.nn.GroupedLinear(num_experts, 256, 64, device=device, dtype=torch.bfloat16,
                                               keep_quantized_weight=keep_quantized_weight)

    def forward(self, x):
        e = self.experts.num_experts
        feature = x[:, 0].float()
        expert = torch.where(feature > 0.5, e - 1, torch.where(feature > -0.5, e - 2, 0))
        order = torch.argsort(expert, stable=True)
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, expert, torch.ones_like(expert))
        y_sorted = self.experts(x[order], counts.cumsum(0))
        return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)


class TinyQwen3Moe(torch.nn.Module):
    """A two-layer Qwen3-MoE of transformers (hidden 256, four experts of 256 -> 2 x 64 -> 256, two a token) whose
    dense projections are converted and whose experts run through fp4gen.hf_experts, both keeping no quantized
    weight (keep_quantized_weight=False, as under FSDP2): a rank's tokens are one sequence of input embeddings, and
    the output is the first 64 features of the last hidden state."""

    def __init__(self, device):
        super().__init__()
        import transformers

        import fp4gen.hf_experts
        fp4gen.hf_experts.register(UNKEPT_EXPERTS, keep_quantized_weight=False)
        config = transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
            max_position_embeddings=128)
        self.model = transformers.Qwen3MoeModel(config).to(device, torch.bfloat16)
        self.model.embed_tokens = torch.nn.Identity()  # unused (input embeddings come in): DDP wants every parameter
        self.model.set_experts_implementation(UNKEPT_EXPERTS)
        fp4gen.convert(self.model, keep_quantized_weight=False)

    def forward(self, x):
        return self.model(inputs_embeds=x.unsqueeze(0)).last_hidden_state[0, :, :64]


UNKEPT_EXPERTS = "fp4gen-unkept"  # the experts implementation TinyQwen3Moe registers


def make_model(device, kind="linear"):
    """kind "linear": three fp4gen.nn.Linear layers with GELUs between them; "linear_sr": the same with stochastic
    rounding of the gradients; "experts": Experts; "experts_3": three experts (across two ranks, unevenly sharded);
    "linear_unkept", "experts_unkept": "linear" and "experts" with keep_quantized_weight=False; "qwen3_moe":
    TinyQwen3Moe."""
    torch.manual_seed(0)
    fp4gen.RNGState.default(device).reset()  # (seeding 0 again would not restart it; stochastic rounding draws)
    if kind == "qwen3_moe":
        return TinyQwen3Moe(device)
    keep = not kind.endswith("_unkept")
    if kind.startswith("experts"):
        return Experts(device, 3 if kind == "experts_3" else 4, keep_quantized_weight=keep)
    recipe = fp4gen.Recipe(stochastic_rounding=True) if kind == "linear_sr" else None
    options = dict(device=device, dtype=torch.bfloat16, recipe=recipe, keep_quantized_weight=keep)
    return torch.nn.Sequential(
        fp4gen.nn.Linear(256, 512, **options), torch.nn.GELU(),
        fp4gen.nn.Linear(512, 256, **options), torch.nn.GELU(),
        fp4gen.nn.Linear(256, 64, **options))


class SavedBytes:
    """Saved-tensor hooks that record what a forward saves for backward; live() is the bytes of the distinct storages
    those tensors still hold (a weight that FSDP2 freed after the forward holds none)."""

    def __init__(self):
        self.saved = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self.saved.append(t) or t, lambda t: t)

    def live(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.saved}
        return sum(nbytes for ptr, nbytes in storages.items() if ptr)


def batches():
    """The same global batches in every process: inputs and regression targets, on the CPU."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(256, 64, generator=g) / 16
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_TOKENS, 256, generator=g)
        yield x.bfloat16(), (x @ teacher).bfloat16()


def train(model, rank, world, device, saved_bytes=None):
    """Per-step global losses. Each process computes the mean loss of its slice; data parallelism averages
    the gradients, which equals the gradient of the global mean. saved_bytes: a list that gets, after the first
    step's forward, the bytes that what it saved for backward holds (SavedBytes.live)."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    per_rank = GLOBAL_TOKENS // world
    for x, t in batches():
        x, t = x[rank * per_rank:(rank + 1) * per_rank].to(device), t[rank * per_rank:(rank + 1) * per_rank].to(device)
        opt.zero_grad()
        record = SavedBytes() if saved_bytes is not None and not losses else None
        if record:
            with record.hooks:
                loss = (model(x).float() - t.float()).square().mean()
            saved_bytes.append(record.live())
            del record
        else:
            loss = (model(x).float() - t.float()).square().mean()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(global_loss.item())
    return losses


def shard_layers(model):
    """FSDP2 over each fp4gen layer (over each decoder layer of a transformers model), then over the whole model."""
    if isinstance(model, TinyQwen3Moe):
        for layer in model.model.layers:
            fully_shard(layer)
    else:
        for layer in model.modules():
            if isinstance(layer, (fp4gen.nn.Linear, fp4gen.nn.GroupedLinear)):
                fully_shard(layer)
    fully_shard(model)


def run_on_rank(rank, mode, kind, world, device, device_type, out_dir):
    """One "ddp", "fsdp2" or "fsdp2+compile" run of the model `kind` on this rank (its process group up), saved to
    out_dir/{mode}_{kind}_rank{rank}.pt."""
    model = make_model(device, kind)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device_type == "cuda" else None)
        module = model.module
    else:
        shard_layers(model)
        module = model
        if mode == "fsdp2+compile":  # the sharded model under torch.compile (Inductor)
            model = torch.compile(model)
    from torch._dynamo.utils import counters
    graphs_before = counters["stats"]["unique_graphs"]  # (an earlier run of this process may have compiled)
    saved_bytes = [] if mode != "fsdp2+compile" else None
    losses = train(model, rank, world, device, saved_bytes)
    grads = {}
    if mode == "ddp":  # the gradients of the last step, after DDP's all-reduce
        grads = {name: p.grad.detach().cpu() for name, p in module.named_parameters()}
    # FSDP2's parameters are shards (DTensors): full_tensor() gathers them, a collective every rank joins
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
              for name, p in module.named_parameters()}
    graphs = counters["stats"]["unique_graphs"] - graphs_before  # what torch.compile traced, if it ran
    torch.save({"losses": losses, "grads": grads, "params": params, "graphs": graphs, "saved_bytes": saved_bytes},
               os.path.join(out_dir, f"{mode}_{kind}_rank{rank}.pt"))


def worker(rank, runs, rdzv, out_dir, world=WORLD, device_type="cuda", destroy=True):
    """One rank's process: joins the process group once, then does each (mode, kind) of runs in turn (see
    run_on_rank). Every run starts from the same state, whatever ran before it in the process: make_model seeds
    torch and restarts fp4gen's default random state. destroy=False leaves the process group to the caller."""
    if device_type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see the device notes in the README)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(BACKENDS[device_type], init_method=f"file://{rdzv}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for mode, kind in runs:
            run_on_rank(rank, mode, kind, world, device, device_type, out_dir)
    finally:
        if destroy:
            dist.destroy_process_group()


def spawned_rank(rank, runs, rdzv, out_dir, world, device_type):
    """mp.spawn's entry. A gloo rank exits without tearing its process group down: destroying a gloo group joins
    its work threads while holding the GIL, and a thread still releasing a finished collective's Python tensors
    waits for the GIL, so the rank hung about one run in ten (PyTorch 2.13, CPU). It exits at once instead, 1 with
    the traceback on stderr if the run raised."""
    if device_type != "cpu":
        worker(rank, runs, rdzv, out_dir, world, device_type)
        return
    try:
        worker(rank, runs, rdzv, out_dir, world, device_type, destroy=False)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def load_run(out_dir, mode, kind, world=WORLD) -> list:
    """Every rank's saved results of one run."""
    return [torch.load(os.path.join(out_dir, f"{mode}_{kind}_rank{r}.pt")) for r in range(world)]


def run_data_parallel(runs, tmp_path, device_type="cuda") -> list:
    """runs: (mode, kind) pairs, done one after the other by one WORLD-process group (a process pair costs seconds
    to start: torch's import, fp4gen's libraries, the rendezvous); for each run, every rank's saved results."""
    mp.spawn(spawned_rank, args=(list(runs), str(tmp_path / "rdzv"), str(tmp_path), WORLD, device_type),
             nprocs=WORLD, join=True)
    return [load_run(tmp_path, mode, kind) for mode, kind in runs]
