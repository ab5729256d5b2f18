"""The sm_90a software E2M1 encode, checked on the CPU: tests/cuda/e2m1_exhaustive.cu runs the very helpers
the kernels run (they are __host__ __device__) over every fp32 bit pattern, random packed words, and the
fast encode over every bf16 and fp16 element for thousands of inverse scales, against E2M1_RN written out
from the spec. It needs nvcc (as build.py does), not a GPU."""
import subprocess

from codegen.toolchain import find_nvcc
from conftest import ROOT


def test_software_e2m1_encode_is_exact(tmp_path):
    nvcc = find_nvcc()  # as build.py finds it; raises with a hint where there is none
    exe = tmp_path / "e2m1_exhaustive"
    subprocess.run([nvcc, "-std=c++17", "-O2", "--expt-relaxed-constexpr", f"-I{ROOT / 'templates' / 'include'}",
                    str(ROOT / "tests" / "cuda" / "e2m1_exhaustive.cu"), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=1200)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len([line for line in lines if " 0 mismatch" in line]) == 4, run.stdout
