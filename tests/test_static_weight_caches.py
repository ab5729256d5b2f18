"""fp4gen.nn.static_weight_caches on the CPU (reference backend): the kept tensors are remade in place after the
weights change, and a compiled forward reads them instead of quantizing the weight (CUDA-graph capture:
tests/gpu/test_static_weight_caches_gpu.py)."""
import pytest
import torch

import fp4gen
from fp4gen.grouped_linear import stacked_copies

OFFSETS = [5, 5, 20, 32]  # four experts, one without tokens


def fresh_weight_copies(layer):
    """The weight's (rowwise, columnwise) triples quantized now, as the layer quantizes them."""
    if isinstance(layer, fp4gen.nn.GroupedLinear):
        row, col = stacked_copies(fp4gen.grouped_torch_ops.for_caller(), layer.weight.detach(), False, layer.recipe)
        return tuple(row), tuple(col)
    q = fp4gen.quantize(layer.weight.detach(), scaling="tensor", block=layer.recipe.weight_block)
    return (q.rowwise.data, q.rowwise.scale, q.rowwise.amax), (q.columnwise.data, q.columnwise.scale,
                                                               q.columnwise.amax)


def cached_weight_copies(layer):
    entry = layer._weight_cache.entry if isinstance(layer, fp4gen.nn.GroupedLinear) else layer._weight_cache
    return tuple(entry[1]), tuple(entry[2])


def assert_copies_equal(got, want):
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(g, w)


def call(layer, x):
    return layer(x, OFFSETS) if isinstance(layer, fp4gen.nn.GroupedLinear) else layer(x)


def layers():
    torch.manual_seed(0)
    return [fp4gen.nn.Linear(64, 32), fp4gen.nn.GroupedLinear(4, 64, 64)]


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_an_optimizer_step_remakes_a_static_cache_in_its_own_tensors(index):
    layer = layers()[index]
    assert fp4gen.nn.static_weight_caches(layer) == 1 and layer.static_weight_cache
    x = torch.randn(32, 64)
    call(layer, x).sum().backward()
    kept = cached_weight_copies(layer)
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    # before any forward: the step's hook remade the copies, in the same tensors, from the new weight
    now = cached_weight_copies(layer)
    assert all(a is b for a, b in zip(now[0] + now[1], kept[0] + kept[1]))
    assert_copies_equal(now, fresh_weight_copies(layer))
    assert not torch.equal(now[0][0], fresh_weight_copies(layers()[index])[0][0])  # the step changed the codes


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_clear_weight_caches_requantizes_a_static_cache_at_once(index):
    layer = layers()[index]
    fp4gen.nn.static_weight_caches(layer)
    x = torch.randn(32, 64)
    call(layer, x)
    kept = cached_weight_copies(layer)
    layer.weight.data.mul_(-3.0)  # through .data: no version bump, the cache cannot see it
    assert fp4gen.nn.clear_weight_caches(layer) == 1
    now = cached_weight_copies(layer)
    assert all(a is b for a, b in zip(now[0] + now[1], kept[0] + kept[1]))
    assert_copies_equal(now, fresh_weight_copies(layer))


def test_a_static_bias_copy_follows_the_bias():
    layer = layers()[0]
    fp4gen.nn.static_weight_caches(layer)
    x = torch.randn(16, 64)
    layer(x)
    kept = layer._bias_cache[1]
    torch.optim.SGD(layer.parameters(), lr=0.5).step()  # no gradients: SGD leaves the parameters
    with torch.no_grad():
        layer.bias.add_(1.0)  # through the parameter: the next eager forward sees it
    layer(x)
    assert layer._bias_cache[1] is kept and torch.equal(kept, layer.bias.detach())


def test_normal_caches_are_dropped_again_once_no_longer_static():
    layer = layers()[0]
    fp4gen.nn.static_weight_caches(layer)
    layer(torch.randn(16, 64)).sum().backward()
    assert fp4gen.nn.static_weight_caches(layer, enabled=False) == 1 and not layer.static_weight_cache
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    assert layer._weight_cache is None


def _compiled_ops(layer, x, static: bool):
    """The fp4gen operators in the graph torch.compile makes of a no-grad forward, and its output."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    fp4gen.nn.static_weight_caches(layer, static)
    with torch.no_grad():
        call(layer, x)  # the eager warm-up
        torch._dynamo.reset()
        y = torch.compile(lambda t: call(layer, t), backend=backend, fullgraph=True)(x)
    ops = [str(n.target) for g in graphs for n in g.graph.nodes if "fp4gen" in str(n.target)]
    return ops, y


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_compiled_forward_reads_a_static_cache_instead_of_quantizing_the_weight(index):
    layer, x = layers()[index], torch.randn(32, 64)
    normal_ops, normal_y = _compiled_ops(layer, x, static=False)
    static_ops, static_y = _compiled_ops(layer, x, static=True)
    assert normal_ops.count(normal_ops[0]) == 2  # X's quantization and W's
    assert static_ops.count(static_ops[0]) == 1 and len(static_ops) == len(normal_ops) - 1  # X's alone
    assert torch.equal(static_y, normal_y)


def test_compiled_training_steps_see_each_optimizer_step_without_recompiling():
    layer, x = layers()[0], torch.randn(32, 64)
    fp4gen.nn.static_weight_caches(layer)
    layer(x)
    torch._dynamo.reset()
    compiles = []

    def backend(gm, inputs):
        compiles.append(gm)
        return gm.forward

    step = torch.compile(layer, backend=backend)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    outputs = []
    for _ in range(3):
        y = step(x)
        y.sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            outputs.append(step(x))
            assert torch.equal(outputs[-1], layer(x))  # eager, from the same cache: the weights after the step
    assert not torch.equal(outputs[0], outputs[-1])
    assert len(compiles) == 2  # the training forward and the no-grad one, each compiled once


def test_a_compiled_call_before_any_eager_forward_raises():
    layer = layers()[0]
    fp4gen.nn.static_weight_caches(layer)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="run one forward eagerly"):
        torch.compile(layer, backend="eager")(torch.randn(16, 64))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="keep_quantized_weight=False"):
        fp4gen.nn.static_weight_caches(fp4gen.nn.Linear(64, 32, keep_quantized_weight=False))
    with pytest.raises(ValueError, match="keep_quantized_weight=False"):
        fp4gen.nn.static_weight_caches(fp4gen.nn.GroupedLinear(2, 64, 64, keep_quantized_weight=False))
    with pytest.raises(TypeError, match="True or False"):
        layers()[0].static_weight_cache = 1
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fp4gen.nn.static_weight_caches(torch.randn(3))


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_kept_tensors_are_marked_as_static_addresses_also_when_made_before(index):
    """torch.compile's CUDA graphs copy an input in at every call unless it is marked as a static address: a
    static cache's tensors are, also those of an entry made while the cache was normal."""
    layer = layers()[index]
    call(layer, torch.randn(32, 64))  # a normal cache's entry
    copies = cached_weight_copies(layer)
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in copies[0] + copies[1])
    fp4gen.nn.static_weight_caches(layer)
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in copies[0] + copies[1])
    if index == 0:
        assert getattr(layer._bias_cache[1], "_dynamo_static_input_type", None)
