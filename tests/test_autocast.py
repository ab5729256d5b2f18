"""fp4gen.nn.Linear and fp4gen.nn.GroupedLinear under torch.autocast on CPU: fp32 parameters, the autocast dtype in
and out, as torch.nn.Linear does it. tests/gpu/test_autocast_gpu.py runs the same checks on CUDA."""
import pytest
import torch

import fp4gen
from test_linear import emulate, rel

DEVICE = "cpu"


def mixed_model(device, seed=0):
    """torch.nn.Linear -> GELU -> fp4gen.nn.Linear -> GELU -> torch.nn.Linear, fp32 parameters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), fp4gen.nn.Linear(128, 96),
                               torch.nn.GELU(), torch.nn.Linear(96, 32)).to(device)


def check_mixed_model_under_autocast(device, dtype):
    model = mixed_model(device)
    x = torch.randn(4, 16, 64, device=device, requires_grad=True)
    captured = {}
    model[2].register_forward_hook(lambda m, inputs, out: captured.update(x=inputs[0], y=out))
    with torch.autocast(device, dtype=dtype):
        y = model(x)
        loss = y.float().square().mean()
    loss.backward()
    layer = model[2]
    # the NVFP4 layer sees the previous layer's autocast output and returns the autocast dtype
    assert captured["x"].dtype == dtype and captured["y"].dtype == dtype and y.dtype == dtype
    # fp32 master weights get fp32 gradients; the input gets its own dtype's gradient
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()
    assert x.grad.dtype == torch.float32
    # the layer's outputs and gradients match the NVFP4 emulation of its quantized operands
    x2d = captured["x"].detach().reshape(-1, 128)
    dy = torch.randn(64, 96, device=device, dtype=dtype)
    x_in = x2d.clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    with torch.autocast(device, dtype=dtype):
        y2 = layer(x_in)
    y2.backward(dy)
    ey, edx, edw, edb = emulate(layer, x2d, dy)
    assert rel(y2, ey) < 2e-2 and rel(x_in.grad, edx) < 2e-2 and rel(layer.weight.grad, edw) < 2e-2
    assert rel(layer.bias.grad, edb) < 2e-2
    # and stay close to what the same layer gives in high precision
    reference = torch.nn.Linear(128, 96, device=device)
    reference.load_state_dict(layer.state_dict())
    with torch.autocast(device, dtype=dtype):
        assert rel(y2, reference(x2d)) < 0.2


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_mixed_model_under_cpu_autocast(dtype):
    check_mixed_model_under_autocast(DEVICE, dtype)


def check_grouped_linear_under_autocast(device, dtype):
    """fp32 expert weights (stacked, 16x16 blocks, quantized from their fp32 values) and fp32 tokens under
    autocast: the tokens are cast, Y comes out in the autocast dtype, the gradients in the parameters' and the
    input's own dtypes."""
    torch.manual_seed(3)
    layer = fp4gen.nn.GroupedLinear(3, 64, 128, bias=True).to(device)
    x = torch.randn(40, 64, device=device, requires_grad=True)
    offsets = torch.tensor([16, 16, 40], device=device)
    with torch.autocast(device, dtype=dtype):
        y = layer(x, offsets)
    assert y.dtype == dtype
    y.float().square().mean().backward()
    for grad in (layer.weight.grad, layer.bias.grad, x.grad):
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.any()
    # fprop: the cast tokens (row-scaled) times the stacked weight's fp32 quantization, plus the rounded bias
    xq = fp4gen.quantize_grouped(x.detach().to(dtype), offsets, scaling="row", columnwise=False)
    wq = fp4gen.quantize_grouped(layer.weight.detach(), None, scaling="tensor", block=(16, 16), columnwise=False)
    expected = fp4gen.grouped_gemm(xq.rowwise, wq.rowwise, offsets, out_dtype=torch.float32)
    bias = layer.bias.detach().to(dtype).float().repeat_interleave(torch.tensor([16, 0, 24], device=device), 0)
    assert rel(y.float(), expected + bias) < 1e-2


def test_grouped_linear_under_cpu_autocast():
    check_grouped_linear_under_autocast(DEVICE, torch.bfloat16)


def test_weight_is_quantized_from_its_fp32_values():
    torch.manual_seed(1)
    layer = fp4gen.nn.Linear(64, 32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        layer(torch.randn(16, 64))
    qw = fp4gen.quantize(layer.weight.detach(), scaling="tensor", block=(16, 16))
    assert torch.equal(layer._weight_cache[1][0], qw.rowwise.data)
    assert torch.equal(layer._weight_cache[1][2], qw.rowwise.amax)  # the fp32 amax, not a bf16 rounding


def test_fp32_master_weights_train_under_autocast():
    torch.manual_seed(2)
    model = torch.nn.Sequential(fp4gen.nn.Linear(64, 64), torch.nn.GELU(), fp4gen.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, target = torch.randn(64, 64), torch.randn(64, 16)
    losses = []
    for _ in range(30):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = (model(x).float() - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0]


def test_outside_autocast_input_and_weight_must_agree():
    layer = fp4gen.nn.Linear(32, 16)
    with pytest.raises(TypeError, match="differs from the layer's parameters"):
        layer(torch.randn(16, 32, dtype=torch.bfloat16))
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=False):
        with pytest.raises(TypeError, match="torch.autocast"):
            layer(torch.randn(16, 32, dtype=torch.bfloat16))


def test_autocast_leaves_float64_inputs_alone_like_torch():
    layer = fp4gen.nn.Linear(32, 16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), pytest.raises(TypeError, match="float64"):
        layer(torch.randn(16, 32, dtype=torch.float64))


def test_bf16_parameters_under_autocast_need_no_cast():
    layer = fp4gen.nn.Linear(32, 16, dtype=torch.bfloat16)
    x = torch.randn(16, 32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, layer(x.to(torch.bfloat16)))


def test_device_types_without_autocast_still_run():
    # meta tensors (deferred initialization, shape inference) have no autocast state to ask about
    layer = fp4gen.nn.Linear(32, 16, device="meta")
    with torch.no_grad():
        assert layer(torch.randn(16, 32, device="meta")).shape == (16, 16)
