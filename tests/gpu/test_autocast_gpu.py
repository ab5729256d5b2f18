"""fp4gen.nn.Linear and fp4gen.nn.GroupedLinear under CUDA autocast (bf16 and fp16) with fp32 parameters: the CPU
checks of tests/test_autocast.py on the GPU kernels."""
import pytest
import torch

import fp4gen
from test_autocast import check_grouped_linear_under_autocast, check_mixed_model_under_autocast

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_model_under_cuda_autocast(dtype):
    check_mixed_model_under_autocast("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_linear_under_cuda_autocast(dtype):
    check_grouped_linear_under_autocast("cuda", dtype)


def test_converted_model_trains_under_cuda_autocast():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before the conversion: the same parameters
    report = fp4gen.convert(model, skip=["4"])
    assert report.converted == ["0", "2"] and isinstance(model[0], fp4gen.nn.Linear)
    x, target = torch.randn(256, 256, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    losses = []
    for _ in range(40):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0]
