"""The reference backend reproduces TransformerEngine's golden vectors byte for byte."""
import numpy as np
import pytest
import torch

import fp4gen
from conftest import golden_cases, load_golden


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy() if t.dtype != torch.float32 else t.numpy().view(np.uint32)


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_quantize_matches_golden_bytes(case):
    x, z = load_golden(case)
    q = fp4gen.quantize(x, scaling=case["scaling"], block=tuple(case["block"]), rowwise=case["rowwise"],
                        columnwise=case["columnwise"], hadamard=case["rht"], backend="reference")
    for direction, suffix in (("rowwise", ""), ("columnwise", "_t")):
        operand = getattr(q, direction)
        if not case[direction]:
            assert operand is None
            continue
        np.testing.assert_array_equal(_bytes(operand.data), z["data" + suffix])
        np.testing.assert_array_equal(_bytes(operand.scale), z["scale" + suffix])
        np.testing.assert_array_equal(_bytes(operand.amax), z["amax" + suffix].view(np.uint32))


@pytest.mark.parametrize("case", [c for c in golden_cases() if c["columnwise"]], ids=lambda c: c["name"])
def test_columnwise_only_equals_columnwise_half(case):
    x, z = load_golden(case)
    q = fp4gen.quantize(x, scaling=case["scaling"], block=tuple(case["block"]), rowwise=False,
                        columnwise=True, hadamard=case["rht"], backend="reference")
    assert q.rowwise is None
    np.testing.assert_array_equal(q.columnwise.data.numpy(), z["data_t"])
    np.testing.assert_array_equal(q.columnwise.scale.view(torch.uint8).numpy(), z["scale_t"])
