"""fp4gen.hf_experts on the GPU kernels: tests/test_hf_experts.py's equality with fp4gen.nn.GroupedLinear on CUDA
(bf16 parameters; [E, out, in] and [E, in, out] weights), with no host synchronization in the experts' forward
and backward, a tiny MoE model training under CUDA autocast, and an RL iteration (generate, train, a reference
model synced through .data) in bf16."""
import pytest
import torch

from conftest import run_without_host_sync
from test_hf_experts import (NEAREST, check_an_rl_iteration_with_a_reference_model,
                             check_equal_to_grouped_linear_layers, experts_of, routed, tiny_moe)

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", minversion="5.0")


@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "gpt_oss"])
def test_experts_equal_grouped_linear_layers_on_cuda_without_syncs(kind):
    model = tiny_moe(kind, NEAREST).cuda().to(torch.bfloat16)
    experts = experts_of(model)
    hidden_states, top_k_index, top_k_weights = (t.cuda() for t in routed())
    hidden_states = hidden_states.to(torch.bfloat16)
    x = hidden_states.clone().requires_grad_()
    dout = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    result = {}

    def step():  # run twice: warm, then with every synchronizing operation raising
        x.grad = None
        experts.zero_grad(set_to_none=True)
        result["out"] = experts(x, top_k_index, top_k_weights)
        result["out"].backward(dout)

    run_without_host_sync(step)
    check_equal_to_grouped_linear_layers(experts, x, result["out"], dout, top_k_index, top_k_weights)


def test_moe_model_trains_under_cuda_autocast():
    model = tiny_moe("qwen3").cuda()  # fp32 master weights, the default recipe
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2)).cuda()
    losses = []
    for _ in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


def test_an_rl_iteration_with_a_reference_model_on_cuda():
    check_an_rl_iteration_with_a_reference_model("cuda", torch.bfloat16)
