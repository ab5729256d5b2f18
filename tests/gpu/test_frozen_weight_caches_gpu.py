"""fp4gen.nn.frozen_weight_caches on the GPU (the C++ launcher's steps and the CUDA kernels): a frozen reference keeps
its quantized weights through the policy's optimizer steps, also a static one read by a captured forward, and a
frozen layer that is trained after all follows its weights like any other."""
import copy

import pytest
import torch

import fp4gen
from test_frozen_weight_caches import entry_of, fresh_columnwise
from test_static_weight_caches_gpu import captured, make

pytestmark = pytest.mark.gpu


def policy_and_optimizer(kind):
    policy, call = make(kind)
    return policy, call, torch.optim.AdamW(policy.parameters(), lr=1e-2)


def a_policy_step(policy, call, optimizer, x):
    call(policy, x).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_frozen_reference_keeps_its_cache_through_the_policys_steps(kind):
    policy, call, optimizer = policy_and_optimizer(kind)
    reference = copy.deepcopy(policy).requires_grad_(False)
    normal = copy.deepcopy(reference)
    fp4gen.nn.frozen_weight_caches(reference)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = call(reference, x)
        call(normal, x)
    kept = entry_of(reference)
    for _ in range(3):
        a_policy_step(policy, call, optimizer, x)
        assert entry_of(reference) is kept and entry_of(normal) is None
        with torch.no_grad():
            assert torch.equal(call(reference, x), expected)
            assert torch.equal(call(normal, x), expected)  # the normal cache was made again, to the same bytes
        assert entry_of(reference) is kept
    assert not torch.equal(call(policy, x), expected)  # the policy did move


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_captured_forward_of_a_frozen_static_reference_across_the_policys_steps(kind):
    """Rollouts of a reference from a CUDA graph: its static, frozen cache is neither dropped nor remade by the
    policy's steps, so replays keep reading the same tensors and give the eager output."""
    policy, call, optimizer = policy_and_optimizer(kind)
    reference = copy.deepcopy(policy).requires_grad_(False)
    fp4gen.nn.static_weight_caches(reference)
    fp4gen.nn.frozen_weight_caches(reference)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, out = captured(lambda: call(reference, x))
        expected = call(reference, x)
    kept = entry_of(reference)
    for _ in range(2):
        a_policy_step(policy, call, optimizer, x)
        assert entry_of(reference) is kept
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_trained_frozen_layer_follows_its_weights(kind, monkeypatch):
    monkeypatch.setattr(fp4gen.nn, "_FROZEN_WARNING_GIVEN", False)
    layer, call, optimizer = policy_and_optimizer(kind)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        before = call(layer, x)
    with pytest.warns(UserWarning, match="frozen_weight_caches"):
        a_policy_step(layer, call, optimizer, x)
    assert entry_of(layer) is None
    with torch.no_grad():
        twin = copy.deepcopy(layer)  # makes its caches afresh, from the stepped weights
        after = call(layer, x)
        assert torch.equal(after, call(twin, x)) and not torch.equal(after, before)


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_frozen_cache_adds_the_columnwise_copy_at_the_first_forward_with_autograd(kind):
    """The columnwise-only kernel's copy equals the one the both-copies kernel makes (a normal layer's), and dgrad
    through it gives a normal layer's input gradient."""
    layer, call = make(kind)
    layer.requires_grad_(False)
    normal = copy.deepcopy(layer)
    fp4gen.nn.frozen_weight_caches(layer)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(call(layer, x), call(normal, x))
    assert entry_of(layer)[2] is None
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    dy = torch.randn(128, layer.weight.shape[-2], device="cuda", dtype=torch.bfloat16)
    call(layer, xs[0]).backward(dy)
    call(normal, xs[1]).backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad)
    for got, fresh, both in zip(entry_of(layer)[2], fresh_columnwise(layer), entry_of(normal)[2]):
        assert torch.equal(got, fresh) and torch.equal(got, both)
