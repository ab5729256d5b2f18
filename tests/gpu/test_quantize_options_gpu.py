"""Recipe options on CUDA tensors: the reference backend runs them on the GPU with the same bytes as on the
CPU (random bits keyed by the state, not by the device), and the CUDA backend names the options it has no
kernel for instead of ignoring them."""
import pytest
import torch

import fp4gen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kwargs", [dict(rounding="stochastic"), dict(hadamard=True), dict(four_over_six="mae")])
def test_reference_backend_on_the_gpu_equals_the_cpu(kwargs):
    x = torch.randn(64, 128)
    extra = {"rng": fp4gen.RNGState(11, device="cuda")} if "rounding" in kwargs else {}
    gpu = fp4gen.quantize(x.cuda(), "row", backend="reference", **kwargs, **extra)
    extra = {"rng": fp4gen.RNGState(11)} if "rounding" in kwargs else {}
    cpu = fp4gen.quantize(x, "row", **kwargs, **extra)
    for copy in ("rowwise", "columnwise"):
        a, b = getattr(gpu, copy), getattr(cpu, copy)
        assert torch.equal(a.data.cpu(), b.data) and torch.equal(a.scale.view(torch.uint8).cpu(), b.scale.view(torch.uint8))
        assert torch.equal(a.amax.cpu(), b.amax) and a.e4m3_max == b.e4m3_max


@pytest.mark.parametrize("kwargs,named", [(dict(rounding="stochastic"), "rounding=stochastic"),
                                          (dict(hadamard=True), "hadamard=rht16"),
                                          (dict(four_over_six="mse"), "four_over_six=mse")])
def test_cuda_backend_names_options_without_kernels(kwargs, named):
    with pytest.raises(fp4gen.BuildError, match=named):
        fp4gen.quantize(torch.randn(64, 128, device="cuda"), "row", **kwargs)


def test_four_over_six_operands_on_the_cuda_gemm_and_dequantize():
    x = torch.randn(128, 256, device="cuda")
    a = fp4gen.quantize(x, "row", four_over_six="mae", backend="reference").rowwise
    b = fp4gen.quantize(torch.randn(64, 256, device="cuda"), "tensor", columnwise=False).rowwise
    d = fp4gen.gemm(a, b, out_dtype=torch.float32)  # the epilogue's alpha uses each operand's 6 * e4m3_max
    ref = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="reference")
    assert ((d - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(fp4gen.BuildError, match="e4m3_max=256"):  # the kernels decode with 6 * 448
        fp4gen.dequantize(a, torch.bfloat16)
