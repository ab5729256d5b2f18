"""The checks of tests/test_layer_reuse.py (a layer called twice before one backward, activation checkpointing) on
CUDA, where a bf16 or fp32 Linear's calls from the second on run as the C++ launcher's steps, each with its own
autograd node and saved tensors."""
import pytest
import torch

from test_layer_reuse import RECIPES, check_activation_checkpointing, check_two_calls_before_one_backward

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_two_calls_before_one_backward_on_gpu(grouped, recipe, dtype):
    check_two_calls_before_one_backward(grouped, recipe, "cuda", dtype)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_activation_checkpointing_on_gpu(grouped, recipe, reentrant):
    check_activation_checkpointing(grouped, recipe, reentrant, "cuda")
