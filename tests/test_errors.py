"""Bad input raises ValueError/TypeError whose message names the argument, the value and the rule."""
import pytest
import torch

import fp4gen


def _operand(rows=32, cols=64, row_scaled=False):
    x = torch.randn(rows, cols)
    return fp4gen.quantize(x, scaling="row" if row_scaled else "tensor", columnwise=False).rowwise


QUANTIZE_CASES = [
    (lambda: fp4gen.quantize(torch.zeros(16, 16, dtype=torch.int32)), TypeError, ["x.dtype", "int32", "bfloat16"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16, dtype=torch.float64)), TypeError, ["x.dtype", "float64"]),
    (lambda: fp4gen.quantize([[1.0] * 16]), TypeError, ["x must be a torch.Tensor"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 24)), ValueError, ["K", "24", "multiple of 16"]),
    (lambda: fp4gen.quantize(torch.zeros(24, 16)), ValueError, ["M = 24", "multiple of 16", "columnwise"]),
    (lambda: fp4gen.quantize(torch.zeros(24, 16), scaling="tensor", block=(16, 16), columnwise=False),
     ValueError, ["M = 24", "16x16"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), scaling="channel"), ValueError, ["scaling='channel'", "'row'"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), block=(1, 32)), ValueError, ["block=(1, 32)", "(1, 16)"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), block=16), TypeError, ["block", "16"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), block="1x16"), TypeError, ["block", "pair", "'1x16'"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), block=(1.0, 16.0)), TypeError, ["block", "(1.0, 16.0)"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), rowwise="no"), TypeError, ["rowwise='no'", "True or False"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), columnwise=1), TypeError, ["columnwise=1", "True or False"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), scaling="row", block=(16, 16)), ValueError,
     ["block=(16, 16)", "scaling='tensor'"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), rowwise=False, columnwise=False), ValueError, ["rowwise", "columnwise"]),
    (lambda: fp4gen.quantize(torch.tensor(1.0)), ValueError, ["0-d"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), backend="triton"), ValueError, ["backend='triton'", "reference"]),
    (lambda: fp4gen.quantize(torch.zeros(16, 16), backend="cuda"), ValueError, ["backend='cuda'", "cpu"]),
]

OPERAND_CASES = [
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), torch.ones(1)),
     TypeError, ["data.dtype", "float32", "uint8"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), torch.ones(1)),
     TypeError, ["scale.dtype", "uint8", "float8_e4m3fn", "view"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float8_e4m3fn), torch.ones(1)),
     ValueError, ["scale has shape (4, 2)", "[4, 1]"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), torch.ones(3)),
     ValueError, ["amax has shape (3,)", "[1]", "[4]"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), torch.ones(1, dtype=torch.float64)),
     TypeError, ["amax.dtype", "float64", "float32"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 12, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), torch.ones(1)),
     ValueError, ["24 columns", "multiple of 16"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(16, 4, dtype=torch.uint8).t(), torch.zeros(4, 2, dtype=torch.float8_e4m3fn), torch.ones(1)),
     ValueError, ["data has strides", "contiguous"]),
    (lambda: fp4gen.NVFP4Data(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn),
                              torch.ones(1, device="meta")), ValueError, ["amax is on meta", "data is on cpu"]),
]

