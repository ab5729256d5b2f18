"""The experts of Hugging Face transformers' mixture-of-experts models through fp4gen.hf_experts, against
transformers' own grouped_mm experts implementation (bf16 grouped GEMMs), forward+backward of one experts module
at real sizes with random top-k routing, on the current GPU.

Models (hidden, expert intermediate, experts, top-k; 8192 tokens): Qwen3-30B-A3B (2048, 768, 128, 8: 65536 routed
rows), Mixtral-8x7B (4096, 14336, 8, 2: 16384 rows). Routing: the top-k of random scores (uniform over the
experts), or of scores plus a per-expert offset drawn from a normal distribution (skewed).

"eager us": CUDA-event median of the eager step, what a training loop sees between optimizer steps (fp4gen reuses
the quantized weights from call to call); "graph us": the step replayed from a CUDA graph (device time; the weights
are quantized in every replay, as after every optimizer step). "ratio": fp4gen time over grouped_mm's.

`python hf_experts.py --check` runs both implementations once on a small model on the CPU (no timing) and prints
how far apart their outputs are."""
import argparse
import importlib

import torch

import fp4gen.hf_experts

MODELS = [  # name, transformers module, config class, experts class, config arguments, tokens
    ("qwen3-30b-a3b", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts",
     dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8), 8192),
    ("mixtral-8x7b", "mixtral", "MixtralConfig", "MixtralExperts",
     dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2), 8192),
]
SMALL = [("qwen3 (small)", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts",
          dict(hidden_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2), 64)]


def experts_module(module: str, config_class: str, experts_class: str, arguments: dict, device, dtype):
    """One experts module of the model, its weights drawn as transformers initializes them (normal, std 0.02)."""
    package = importlib.import_module(f"transformers.models.{module}")
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(package, config_class)(**arguments, experts_implementation="grouped_mm")
    experts = getattr(modeling, experts_class)(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0.0, 0.02)
    return experts


def routed(tokens: int, hidden: int, experts: int, top_k: int, skewed: bool, device, dtype):
    """Hidden states, and the top-k experts of each token with their softmax weights."""
    g = torch.Generator(device="cpu").manual_seed(0)
    scores = torch.rand(tokens, experts, generator=g)
    if skewed:
        scores = scores + torch.randn(experts, generator=g)
    top_k_scores, top_k_index = torch.topk(scores, top_k, dim=-1)
    hidden_states = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    return hidden_states, top_k_index.to(device), top_k_scores.softmax(-1).to(device=device, dtype=dtype)


def check() -> dict:
    """{model: relative error of fp4gen's output against grouped_mm's} on SMALL, printed too."""
    fp4gen.hf_experts.register()
    errors = {}
    for name, module, config_class, experts_class, arguments, tokens in SMALL:
        torch.manual_seed(0)
        experts = experts_module(module, config_class, experts_class, arguments, "cpu", torch.float32)
        inputs = routed(tokens, experts.hidden_dim, experts.num_experts, arguments["num_experts_per_tok"], False,
                        "cpu", torch.float32)
        outputs = {}
        for implementation in ("grouped_mm", fp4gen.hf_experts.NAME):
            experts.config._experts_implementation = implementation
            outputs[implementation] = experts(*inputs)
        exact, nvfp4 = outputs["grouped_mm"], outputs[fp4gen.hf_experts.NAME]
        errors[name] = ((nvfp4 - exact).norm() / exact.norm()).item()
        print(f"{name}: fp4gen against grouped_mm, relative error {errors[name]:.3f}")
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="run both implementations once on the CPU, no timing")
    if parser.parse_args().check:
        return check()
    from timing import graph_median_ms, median_ms

    fp4gen.hf_experts.register()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'model':>14} {'routing':>8} {'grouped_mm eager us':>19} {'fp4gen eager us':>15} {'ratio':>6} "
          f"{'grouped_mm graph us':>19} {'fp4gen graph us':>15} {'ratio':>6}")
    for name, module, config_class, experts_class, arguments, tokens in MODELS:
        torch.manual_seed(0)
        experts = experts_module(module, config_class, experts_class, arguments, "cuda", torch.bfloat16)
        for skewed in (False, True):
            hidden_states, top_k_index, top_k_weights = routed(
                tokens, experts.hidden_dim, experts.num_experts, arguments["num_experts_per_tok"], skewed, "cuda",
                torch.bfloat16)
            hidden_states.requires_grad_(True)
            dout = torch.randn_like(hidden_states)
            times = {}

            def step():
                experts(hidden_states, top_k_index, top_k_weights).backward(dout)

            for implementation in ("grouped_mm", fp4gen.hf_experts.NAME):
                experts.config._experts_implementation = implementation
                times[implementation] = (median_ms(step), graph_median_ms(step))
            (bf16_eager, bf16_graph), (fp4_eager, fp4_graph) = times["grouped_mm"], times[fp4gen.hf_experts.NAME]
            print(f"{name:>14} {'skewed' if skewed else 'uniform':>8} {bf16_eager * 1e3:>19.0f} "
                  f"{fp4_eager * 1e3:>15.0f} {fp4_eager / bf16_eager:>6.2f} {bf16_graph * 1e3:>19.0f} "
                  f"{fp4_graph * 1e3:>15.0f} {fp4_graph / bf16_graph:>6.2f}", flush=True)
        del experts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
