"""The branch-free reciprocal of the sm_90a quantize kernels' block scales (reciprocal_rn_in_range in
nvfp4.cuh) against __frcp_rn for every float in its range, on the GPU: tests/cuda/reciprocal_exhaustive.cu,
built with nvcc for the device at hand."""
import subprocess

import pytest
import torch

from codegen.toolchain import find_nvcc
from conftest import ROOT

pytestmark = pytest.mark.gpu


def test_block_scale_reciprocal_matches_frcp_rn(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
    exe = tmp_path / "reciprocal_exhaustive"
    subprocess.run([find_nvcc(), "-std=c++17", "-O3", "--expt-relaxed-constexpr", f"-arch={arch}",
                    f"-I{ROOT / 'templates' / 'include'}", str(ROOT / "tests" / "cuda" / "reciprocal_exhaustive.cu"),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len([line for line in run.stdout.splitlines() if ": 0 mismatches" in line]) == 2, run.stdout
