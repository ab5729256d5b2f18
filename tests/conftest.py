import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codegen.toolchain import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(__file__).parent / "golden"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def group_ends(sizes) -> list:
    """Cumulative group ends (grouped operations' offsets) of a list of group sizes."""
    ends, total = [], 0
    for size in sizes:
        total += size
        ends.append(total)
    return ends


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """A quantized copy's field as bit patterns, for byte-for-byte comparisons between backends: codes and scales as
    bytes; fp32 amaxes as int32 with every NaN as one pattern (the definition makes an amax NaN, not its payload: the
    plain amax pass gives bf16's 0x7FFF, PyTorch 0x7FC0)."""
    if t.dtype != torch.float32:
        return t.view(torch.uint8)
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius-norm relative error of got against want, in float64 on the CPU."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def dequantize_f64(op) -> torch.Tensor:
    """An independent float64 decode of an NVFP4Data: e2m1 * block scale * amax / (6 * e4m3_max)."""
    lut = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=torch.float64, device=op.data.device)
    rows = op.data.shape[0]
    codes = torch.stack((op.data & 0xF, op.data >> 4), -1).reshape(rows, -1).long()
    values = lut[codes].reshape(rows, -1, 16) * op.scale.double().unsqueeze(-1)
    return values.reshape(rows, -1) * op.amax.double().reshape(-1, 1) / (6 * op.e4m3_max)


def run_check_program(tmp_path: Path, program: str, timeout: int, device_arch: str | None = None) -> list:
    """Builds tests/cuda/<program>.cu with the kernels' headers, runs it and returns its output lines; fails where
    it exits nonzero. It needs nvcc, found as build.py finds it (which raises with a hint where there is none).
    Without device_arch the program runs the headers' __host__ __device__ helpers on the CPU and needs no GPU;
    with one (say "sm_90a") its kernels are built for that GPU, which must be present."""
    exe = tmp_path / program
    arch = [f"-arch={device_arch}"] if device_arch else []
    subprocess.run([find_nvcc(), "-std=c++17", "-O2", "--expt-relaxed-constexpr", *arch,
                    f"-I{ROOT / 'templates' / 'include'}", str(ROOT / "tests" / "cuda" / f"{program}.cu"),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()


def run_without_host_sync(fn) -> None:
    """Runs fn() once warm (a first call, which may load kernels or create state), then again with PyTorch's
    sync debug mode set to raise on any synchronizing operation."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def golden_cases():
    """Every golden case; `rht` cases quantize their columnwise copy with hadamard=True."""
    return json.loads((GOLDEN_DIR / "index.json").read_text())


def load_golden(case):
    z = np.load(GOLDEN_DIR / f"{case['name']}.npz")
    x = torch.from_numpy(z["x_f32"]).to(DTYPES[case["dtype"]])
    return x, z


def copy_project(dest: Path) -> Path:
    """The parts of the checkout build.py works on (specs, templates, generated/, build.py) in `dest`, so a
    test can edit them and run build.py without touching the real checkout."""
    for part in ("codegen", "templates", "generated"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "build.py", dest / "build.py")
    return dest


def run_build_py(project: Path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(project / "build.py"), *args], capture_output=True, text=True,
                          env=env)


def load_build_py(project: Path = ROOT):
    """build.py of `project` imported as a module (named fp4gen_build_py, so it never shadows a `build` package),
    to call its functions without running it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp4gen_build_py", project / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    config.addinivalue_line("markers", "nvcc: compiles the checkout's sources with the real nvcc (slow)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
