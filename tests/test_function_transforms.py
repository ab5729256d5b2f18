"""torch.func: the layers and the quantize calls refuse to run inside a transform, with a message that says what
to use instead; torch.func.functional_call without a transform runs the layer with the given tensors."""
import pytest
import torch
from torch.func import functional_call

import fp4gen

MESSAGE = "does not run under torch.func transforms"


def _square_loss(module, params, *inputs):
    return functional_call(module, params, inputs).square().sum()


def test_functional_call_uses_the_given_parameters_then_the_layer_its_own():
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(64, 32)
    x = torch.randn(32, 64)
    before = layer(x)
    other = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
    with_other = functional_call(layer, other, (x,))
    twin = fp4gen.nn.Linear(64, 32)
    with torch.no_grad():
        twin.weight.copy_(other["weight"]), twin.bias.copy_(other["bias"])
    assert torch.equal(with_other, twin(x))
    assert not torch.equal(with_other, before)
    assert torch.equal(layer(x), before)  # the next ordinary call quantizes the layer's own weight again


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_linear_refuses_transforms(transform):
    layer = fp4gen.nn.Linear(64, 32)
    x = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match=MESSAGE) as caught:
        if transform == "grad":
            torch.func.grad(lambda params: _square_loss(layer, params, x))(dict(layer.named_parameters()))
        else:
            torch.func.vmap(layer)(torch.randn(2, 32, 64))
    assert "fp4gen.nn.Linear" in str(caught.value) and "torch.autograd" in str(caught.value)


def test_linear_refuses_a_gradient_taken_with_respect_to_its_input_only():
    layer = fp4gen.nn.Linear(64, 32)
    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.func.grad(lambda x: layer(x).square().sum())(torch.randn(32, 64))


def test_grouped_linear_refuses_transforms():
    layer = fp4gen.nn.GroupedLinear(2, 64, 64)
    x, offsets = torch.randn(32, 64), torch.tensor([16, 32])
    with pytest.raises(RuntimeError, match=MESSAGE) as caught:
        torch.func.grad(lambda params: _square_loss(layer, params, x, offsets))(dict(layer.named_parameters()))
    assert "fp4gen.nn.GroupedLinear" in str(caught.value)


@pytest.mark.parametrize("call", ["quantize", "quantize_grouped"])
def test_quantize_calls_refuse_transforms(call):
    def quantize(x):
        if call == "quantize":
            return fp4gen.quantize(x, scaling="tensor").rowwise.data
        return fp4gen.quantize_grouped(x, [16, 32], scaling="tensor").rowwise.data

    with pytest.raises(RuntimeError, match=MESSAGE) as caught:
        torch.func.vmap(quantize)(torch.randn(2, 32, 64))
    assert f"fp4gen.{call}" in str(caught.value)


def test_a_layer_called_inside_a_transform_on_plain_tensors_is_refused_too():
    """Inside a transform even ops on plain tensors give results without storage: any call there is refused."""
    layer = fp4gen.nn.Linear(64, 32)
    x = torch.randn(32, 64)

    def f(t):
        return layer(x).sum() + (t * 2).sum()  # x and the parameters are not the transform's inputs

    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.func.grad(f)(torch.randn(3))
    assert layer(x).shape == (32, 32)  # and outside the transform the same call runs
