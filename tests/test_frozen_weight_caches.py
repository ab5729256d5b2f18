"""fp4gen.nn.frozen_weight_caches on the CPU (reference backend): a frozen layer's quantized weight survives the
optimizer steps of another model (a normal cache is dropped by every step), is still remade when its weight changes
through the parameter, and a frozen layer that is trained after all is treated as any other."""
import copy
import warnings

import pytest
import torch

import fp4gen
from fp4gen import nn as fnn
from fp4gen.grouped_linear import stacked_copies

OFFSETS = [5, 5, 20, 32]  # four experts, one without tokens


def call(layer, x):
    return layer(x, OFFSETS) if isinstance(layer, fp4gen.nn.GroupedLinear) else layer(x)


def entry_of(layer):
    return layer._weight_cache.entry if isinstance(layer, fp4gen.nn.GroupedLinear) else layer._weight_cache


def make(index, seed=0):
    torch.manual_seed(seed)
    return fp4gen.nn.Linear(64, 32) if index == 0 else fp4gen.nn.GroupedLinear(4, 64, 64, bias=True)


def a_step_of_another_model():
    """One optimizer step of a model that shares nothing with the layers under test (the trained policy)."""
    policy = torch.nn.Linear(8, 8)
    with torch.enable_grad():
        policy(torch.randn(2, 8)).sum().backward()
    torch.optim.SGD(policy.parameters(), lr=0.1).step()


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.setattr(fnn, "_FROZEN_WARNING_GIVEN", False)  # the once-a-process warning, for each test


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_frozen_cache_survives_another_models_optimizer_steps(index):
    frozen, normal = make(index), make(index)
    assert fp4gen.nn.frozen_weight_caches(frozen) == 1 and frozen.frozen_weight_cache
    assert not normal.frozen_weight_cache
    x = torch.randn(32, 64)
    with torch.no_grad():
        expected = call(frozen, x)
        call(normal, x)
    kept = entry_of(frozen)
    for _ in range(2):
        a_step_of_another_model()
        assert entry_of(normal) is None  # dropped by the step, as every normal cache is
        assert entry_of(frozen) is kept
        with torch.no_grad():
            assert torch.equal(call(frozen, x), expected)
            call(normal, x)
        assert entry_of(frozen) is kept  # the forward reused it
    assert torch.equal(call(make(index), x), expected)


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_frozen_cache_sees_changes_made_through_the_parameter(index):
    layer = make(index)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(32, 64)
    with torch.no_grad():
        call(layer, x)
        source = make(index, seed=1)
        layer.load_state_dict(source.state_dict())  # copy_ into the parameters: their version counters move
        a_step_of_another_model()
        assert torch.equal(call(layer, x), call(source, x))
        layer.weight.mul_(-2.0)
        source.weight.mul_(-2.0)
        assert torch.equal(call(layer, x), call(source, x))
        layer.weight = torch.nn.Parameter(source.weight.detach().clone() * 3.0)  # a new parameter
        source.weight.mul_(3.0)
        assert torch.equal(call(layer, x), call(source, x))


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_write_through_data_needs_clear_weight_caches_also_across_steps(index):
    """What a frozen cache cannot see: an in-place write through .data, as a reference model's sync makes it. A normal
    cache would be dropped by the next optimizer step; a frozen one stays until clear_weight_caches."""
    layer = make(index)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(32, 64)
    with torch.no_grad():
        before = call(layer, x)
        source = copy.deepcopy(layer)  # makes its own caches
        source.weight.mul_(-2.0)
        layer.weight.data.mul_(-2.0)
        a_step_of_another_model()
        assert torch.equal(call(layer, x), before)  # stale, as documented
        assert fp4gen.nn.clear_weight_caches(layer) == 1
        assert torch.equal(call(layer, x), call(source, x))


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_frozen_layer_with_a_gradient_is_treated_as_a_trained_one(index):
    layer, twin = make(index), make(index)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(32, 64)
    opt, twin_opt = torch.optim.SGD(layer.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
    for step in range(2):
        call(layer, x).square().sum().backward()
        call(twin, x).square().sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert ["frozen_weight_caches" in str(w.message) for w in caught] == ([True] if step == 0 else [])  # once
        twin_opt.step()
        assert entry_of(layer) is None and layer.frozen_weight_cache  # dropped, still frozen
        opt.zero_grad(), twin_opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(call(layer, x), call(twin, x))


def test_a_main_grad_counts_as_a_gradient():
    layer = fp4gen.nn.Linear(64, 32, bias=False, accumulate_main_grad=True)
    layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    fp4gen.nn.frozen_weight_caches(layer)
    with torch.no_grad():
        layer(torch.randn(16, 64))
    assert layer.weight.grad is None and layer.has_gradients()
    with pytest.warns(UserWarning, match="frozen"):
        a_step_of_another_model()
    assert layer._weight_cache is None


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_optimizer_steps_do_not_remake_a_frozen_static_cache(index):
    layer = make(index)
    fp4gen.nn.static_weight_caches(layer)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(32, 64)
    with torch.no_grad():
        call(layer, x)
    kept = entry_of(layer)
    a_step_of_another_model()
    assert entry_of(layer) is kept  # a static cache that is not frozen is remade here (a new entry, same tensors)
    # trained after all: the step's hook remakes it in its own tensors, from the stepped weight
    call(layer, x).sum().backward()
    with pytest.warns(UserWarning, match="frozen"):
        torch.optim.SGD(layer.parameters(), lr=0.5).step()
    now = entry_of(layer)
    assert now is not kept and all(a is b for a, b in zip(now[1] + now[2], kept[1] + kept[2]))
    with torch.no_grad():
        twin = copy.deepcopy(layer)  # its caches are made afresh
        assert torch.equal(call(layer, x), call(twin, x))


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_freezing_and_unfreezing_keep_a_current_entry(index):
    layer = make(index)
    x = torch.randn(32, 64)
    with torch.no_grad():
        call(layer, x)
        made = entry_of(layer)
        fp4gen.nn.frozen_weight_caches(layer)
        call(layer, x)
        assert entry_of(layer)[1:] == made[1:]  # the same payload, keyed anew: no quantization
        a_step_of_another_model()
        kept = entry_of(layer)
        assert kept[1:] == made[1:]
        assert fp4gen.nn.frozen_weight_caches(layer, enabled=False) == 1 and not layer.frozen_weight_cache
        call(layer, x)
        assert entry_of(layer)[1:] == made[1:]  # normal again, current until the next step
        a_step_of_another_model()
        assert entry_of(layer) is None


def test_a_stale_entry_stays_stale_when_frozen():
    """An entry made before an optimizer step (a normal one that a step did not reach: made while the layer was not
    registered) must not become current by freezing the layer."""
    layer = make(0)
    with torch.no_grad():
        layer(torch.randn(16, 64))
    entry = layer._weight_cache
    stale = ((entry[0][0], entry[0][1] - 1, *entry[0][2:]), *entry[1:])
    assert fnn.rekeyed(stale, True) is stale
    assert fnn.rekeyed(entry, True)[0][1] is None


def test_a_reference_model_keeps_its_caches_through_the_policys_steps():
    """The RL pattern of docs/recipes.md: a frozen copy of the policy as the reference; the policy's steps leave the
    reference's quantized weights alone, and its outputs stay those of its own (unchanged) weights."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(fp4gen.nn.Linear(64, 64), torch.nn.GELU(), fp4gen.nn.Linear(64, 32))
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    assert fp4gen.nn.frozen_weight_caches(reference) == 2
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    x = torch.randn(32, 64)
    with torch.no_grad():
        expected = reference(x)
    kept = [m._weight_cache for m in reference if isinstance(m, fp4gen.nn.Linear)]
    for _ in range(3):
        policy(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(reference(x), expected)
        assert [m._weight_cache for m in reference if isinstance(m, fp4gen.nn.Linear)] == kept
        assert all(a is b for a, b in zip([m._weight_cache for m in reference if isinstance(m, fp4gen.nn.Linear)],
                                          kept))


def test_pickled_layers_keep_the_setting():
    layer = make(1)
    fp4gen.nn.frozen_weight_caches(layer)
    loaded = copy.deepcopy(layer)
    assert loaded.frozen_weight_cache
    linear = make(0)
    linear.frozen_weight_cache = True
    assert copy.deepcopy(linear).frozen_weight_cache


def test_bad_arguments_raise():
    layer = make(0)
    with pytest.raises(TypeError, match="frozen_weight_cache must be True or False"):
        layer.frozen_weight_cache = 1
    with pytest.raises(TypeError, match="frozen_weight_cache must be True or False"):
        fp4gen.nn.frozen_weight_caches(layer, enabled="yes")
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        fp4gen.nn.frozen_weight_caches([layer])
    unkept = fp4gen.nn.Linear(64, 32, keep_quantized_weight=False)
    with pytest.raises(ValueError, match="no cache to freeze"):
        unkept.frozen_weight_cache = True
    both = torch.nn.Sequential(layer, unkept)
    with pytest.raises(ValueError, match="no cache to freeze"):
        fp4gen.nn.frozen_weight_caches(both)
    assert not layer.frozen_weight_cache  # none set where one fails
    grouped = fp4gen.nn.GroupedLinear(2, 64, 64, keep_quantized_weight=False)
    with pytest.raises(ValueError, match="no cache to freeze"):
        grouped.frozen_weight_cache = True
    assert fp4gen.nn.frozen_weight_caches(both, enabled=False) == 2  # turning them off is always allowed


def fresh_columnwise(layer):
    """The weight's columnwise triple quantized now, as the layer quantizes it."""
    if isinstance(layer, fp4gen.nn.GroupedLinear):
        return stacked_copies(fp4gen.grouped_torch_ops.for_caller(), layer.weight.detach(), False, layer.recipe)[1]
    return fnn.quantize_weight(fp4gen.torch_ops.for_caller(), layer.weight.detach(), layer.recipe)[3:]


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_frozen_forward_without_autograd_keeps_the_rowwise_copy_alone(index):
    """A reference model's forwards (no autograd) need only W's rowwise copy: a frozen cache keeps that alone, and
    the first forward with autograd adds the columnwise copy (dgrad's operand) to the same entry, with the bytes
    that quantizing both at once gives and the gradients of a normal layer."""
    layer, normal = make(index), make(index)
    layer.requires_grad_(False), normal.requires_grad_(False)  # frozen base weights, as under LoRA
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(32, 64)
    with torch.no_grad():
        assert torch.equal(call(layer, x), call(normal, x))
    rowwise = entry_of(layer)[1]
    assert entry_of(layer)[2] is None and entry_of(normal)[2] is not None  # a normal cache makes both at once
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    dy = torch.randn(32, 32 if index == 0 else 64)
    call(layer, xs[0]).backward(dy)
    call(normal, xs[1]).backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad)
    entry = entry_of(layer)
    assert entry[1] is rowwise and all(torch.equal(a, b) for a, b in zip(entry[2], fresh_columnwise(layer)))
    assert all(torch.equal(a, b) for a, b in zip(entry[2], entry_of(normal)[2]))
    with torch.no_grad():
        call(layer, x)
    assert entry_of(layer) is entry  # kept whole


@pytest.mark.parametrize("index", [0, 1], ids=["Linear", "GroupedLinear"])
def test_a_static_frozen_cache_holds_both_copies(index):
    layer = make(index)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(32, 64)
    with torch.no_grad():
        call(layer, x)
        assert entry_of(layer)[2] is None
        fp4gen.nn.static_weight_caches(layer)  # graphs read both copies where they lie: the half entry goes
        assert entry_of(layer) is None
        call(layer, x)
    assert all(torch.equal(a, b) for a, b in zip(entry_of(layer)[2], fresh_columnwise(layer)))
