"""The checks of tests/test_input_layouts.py (empty batches, input layouts) on CUDA, where from the second call on
a bf16 or fp32 Linear step runs through the C++ launcher, chosen by the input's row stride and alignment."""
import pytest
import torch

import fp4gen

from test_input_layouts import (RECIPES, check_a_gemm_over_an_empty_sum, check_an_empty_batch,
                                check_grouped_input_layout, check_linear_3d_views, check_linear_input_layout,
                                layout_pairs)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_layout,dy_layout", layout_pairs())
def test_linear_takes_any_input_layout_on_gpu(x_layout, dy_layout, recipe):
    check_linear_input_layout(x_layout, dy_layout, recipe, "cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("x_layout,dy_layout", [("column slice", "transposed"), ("unaligned start", "broadcast row")])
def test_linear_takes_any_input_layout_in_other_dtypes_on_gpu(x_layout, dy_layout, dtype):
    check_linear_input_layout(x_layout, dy_layout, "default", "cuda", dtype)


def test_linear_takes_a_transposed_3d_input_on_gpu():
    check_linear_3d_views("cuda")


@pytest.mark.parametrize("x_layout,dy_layout", layout_pairs())
def test_grouped_linear_takes_any_input_layout_on_gpu(x_layout, dy_layout):
    check_grouped_input_layout(x_layout, dy_layout, "cuda")


@pytest.mark.parametrize("grouped", [False, True], ids=["quantize", "quantize_grouped"])
def test_quantize_refuses_overlapping_rows_with_a_clear_error(grouped):
    # the functional API reads x in place or says why not (the layers copy instead)
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16).expand(32, 64)
    call = (lambda: fp4gen.quantize_grouped(x, torch.tensor([32], device="cuda"))) if grouped else \
        (lambda: fp4gen.quantize(x))
    with pytest.raises(ValueError, match=r"strides \(0, 1\).*do not overlap"):
        call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_an_empty_batch_gives_empty_outputs_and_zero_gradients_on_gpu(grouped, main_grad, dtype):
    check_an_empty_batch(grouped, "cuda", main_grad, dtype)


def test_a_gemm_over_an_empty_sum_is_its_epilogue_on_gpu():
    check_a_gemm_over_an_empty_sum("cuda")
