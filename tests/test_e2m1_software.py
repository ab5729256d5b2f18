"""The sm_90a software E2M1 encode, checked on the CPU: tests/cuda/e2m1_exhaustive.cu runs the very helpers
the kernels run (they are __host__ __device__) over every fp32 bit pattern, random packed words, and the
fast encode over every bf16 and fp16 element for thousands of inverse scales, against E2M1_RN written out
from the spec. It needs nvcc (as build.py does), not a GPU."""
import pytest
from conftest import run_check_program


@pytest.mark.nvcc
def test_software_e2m1_encode_is_exact(tmp_path):
    lines = run_check_program(tmp_path, "e2m1_exhaustive", timeout=1200)
    assert len([line for line in lines if " 0 mismatch" in line]) == 4, "\n".join(lines)
