"""Arithmetic shortcuts of the kernels against the operations they replace, for every float in their range, on
the GPU (programs in tests/cuda/, built with nvcc for the device at hand): the branch-free reciprocal of the
sm_90a quantize kernels' block scales (reciprocal_rn_in_range in nvfp4.cuh) against __frcp_rn, the
division in 4over6's error (divide_by_four_over_six_numerator in four_over_six.cuh) against __fdiv_rn, and the
stochastic E2M1 step (encode_codes_stochastic in stochastic.cuh) against the rule with its division, for every
random byte too."""
import pytest
import torch

from conftest import run_check_program

pytestmark = pytest.mark.gpu


def _run(tmp_path, program: str) -> str:
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
    return "\n".join(run_check_program(tmp_path, program, timeout=300, device_arch=arch))


def test_block_scale_reciprocal_matches_frcp_rn(tmp_path):
    out = _run(tmp_path, "reciprocal_exhaustive")
    assert len([line for line in out.splitlines() if ": 0 mismatches" in line]) == 2, out


def test_four_over_six_error_division_matches_fdiv_rn(tmp_path):
    out = _run(tmp_path, "four_over_six_division_exhaustive")
    assert len([line for line in out.splitlines() if ": 0 mismatches" in line]) == 1, out


def test_stochastic_code_matches_the_rule(tmp_path):
    out = _run(tmp_path, "stochastic_code_exhaustive")
    assert len([line for line in out.splitlines() if ": 0 mismatches" in line]) == 1, out
