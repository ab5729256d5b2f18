"""fp4gen.nn.Linear and GroupedLinear compiled with torch.compile over changing token counts, as variable-length
batches give: from the second count on, torch.compile traces the token dimension symbolically (automatic dynamic
shapes), through the layers' padding to 16-token blocks and their custom ops' fake implementations. Each count,
including one off the 16-token block and none at all, must give what the eager layer gives."""
import pytest
import torch
from torch._dynamo.utils import counters

import fp4gen
from conftest import group_ends

IN, OUT = 64, 128
TOKEN_COUNTS = (32, 48, 80, 17, 100, 0)


def check_compiled_steps_over_token_counts(grouped, device, backend):
    torch.manual_seed(13)
    torch._dynamo.reset()
    counters.clear()
    if grouped:
        layer = fp4gen.nn.GroupedLinear(3, IN, OUT, bias=True, device=device, dtype=torch.bfloat16)
    else:
        layer = fp4gen.nn.Linear(IN, OUT, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    for tokens in TOKEN_COUNTS:
        x = torch.randn(tokens, IN, device=device, dtype=torch.bfloat16)
        dy = torch.randn(tokens, OUT, device=device, dtype=torch.bfloat16)
        ends = group_ends([tokens // 3, tokens // 2 - tokens // 3, tokens - tokens // 2])
        extra = (torch.tensor(ends, device=device),) if grouped else ()
        results = []
        for run in (layer, compiled):
            layer.weight.grad = layer.bias.grad = None
            xg = x.clone().requires_grad_(True)
            y = run(xg, *extra)
            y.backward(dy)
            results.append((y, xg.grad, layer.weight.grad, layer.bias.grad))
        for got, want in zip(results[1], results[0]):
            assert torch.equal(got, want), tokens
    # fewer graphs than counts: the token dimension was traced symbolically, not one graph a count
    assert counters["stats"]["unique_graphs"] < len(TOKEN_COUNTS)


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_compiled_steps_over_changing_token_counts(grouped):
    check_compiled_steps_over_token_counts(grouped, "cpu", "aot_eager")