GEMM_CASES = [
    (lambda: fp4gen.gemm(_operand(32, 64), _operand(16, 32)), ValueError, ["[32, 64]", "[16, 32]", "K must match"]),
    (lambda: fp4gen.gemm(_operand(), _operand(16, 64), out=torch.zeros(32, 15)), ValueError,
     ["out has shape (32, 15)", "[32, 16]"]),
    (lambda: fp4gen.gemm(_operand(), _operand(16, 64), out=torch.zeros(32, 16, dtype=torch.float16)), TypeError,
     ["out_dtype", "float16"]),
    (lambda: fp4gen.gemm(_operand(), _operand(16, 64), out=torch.zeros(32, 16), out_dtype=torch.bfloat16), TypeError,
     ["out.dtype is torch.float32", "bfloat16", "agree"]),
    (lambda: fp4gen.gemm(_operand(), _operand(16, 64), out_dtype=torch.float16), TypeError, ["out_dtype", "float16", "bfloat16"]),
    (lambda: fp4gen.gemm(_operand(), _operand(16, 64), accumulate=True), ValueError, ["accumulate=True", "out is None"]),
    (lambda: fp4gen.gemm(fp4gen.quantize(torch.randn(32, 64)), _operand(16, 64)), TypeError, ["a must be", "NVFP4Data", "rowwise"]),
    (lambda: fp4gen.gemm(_operand(), _operand(16, 64), out=torch.zeros(32, 16, device="meta")), ValueError,
     ["out is on meta", "cpu"]),
    (lambda: fp4gen.dequantize(_operand(), dtype=torch.int8), TypeError, ["dtype=torch.int8", "bfloat16"]),
    (lambda: fp4gen.dequantize(torch.zeros(4, 4)), TypeError, ["operand must be", "NVFP4Data"]),
]


def _meta_operand():
    return fp4gen.NVFP4Data(torch.zeros(16, 32, dtype=torch.uint8, device="meta"),
                            torch.zeros(16, 4, dtype=torch.float8_e4m3fn, device="meta"),
                            torch.ones(1, device="meta"))


GEMM_CASES.append((lambda: fp4gen.gemm(_operand(16, 64), _meta_operand()), ValueError,
                   ["a is on cpu", "b is on meta", "one device"]))


@pytest.mark.parametrize("call,error,fragments", QUANTIZE_CASES + OPERAND_CASES + GEMM_CASES)
def test_bad_input_raises_with_a_message_that_names_it(call, error, fragments):
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


def test_env_backend_override_is_validated(monkeypatch):
    monkeypatch.setenv("FP4GEN_BACKEND", "fast")
    with pytest.raises(ValueError, match="FP4GEN_BACKEND='fast'"):
        fp4gen.quantize(torch.zeros(16, 16))
    monkeypatch.setenv("FP4GEN_BACKEND", "reference")
    assert fp4gen.quantize(torch.zeros(16, 16)).rowwise is not None


MODULE_CASES = [
    (lambda: fp4gen.nn.Linear(32, 16, recipe={"row_scaled_activation": True}), TypeError,
     ["recipe must be an fp4gen.Recipe", "dict"]),
    (lambda: fp4gen.nn.Linear(32, 16, dtype=torch.float64), ValueError, ["dtype=torch.float64", "bfloat16"]),
    (lambda: fp4gen.nn.Linear(32, 16, dtype=torch.int8), ValueError, ["dtype=torch.int8"]),
    (lambda: fp4gen.nn.Linear(32, 16, accumulate_main_grad="yes"), TypeError, ["accumulate_main_grad", "'yes'"]),
    (lambda: fp4gen.Recipe(weight_block="16x16"), ValueError, ["weight_block='16x16'"]),
    (lambda: fp4gen.nn.Linear(32, 16).double()(torch.randn(16, 32, dtype=torch.float64)), TypeError,
     ["parameters are torch.float64"]),
    (lambda: fp4gen.nn.Linear(32, 16)(torch.randn(16, 32, dtype=torch.bfloat16)), TypeError,
     ["bfloat16", "float32", "torch.autocast"]),
]


@pytest.mark.parametrize("call,error,fragments", MODULE_CASES)
def test_bad_module_arguments_raise_at_construction_or_call(call, error, fragments):
    test_bad_input_raises_with_a_message_that_names_it(call, error, fragments)


def test_rowwise_and_columnwise_accept_bools():
    q = fp4gen.quantize(torch.randn(16, 32), rowwise=True, columnwise=False)
    assert q.rowwise is not None and q.columnwise is None
    assert fp4gen.quantize(torch.randn(16, 32), block=[1, 16]).block == (1, 16)
