"""Training after a pass under torch.inference_mode on a CUDA device (the C++ launcher's inference and training
steps on the sm_90a kernels): the same checks as on CPU."""
import pytest

from test_inference_mode import (check_grouped_linear_training_after_an_inference_pass,
                                 check_linear_training_after_an_inference_pass,
                                 check_random_states_made_in_inference_mode_advance_outside_it)
from test_linear import RECIPES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_linear_trains_after_an_inference_pass_on_gpu(recipe):
    check_linear_training_after_an_inference_pass(recipe, "cuda")


def test_grouped_linear_trains_after_an_inference_pass_on_gpu():
    check_grouped_linear_training_after_an_inference_pass("cuda")


def test_random_states_made_in_inference_mode_advance_outside_it_on_gpu():
    check_random_states_made_in_inference_mode_advance_outside_it("cuda")
