"""fp4gen.nn.static_weight_caches with CUDA graphs: a captured forward reads the kept quantized weight (and sees it
change only when the cache is remade), a captured optimizer step remakes the cache inside the graph, and a capture
from a stale cache raises."""
import pytest
import torch

import fp4gen
from test_static_weight_caches import OFFSETS, assert_copies_equal, cached_weight_copies, fresh_weight_copies

pytestmark = pytest.mark.gpu


def make(kind: str):
    torch.manual_seed(0)
    if kind == "Linear":
        return fp4gen.nn.Linear(128, 64, device="cuda", dtype=torch.bfloat16), (lambda layer, x: layer(x))
    offsets = torch.tensor(OFFSETS, device="cuda") * 4
    return (fp4gen.nn.GroupedLinear(4, 128, 128, device="cuda", dtype=torch.bfloat16),
            lambda layer, x: layer(x, offsets))


def captured(fn):
    """(graph, its output) of fn() captured after an eager warm-up on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "normal"])
def test_a_captured_forward_reads_the_kept_weight_copies(kind, static):
    layer, call = make(kind)
    fp4gen.nn.static_weight_caches(layer, static)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, out = captured(lambda: call(layer, x))
        before = call(layer, x)
        graph.replay()
        assert torch.equal(out, before)
        layer.weight.data.mul_(-2.0)  # through .data: no cache sees it until clear_weight_caches
        graph.replay()
        if static:  # the graph reads the kept copies, still those of the old weight
            assert torch.equal(out, before)
        else:  # the graph quantizes the weight at every replay
            assert not torch.equal(out, before)
        fp4gen.nn.clear_weight_caches(layer)
        graph.replay()
        assert not torch.equal(out, before) and torch.equal(out, call(layer, x))
    assert_copies_equal(cached_weight_copies(layer), fresh_weight_copies(layer))


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_captured_optimizer_step_remakes_the_static_cache_in_the_graph(kind):
    layer, call = make(kind)
    fp4gen.nn.static_weight_caches(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=False)
        call(layer, x).float().square().mean().backward()
        opt.step()

    for _ in range(2):  # the eager warm-up: gradients allocated, the cache filled
        step()
    graph, _ = captured(step)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # the replays moved the weights, and the requantization captured with the step followed them
    assert_copies_equal(cached_weight_copies(layer), fresh_weight_copies(layer))


def test_a_capture_from_a_stale_static_cache_raises():
    layer, call = make("Linear")
    fp4gen.nn.static_weight_caches(layer)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        call(layer, x)
        layer.weight.add_(1.0)  # a change the next eager forward would see; a capture sees the cache stale
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="another state of its weight"):
            with torch.cuda.graph(graph):
                call(layer, x)


def test_a_reduce_overhead_compiled_forward_follows_the_static_cache_across_optimizer_steps():
    """torch.compile(mode="reduce-overhead") runs the layer from CUDA graphs of its own; with a static cache they read
    the kept copies (marked as static addresses), which each optimizer step remakes."""
    layer, call = make("Linear")
    fp4gen.nn.static_weight_caches(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        call(layer, x)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: call(layer, t), mode="reduce-overhead")
    outputs = []
    for _ in range(3):
        with torch.no_grad():
            runs = [compiled(x).clone() for _ in range(3)]  # recorded, then replayed
            eager = call(layer, x)
        assert all(torch.equal(run, eager) for run in runs)
        outputs.append(eager)
        call(layer, x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(outputs[0], outputs[-1])


def test_a_reduce_overhead_compiled_training_step_reads_the_static_cache_as_a_normal_one_quantizes():
    """The forward and backward compiled with mode="reduce-overhead" (the optimizer step eager, between replays),
    once with a static cache and once with a normal one, whose graph quantizes the weight at every call: the same
    loss and gradients, step after step (Inductor's own arithmetic differs from eager's, so eager is no reference
    here; a stale static cache would differ from the second step on)."""
    layers = [make("Linear") for _ in range(2)]  # the same initial weights (make seeds)
    fp4gen.nn.static_weight_caches(layers[0][0])
    opts = [torch.optim.SGD(layer.parameters(), lr=0.5) for layer, _ in layers]
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    steps = []
    for layer, call in layers:
        call(layer, x).float().square().mean().backward()  # the eager warm-up fills the cache
        layer.zero_grad()
        steps.append(torch.compile(lambda layer=layer, call=call: call(layer, x).float().square().mean(),
                                   mode="reduce-overhead"))
    first = None
    for _ in range(4):
        results = []  # (loss, dW, db) of each: cloned, since the next graph replay reuses its outputs' memory
        for step, (layer, _), opt in zip(steps, layers, opts):
            torch.compiler.cudagraph_mark_step_begin()
            loss = step()
            loss.backward()
            results.append([t.detach().clone() for t in (loss, layer.weight.grad, layer.bias.grad)])
            opt.step()  # before the other layer's replay, which takes over this one's gradients' memory
            opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(*results))
        first = results[0][0] if first is None else first
    assert not torch.equal(first, results[0][0])  # the steps moved the weights
