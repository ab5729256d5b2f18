"""fp4gen.nn.Linear and fp4gen.nn.GroupedLinear take what a model hands them: a batch of no tokens (an expert no
token was routed to, an empty micro-batch), whose gradients are zeros, and inputs and output gradients in any
memory layout: a slice of a wider tensor (row stride past the row, rows starting 16-byte aligned or not), a
transposed or permuted view, a view that starts one element into its storage (not 16-byte aligned), rows
broadcast from one (stride 0). Each such step must give, byte for byte, what the same layer gives for contiguous
copies of the same values, on every call: the first call takes the separate calls, later ones on CUDA the
launcher's step, which is chosen by stride and alignment.
"""
import pytest
import torch

import fp4gen
from conftest import group_ends

TOKENS, IN, OUT = 48, 64, 128
RECIPES = {"default": fp4gen.Recipe(),
           "1x16-rowdY-4o6": fp4gen.Recipe(weight_block=(1, 16), gradient_scaling="row", four_over_six="all")}


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to the 2-D `values` with the given memory layout (not contiguous, but for "contiguous")."""
    rows, cols = values.shape
    if layout == "contiguous":
        return values.clone()
    if layout == "column slice":  # the first cols columns of a wider tensor
        wide = torch.zeros(rows, cols + 48, dtype=values.dtype, device=values.device)
        wide[:, :cols] = values
        return wide[:, :cols]
    if layout == "unaligned rows":  # a slice of a tensor one column wider: row starts off 16 bytes
        wide = torch.zeros(rows, cols + 1, dtype=values.dtype, device=values.device)
        wide[:, :cols] = values
        return wide[:, :cols]
    if layout == "transposed":  # stride (1, rows)
        return values.t().contiguous().t()
    if layout == "unaligned start":  # one element into its storage: the data pointer is off 16 bytes
        flat = torch.zeros(rows * cols + 1, dtype=values.dtype, device=values.device)
        out = flat[1:].view(rows, cols)
        out.copy_(values)
        return out
    if layout == "broadcast row":  # every row the first one's: stride (0, 1)
        return values[:1].expand(rows, cols)
    raise ValueError(layout)


LAYOUTS = ["column slice", "unaligned rows", "transposed", "unaligned start", "broadcast row"]


def values_for(layout: str, rows: int, cols: int, dtype, device) -> torch.Tensor:
    values = torch.randn(rows, cols, dtype=dtype, device=device)
    return values[:1].expand(rows, cols).clone() if layout == "broadcast row" else values


def steps(layer, x, dy, *extra, calls=3):
    """Y, dX, dW, db of `calls` training steps on the same inputs, then Y of `calls` forwards without autograd."""
    results = []
    for _ in range(calls):
        layer.weight.grad = layer.bias.grad = None
        xg = x.detach().requires_grad_(True)
        y = layer(xg, *extra)
        y.backward(dy)
        results += [y, xg.grad, layer.weight.grad, layer.bias.grad]
    with torch.no_grad():
        results += [layer(x, *extra) for _ in range(calls)]
    return results


def check_linear_input_layout(x_layout, dy_layout, recipe, device, dtype=torch.bfloat16):
    torch.manual_seed(3)
    layers = [fp4gen.nn.Linear(IN, OUT, device=device, dtype=dtype, recipe=RECIPES[recipe]) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = values_for(x_layout, TOKENS, IN, dtype, device)
    dy = values_for(dy_layout, TOKENS, OUT, dtype, device)
    want = steps(layers[0], laid_out(x, "contiguous"), laid_out(dy, "contiguous"))
    got = steps(layers[1], laid_out(x, x_layout), laid_out(dy, dy_layout))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"result {i} differs"


def check_linear_3d_views(device, dtype=torch.bfloat16):
    """A sequence-first activation [S, B, K] transposed to [B, S, K], and its output gradient the same way."""
    torch.manual_seed(4)
    layers = [fp4gen.nn.Linear(IN, OUT, device=device, dtype=dtype) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(6, 8, IN, dtype=dtype, device=device).transpose(0, 1)
    dy = torch.randn(6, 8, OUT, dtype=dtype, device=device).transpose(0, 1)
    want = steps(layers[0], x.contiguous(), dy.contiguous())
    got = steps(layers[1], x, dy)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.equal(g, w), f"result {i} differs"


def check_grouped_input_layout(x_layout, dy_layout, device, dtype=torch.bfloat16):
    torch.manual_seed(5)
    layers = [fp4gen.nn.GroupedLinear(3, IN, OUT, bias=True, device=device, dtype=dtype) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    ends = group_ends([20, 0, TOKENS - 20])
    offsets = torch.tensor(ends, device=device) if device != "cpu" else ends
    x = values_for(x_layout, TOKENS, IN, dtype, device)
    dy = values_for(dy_layout, TOKENS, OUT, dtype, device)
    want = steps(layers[0], laid_out(x, "contiguous"), laid_out(dy, "contiguous"), offsets)
    got = steps(layers[1], laid_out(x, x_layout), laid_out(dy, dy_layout), offsets)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"result {i} differs"


def layout_pairs():
    both_transposed = [("transposed", "transposed")]
    return [(x, "contiguous") for x in LAYOUTS] + [("contiguous", dy) for dy in LAYOUTS] + both_transposed


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_layout,dy_layout", layout_pairs())
def test_linear_takes_any_input_layout(x_layout, dy_layout, recipe):
    check_linear_input_layout(x_layout, dy_layout, recipe, "cpu")


def test_linear_takes_a_transposed_3d_input():
    check_linear_3d_views("cpu")


@pytest.mark.parametrize("x_layout,dy_layout", layout_pairs())
def test_grouped_linear_takes_any_input_layout(x_layout, dy_layout):
    check_grouped_input_layout(x_layout, dy_layout, "cpu")


def check_an_empty_batch(grouped, device, main_grad=False, dtype=torch.bfloat16):
    """No tokens: Y [0, out], dX [0, in], dW and db zeros (a main_grad accumulated into stays as it was), on every
    call, with and without autograd."""
    torch.manual_seed(6)
    if grouped:
        layer = fp4gen.nn.GroupedLinear(3, IN, OUT, bias=True, device=device, dtype=dtype,
                                        accumulate_main_grad=main_grad)
        extra = (torch.zeros(3, dtype=torch.int64, device=device) if device != "cpu" else [0, 0, 0],)
    else:
        layer = fp4gen.nn.Linear(IN, OUT, device=device, dtype=dtype, accumulate_main_grad=main_grad)
        extra = ()
    if main_grad:
        layer.weight.main_grad = torch.randn(layer.weight.shape, device=device)
        before = layer.weight.main_grad.clone()
    for _ in range(3):
        layer.weight.grad = layer.bias.grad = None
        x = torch.randn(0, IN, device=device, dtype=dtype, requires_grad=True)
        y = layer(x, *extra)
        assert y.shape == (0, OUT) and y.dtype == dtype
        y.sum().backward()
        assert x.grad.shape == (0, IN)
        if main_grad:
            assert layer.weight.grad is None and torch.equal(layer.weight.main_grad, before)
        else:
            assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
        assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))
        with torch.no_grad():
            assert layer(x, *extra).shape == (0, OUT)


def check_a_gemm_over_an_empty_sum(device):
    """K = 0 (dW over no tokens): D is the epilogue's bias (+ out when accumulating), zeros without either."""
    a = fp4gen.NVFP4Data(torch.empty(5, 0, dtype=torch.uint8, device=device),
                         torch.empty(5, 0, dtype=torch.float8_e4m3fn, device=device), torch.ones(5, device=device))
    b = fp4gen.NVFP4Data(torch.empty(32, 0, dtype=torch.uint8, device=device),
                         torch.empty(32, 0, dtype=torch.float8_e4m3fn, device=device), torch.ones(1, device=device))
    bias = torch.randn(32, device=device)
    assert torch.equal(fp4gen.gemm(a, b, torch.float32), torch.zeros(5, 32, device=device))
    assert torch.equal(fp4gen.gemm(a, b, torch.bfloat16, bias=bias), bias.bfloat16().expand(5, 32))
    out = torch.randn(5, 32, device=device)
    want = out + bias
    assert fp4gen.gemm(a, b, out=out, accumulate=True, bias=bias) is out and torch.equal(out, want)
    assert torch.equal(fp4gen.gemm(a, b, out=out), torch.zeros(5, 32, device=device))


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_an_empty_batch_gives_empty_outputs_and_zero_gradients(grouped, main_grad):
    check_an_empty_batch(grouped, "cpu", main_grad)


def test_a_gemm_over_an_empty_sum_is_its_epilogue():
    check_a_gemm_over_an_empty_sum("cpu")
