"""fp4gen.nn.GroupedLinear on the GPU: forward and backward against the same layer on the reference backend
(CPU), under skewed routing with empty experts; a whole training step with no host synchronization; a
captured step replayed under new routing; and a few optimizer steps that lower the loss."""
import pytest
import torch

import fp4gen
from conftest import group_ends, relative_error, run_without_host_sync
from test_grouped import UNKEPT_RECIPES, check_a_grouped_layer_that_keeps_no_quantized_weight

pytestmark = pytest.mark.gpu


def pair(experts=4, inp=128, out=192, bias=True, recipe=None, dtype=torch.bfloat16):
    torch.manual_seed(0)
    gpu = fp4gen.nn.GroupedLinear(experts, inp, out, bias=bias, recipe=recipe, device="cuda", dtype=dtype)
    cpu = fp4gen.nn.GroupedLinear(experts, inp, out, bias=bias, recipe=recipe, dtype=dtype)
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    return gpu, cpu


@pytest.mark.parametrize("sizes", [[64, 64, 64, 64], [0, 3, 250, 3], [0, 0, 77, 0]], ids=["uniform", "skewed", "one"])
@pytest.mark.parametrize("recipe", [None, fp4gen.Recipe(hadamard_wgrad=False, weight_block=(1, 16)),
                                    fp4gen.Recipe(gradient_scaling="row", four_over_six="all")],
                         ids=["default", "plain", "row-grads-4o6"])
def test_forward_backward_match_the_reference_backend(sizes, recipe):
    gpu, cpu = pair(recipe=recipe)
    ends = group_ends(sizes)
    x = torch.randn(ends[-1], 128, dtype=torch.bfloat16)
    dy = torch.randn(ends[-1], 192, dtype=torch.bfloat16)
    xg = x.cuda().requires_grad_(True)
    xc = x.clone().requires_grad_(True)
    yg = gpu(xg, torch.tensor(ends, device="cuda"))
    yc = cpu(xc, ends)
    yg.backward(dy.cuda())
    yc.backward(dy)
    assert relative_error(yg, yc) < 1e-2
    assert relative_error(xg.grad, xc.grad) < 1e-2
    assert relative_error(gpu.weight.grad, cpu.weight.grad) < 1e-2
    assert relative_error(gpu.bias.grad, cpu.bias.grad) < 1e-2
    for e, size in enumerate(sizes):
        if size == 0:
            assert not gpu.weight.grad[e].any() and not gpu.bias.grad[e].any()


def test_step_without_sync_and_graph_replay_under_new_routing():
    layer = fp4gen.nn.GroupedLinear(4, 128, 128, device="cuda", dtype=torch.bfloat16,
                                    recipe=fp4gen.Recipe(stochastic_rounding=False))
    layer.weight.main_grad = torch.zeros(layer.weight.shape, device="cuda")
    layer.accumulate_main_grad = True
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(group_ends([64, 64, 64, 64]), device="cuda")

    def step():
        layer.weight.main_grad.zero_()
        x.grad = None
        y = layer(x, offsets)
        y.backward(dy)
        return y

    run_without_host_sync(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        y = layer(x, offsets)
        y.backward(dy)
    static_grad = x.grad
    for sizes in ([256, 0, 0, 0], [0, 13, 200, 43], [64, 64, 64, 64]):
        offsets.copy_(torch.tensor(group_ends(sizes)))
        layer.weight.main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = (y.clone(), static_grad.clone(), layer.weight.main_grad.clone())
        want_y = step()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want_y) and torch.equal(got[1], x.grad), sizes
        assert torch.equal(got[2], layer.weight.main_grad), sizes


def test_training_lowers_the_loss():
    torch.manual_seed(1)
    layer = fp4gen.nn.GroupedLinear(8, 128, 64, bias=True, device="cuda", dtype=torch.bfloat16)
    target = [torch.randn(64, 128, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(8)]
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    losses = []
    for _ in range(30):
        sizes = torch.randint(0, 64, (8,)).tolist()
        ends = group_ends(sizes)
        x = torch.randn(ends[-1], 128, device="cuda", dtype=torch.bfloat16)
        want = torch.cat([x[s:e] @ target[g].T for g, (s, e) in enumerate(zip([0] + ends[:-1], ends))])
        loss = (layer(x, torch.tensor(ends, device="cuda")).float() - want.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.3 * sum(losses[:5])  # fp32 autograd of the same loop: 7.3 -> 1.0


def test_torch_compile_fullgraph_step_matches_eager():
    torch.manual_seed(2)
    eager = fp4gen.nn.GroupedLinear(4, 128, 64, bias=True, device="cuda", dtype=torch.bfloat16)
    compiled_layer = fp4gen.nn.GroupedLinear(4, 128, 64, bias=True, device="cuda", dtype=torch.bfloat16)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(100, 128, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(group_ends([30, 0, 50, 20]), device="cuda")
    outs = []
    for layer in (eager, compiled):
        y = layer(x, offsets)
        y.float().square().mean().backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(eager.weight.grad, compiled_layer.weight.grad)
    assert relative_error(compiled_layer.bias.grad, eager.bias.grad) < 1e-5  # index_add_: any order of additions


@pytest.mark.parametrize("recipe", UNKEPT_RECIPES)
def test_a_grouped_layer_that_keeps_no_quantized_weight_computes_the_same_bytes_on_gpu(recipe):
    """With 16x16 blocks (the default recipe) backward's columnwise-only quantization of the stacked weight takes the
    path that once read the group amax through a null pointer (the rowwise amax, absent without a rowwise copy)."""
    check_a_grouped_layer_that_keeps_no_quantized_weight("cuda", torch.bfloat16, UNKEPT_RECIPES[recipe])
