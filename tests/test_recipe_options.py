"""fp4gen.Recipe's training-quality options in fp4gen.nn.Linear (reference backend, CPU): each operand gets
the options its recipe names, the wgrad operands' Hadamard transforms cancel, stochastic rounding of dY
draws from the default RNG state and advances it, and bad recipes are clear errors."""
import pytest
import torch

import fp4gen
from fp4gen import reference

TOKENS, IN, OUT = 64, 48, 32


def _layer(recipe, seed=0):
    torch.manual_seed(seed)
    return fp4gen.nn.Linear(IN, OUT, bias=False, recipe=recipe)


def _dq(operand):
    return reference.dequantize(operand, torch.float32).double()


@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(four_over_six="gradients"), ValueError, "gradients never take 4over6"),
    (dict(four_over_six="weight"), ValueError, "'weights'"),
    (dict(four_over_six_error="l2"), ValueError, "four_over_six_error='l2'"),
    (dict(gradient_scaling="token"), ValueError, "gradient_scaling='token'"),
    (dict(stochastic_rounding="yes"), TypeError, "stochastic_rounding must be a bool"),
    (dict(hadamard_wgrad=1), TypeError, "hadamard_wgrad must be a bool"),
])
def test_bad_recipes_are_clear_errors(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        fp4gen.Recipe(**kwargs)


@pytest.mark.parametrize("four_over_six", ["weights", "activations", "all"])
@pytest.mark.parametrize("error_mode", ["mae", "mse"])
def test_forward_uses_four_over_six_on_the_named_tensors(four_over_six, error_mode):
    recipe = fp4gen.Recipe(four_over_six=four_over_six, four_over_six_error=error_mode, weight_block=(16, 16))
    layer = _layer(recipe)
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        y = layer(x)
    x_mode = error_mode if four_over_six in ("activations", "all") else None
    w_mode = error_mode if four_over_six in ("weights", "all") else None
    qx = fp4gen.quantize(x, "row", (1, 16), columnwise=False, four_over_six=x_mode)
    qw = fp4gen.quantize(layer.weight.detach(), "tensor", (16, 16), four_over_six=w_mode)
    assert qx.rowwise.e4m3_max == (256.0 if x_mode else 448.0)
    assert qw.rowwise.e4m3_max == (256.0 if w_mode else 448.0)
    expected = fp4gen.gemm(qx.rowwise, qw.rowwise, out_dtype=torch.float32)
    assert torch.equal(y, expected)
    # and the choice mattered: the plain recipe gives another output
    with torch.no_grad():
        plain = _layer(fp4gen.Recipe(hadamard_wgrad=False))(x)
    assert not torch.equal(y, plain)


def _wgrad(recipe, x, dy, layer=None):
    layer = layer if layer is not None else _layer(recipe)
    xr = x.clone().requires_grad_(True)
    layer(xr).backward(dy)
    return layer.weight.grad.double(), xr.grad


def test_hadamard_wgrad_transforms_both_operands_and_cancels():
    torch.manual_seed(1)
    x, dy = torch.randn(TOKENS, IN), torch.randn(TOKENS, OUT)
    x[5, :] *= 30.0  # an outlier token: what the transform spreads over its 16-token group
    recipe = fp4gen.Recipe(hadamard_wgrad=True)
    dw, _ = _wgrad(recipe, x, dy)
    # the operands the layer multiplied: both columnwise copies from the transform
    qx = fp4gen.quantize(x, "row", (1, 16), rowwise=False, hadamard=True)
    qdy = fp4gen.quantize(dy, "tensor", (1, 16), rowwise=False, hadamard=True)
    expected = _dq(qdy.columnwise) @ _dq(qx.columnwise).T
    assert torch.allclose(dw, expected, rtol=1e-2, atol=1e-3 * expected.abs().max().item())
    # H H^T = I along the tokens: the product approximates dY^T X as closely as without the transform
    exact = dy.double().T @ x.double()
    error = ((dw - exact).norm() / exact.norm()).item()
    plain_dw, _ = _wgrad(fp4gen.Recipe(hadamard_wgrad=False), x, dy)
    plain_error = ((plain_dw - exact).norm() / exact.norm()).item()
    assert error < 0.2 and error < 1.5 * plain_error, (error, plain_error)
    # a transform of one operand alone would not cancel
    one_sided = _dq(qdy.columnwise) @ _dq(fp4gen.quantize(x, "row", (1, 16), rowwise=False).columnwise).T
    assert ((one_sided - exact).norm() / exact.norm()).item() > 0.5


def test_stochastic_gradients_draw_from_the_default_state_and_advance_it():
    torch.manual_seed(2)
    x, dy = torch.randn(TOKENS, IN), torch.randn(TOKENS, OUT)
    recipe = fp4gen.Recipe(stochastic_rounding=True, hadamard_wgrad=False)
    layer = _layer(recipe)
    torch.manual_seed(1234)  # the default state follows the seed
    state = fp4gen.RNGState.default("cpu")
    start = state.offset.item()
    dw1, dx1 = _wgrad(recipe, x, dy, layer)
    assert state.offset.item() == start + 2  # one quantize call of dY per backward
    # the same state gives the same bits: replay the dY quantization by hand
    replay = fp4gen.RNGState(1234)
    replay.tensor[1] = start
    qdy = fp4gen.quantize(dy, "tensor", (1, 16), rounding="stochastic", rng=replay)
    qw = fp4gen.quantize(layer.weight.detach(), "tensor", (16, 16))
    qx = fp4gen.quantize(x, "row", (1, 16), rowwise=False)
    assert torch.equal(dx1, fp4gen.gemm(qdy.rowwise, qw.columnwise, out_dtype=torch.float32))
    assert torch.equal(dw1.float(), fp4gen.gemm(qdy.columnwise, qx.columnwise, out_dtype=torch.float32))
    # the next backward draws fresh bits
    layer.weight.grad = None
    dw2, _ = _wgrad(recipe, x, dy, layer)
    assert not torch.equal(dw1, dw2)
    # and the nearest-rounding recipe draws none
    before = state.offset.item()
    _wgrad(fp4gen.Recipe(hadamard_wgrad=False), x, dy, fp4gen.nn.Linear(IN, OUT, bias=False))
    assert state.offset.item() == before


def test_row_scaled_gradients():
    torch.manual_seed(3)
    x, dy = torch.randn(TOKENS, IN), torch.randn(TOKENS, OUT)
    dy[7] *= 1e-3  # a quiet token: per-token scaling keeps its gradient's resolution
    recipe = fp4gen.Recipe(gradient_scaling="row", hadamard_wgrad=False)
    dw, dx = _wgrad(recipe, x, dy)
    layer = _layer(recipe)
    qdy = fp4gen.quantize(dy, "row", (1, 16))
    qw = fp4gen.quantize(layer.weight.detach(), "tensor", (16, 16))
    qx = fp4gen.quantize(x, "row", (1, 16), rowwise=False)
    assert torch.equal(dx, fp4gen.gemm(qdy.rowwise, qw.columnwise, out_dtype=torch.float32))
    assert torch.equal(dw.float(), fp4gen.gemm(qdy.columnwise, qx.columnwise, out_dtype=torch.float32))
    assert qdy.rowwise.amax.numel() == TOKENS


def test_every_option_together_trains_on_cpu():
    recipe = fp4gen.Recipe(stochastic_rounding=True, hadamard_wgrad=True, four_over_six="all",
                           weight_block=(1, 16), gradient_scaling="row")
    torch.manual_seed(4)
    model = torch.nn.Sequential(fp4gen.nn.Linear(IN, 64, recipe=recipe), torch.nn.GELU(),
                                fp4gen.nn.Linear(64, OUT, recipe=recipe))
    teacher = torch.nn.Linear(IN, OUT)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        x = torch.randn(TOKENS, IN)
        loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
