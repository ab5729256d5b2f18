"""Kernels on a non-current device: every launch takes its device from the tensors, not from device 0.
Runs where at least two CUDA devices are present (skipped otherwise)."""
import pytest
import torch

import fp4gen

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def same_operand(p, q):
    return (torch.equal(p.data.cpu(), q.data.cpu()) and torch.equal(p.scale.view(torch.uint8).cpu(),
                                                                     q.scale.view(torch.uint8).cpu())
            and torch.equal(p.amax.cpu(), q.amax.cpu()))


@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
@pytest.mark.parametrize("scaling,block", [("row", (1, 16)), ("tensor", (1, 16)), ("tensor", (16, 16))])
def test_quantize_dequantize_gemm_on_the_other_device(current, target, scaling, block):
    torch.manual_seed(0)
    x_cpu = torch.randn(1040, 528).bfloat16()
    w_cpu = torch.randn(272, 528).bfloat16()
    results = {}
    for dev in (current, target):
        with torch.cuda.device(current):  # the current device stays `current` while tensors live on `dev`
            x, w = x_cpu.to(f"cuda:{dev}"), w_cpu.to(f"cuda:{dev}")
            q = fp4gen.quantize(x, scaling=scaling, block=block)
            qw = fp4gen.quantize(w, scaling="tensor", block=(16, 16))
            y = fp4gen.dequantize(q.rowwise, torch.float32)
            d = fp4gen.gemm(q.rowwise, qw.rowwise, out_dtype=torch.float32)
            assert torch.cuda.current_device() == current
            assert q.rowwise.data.device == y.device == d.device == torch.device(f"cuda:{dev}")
            torch.cuda.synchronize(dev)
            results[dev] = (q, y, d)
    (q0, y0, d0), (q1, y1, d1) = results[current], results[target]
    assert same_operand(q0.rowwise, q1.rowwise) and same_operand(q0.columnwise, q1.columnwise)
    assert torch.equal(y0.cpu(), y1.cpu())
    assert torch.equal(d0.cpu(), d1.cpu())


# (M, K) that select each Hopper GEMM kernel: the fused tiles by M (K a multiple of 64), then the 64-row
# wgmma tile (K = 48 rules the fused kernels out) and the 128-row one
GEMM_PROBLEMS = [(16, 256), (32, 256), (64, 256), (128, 1024), (16, 48), (1040, 528)]


@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_every_gemm_variant_on_the_other_device(current, target):
    from fp4gen.cuda.manifest import load_manifest
    from fp4gen.cuda.ops import gemm_kernel
    chosen = set()
    for out_dtype in (torch.bfloat16, torch.float32):
        for m, k in GEMM_PROBLEMS:
            torch.manual_seed(m + k)
            x_cpu, w_cpu = torch.randn(m, k).bfloat16(), torch.randn(600, k).bfloat16()
            results = {}
            for dev in (current, target):
                with torch.cuda.device(current):
                    a = fp4gen.quantize(x_cpu.to(f"cuda:{dev}"), scaling="row", columnwise=False).rowwise
                    b = fp4gen.quantize(w_cpu.to(f"cuda:{dev}"), scaling="tensor", columnwise=False).rowwise
                    chosen.add(gemm_kernel(a, b, out_dtype).name)
                    out = torch.full((m, 600), float("nan"), device=f"cuda:{dev}", dtype=out_dtype)
                    fp4gen.gemm(a, b, out=out, accumulate=False)
                    torch.cuda.synchronize(dev)
                    assert torch.cuda.current_device() == current
                    results[dev] = out.cpu()
            assert not torch.isnan(results[target]).any()
            assert torch.equal(results[current], results[target]), (m, k, out_dtype)
    declared = {name for name, k in load_manifest()["kernels"].items() if k["op"] == "gemm" and k["arch"] == "sm90a"}
    assert chosen == declared


@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_grouped_linear_step_on_the_other_device(current, target):
    """quantize_grouped, the three grouped GEMMs and their prepasses through a GroupedLinear step, with the
    tensors on `target` while `current` stays the current device: the same results as on `current`."""
    torch.manual_seed(0)
    x_cpu = torch.randn(200, 128).bfloat16()
    dy_cpu = torch.randn(200, 64).bfloat16()
    ends = [30, 30, 150, 200]
    results = {}
    for dev in (current, target):
        with torch.cuda.device(current):
            torch.manual_seed(1)
            layer = fp4gen.nn.GroupedLinear(4, 128, 64, bias=True, device=f"cuda:{dev}", dtype=torch.bfloat16)
            x = x_cpu.to(f"cuda:{dev}").requires_grad_(True)
            y = layer(x, torch.tensor(ends, device=f"cuda:{dev}"))
            y.backward(dy_cpu.to(f"cuda:{dev}"))
            assert torch.cuda.current_device() == current and y.device == torch.device(f"cuda:{dev}")
            torch.cuda.synchronize(dev)
            results[dev] = (y.cpu(), x.grad.cpu(), layer.weight.grad.cpu())
    for a, b in zip(results[current], results[target]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_linear_steps_on_the_other_device(current, target):
    """fp4gen.nn.Linear's steps with the layer on `target` while `current` stays the current device: the first step
    makes the separate calls, the next ones run as the C++ launcher's LinearStep (its backward from autograd's
    node); the same results as on `current`, step by step."""
    torch.manual_seed(0)
    xs = [torch.randn(64, 128).bfloat16() for _ in range(3)]
    dys = [torch.randn(64, 96).bfloat16() for _ in range(3)]
    results = {}
    for dev in (current, target):
        with torch.cuda.device(current):
            torch.manual_seed(1)
            layer = fp4gen.nn.Linear(128, 96, device=f"cuda:{dev}", dtype=torch.bfloat16,
                                     recipe=fp4gen.Recipe(stochastic_rounding=True))
            fp4gen.RNGState.default(f"cuda:{dev}").reset(7)
            results[dev] = []
            for x_cpu, dy_cpu in zip(xs, dys):
                layer.zero_grad(set_to_none=True)
                x = x_cpu.to(f"cuda:{dev}").requires_grad_(True)
                y = layer(x)
                y.backward(dy_cpu.to(f"cuda:{dev}"))
                assert torch.cuda.current_device() == current and y.device == torch.device(f"cuda:{dev}")
                torch.cuda.synchronize(dev)
                results[dev] += [y.cpu(), x.grad.cpu(), layer.weight.grad.cpu(), layer.bias.grad.cpu()]
            results[dev].append(fp4gen.RNGState.default(f"cuda:{dev}").tensor.cpu())
    for a, b in zip(results[current], results[target]):
        assert torch.equal(a, b)
