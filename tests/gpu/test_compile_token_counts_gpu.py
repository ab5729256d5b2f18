"""tests/test_compile_token_counts.py's check on CUDA with inductor: the compiled steps' kernels are the custom
ops' (fp4gen's plans per token count), the eager ones the launcher's steps from the second call on."""
import pytest

from test_compile_token_counts import check_compiled_steps_over_token_counts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_compiled_steps_over_changing_token_counts_on_gpu(grouped):
    check_compiled_steps_over_token_counts(grouped, "cuda", "inductor")
