"""Training after a pass under torch.inference_mode (an RL rollout, an evaluation): the tensors fp4gen keeps between
calls (a layer's quantized weight and fp32 bias, the default random states, the empty placeholder state) are
normal tensors even when an inference-mode call made them, so the training step that follows can save them for
backward and advance them, and equals byte for byte the step of a layer that never ran in inference mode."""
import pytest
import torch

import fp4gen
from conftest import group_ends
from fp4gen.rng import RNGState
from test_linear import RECIPES


def _step(layer, x, dy, *extra):
    """(Y, dX, dW, db) of one fwd+bwd step."""
    xg = x.clone().requires_grad_()
    y = layer(xg, *extra)
    y.backward(dy)
    return y.detach(), xg.grad, layer.weight.grad, layer.bias.grad


def _twins(make):
    """Two layers with the same parameters: one to run an inference pass first, one that never does."""
    torch.manual_seed(11)
    first = make()
    second = make()
    second.load_state_dict(first.state_dict())
    return first, second


def _check_steps_equal(first, second, x, dy, *extra):
    """first: an inference-mode forward (filling its caches), then a training step; second: the training step
    alone, drawing the same random bits. Every output and gradient must agree bit for bit."""
    rng = RNGState.default(x.device).tensor
    start = rng.clone()
    with torch.inference_mode():
        y_rollout = first(x, *extra)
    assert y_rollout.is_inference()
    got = _step(first, x, dy, *extra)
    rng.copy_(start)  # the same bits for a stochastically rounded dY
    want = _step(second, x, dy, *extra)
    for name, g, w in zip(("Y", "dX", "dW", "db"), got, want):
        assert torch.equal(g, w), name
    assert torch.equal(y_rollout, got[0])  # the rollout's Y is the training forward's


def check_linear_training_after_an_inference_pass(recipe, device):
    first, second = _twins(lambda: fp4gen.nn.Linear(64, 48, device=device, dtype=torch.bfloat16,
                                                    recipe=RECIPES[recipe]))
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        first(x)
        key = first._weight_cache[0]
    _check_steps_equal(first, second, x, dy)
    # the cached weight made in inference mode served the training step: not quantized again
    assert first._weight_cache[0] == key
    assert not any(t.is_inference() for t in first._weight_cache[1] + first._weight_cache[2])
    assert not first._bias_cache[1].is_inference()


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_linear_trains_after_an_inference_pass(recipe):
    check_linear_training_after_an_inference_pass(recipe, "cpu")


def check_grouped_linear_training_after_an_inference_pass(device):
    first, second = _twins(lambda: fp4gen.nn.GroupedLinear(3, 64, 128, bias=True, device=device,
                                                           dtype=torch.bfloat16))
    offsets = torch.tensor(group_ends([5, 0, 27]), device=device)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn(32, 128, device=device, dtype=torch.bfloat16)
    _check_steps_equal(first, second, x, dy, offsets)
    assert not any(t.is_inference() for t in first._weight_cache.entry[1] + first._weight_cache.entry[2])


def test_grouped_linear_trains_after_an_inference_pass():
    check_grouped_linear_training_after_an_inference_pass("cpu")


def test_converted_model_trains_after_an_inference_rollout():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    fp4gen.convert(model)
    x = torch.randn(16, 64)
    with torch.inference_mode():
        model(x)
    model(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def check_random_states_made_in_inference_mode_advance_outside_it(device):
    """The default state first drawn from inside inference mode, and a state the user makes there, are advanced
    by calls outside it (an in-place update, which inference tensors refuse)."""
    torch.manual_seed(987654)  # a seed no earlier test used: the default state is made afresh below
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        fp4gen.quantize(x, scaling="tensor", rounding="stochastic")
        mine = RNGState(5, device=device)
    fp4gen.quantize(x, scaling="tensor", rounding="stochastic")
    assert RNGState.default(device).tensor.tolist() == [987654, 4]  # two calls, two offsets each
    fp4gen.quantize(x, scaling="tensor", rounding="stochastic", rng=mine)
    mine.advance()
    assert mine.tensor.tolist() == [5, 4]


def test_random_states_made_in_inference_mode_advance_outside_it():
    check_random_states_made_in_inference_mode_advance_outside_it("cpu")
