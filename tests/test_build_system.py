"""build.py's compiler side without compiling: ninja text, cache keys, missing-tool messages."""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import ninja as ninja_module
from codegen import tables
from codegen import toolchain as toolchain_module
from codegen.ninja import CompileJob, build_seconds, write_ninja
from codegen.toolchain import Toolchain, ToolchainError, cache_key
from conftest import copy_project, load_build_py, run_build_py

BUILD = load_build_py()

TOOLCHAIN = Toolchain("/opt/cuda/bin/nvcc", "Build cuda_13.0", Path("/cutlass/include"), "4.2.0.0",
                      Path("/repo/templates/include"))


def test_flags_name_the_arch_target():
    assert "-gencode=arch=compute_90a,code=sm_90a" in TOOLCHAIN.flags("sm90a")
    assert "-gencode=arch=compute_100a,code=sm_100a" in TOOLCHAIN.flags("sm100a")
    assert TOOLCHAIN.include_flags() == ["-I/repo/templates/include", "-I/cutlass/include"]


def test_ninja_file_lists_each_job_with_its_flags(tmp_path):
    jobs = [CompileJob(f"k_{arch}", arch, tmp_path / f"k_{arch}.cu", tmp_path / "cache" / f"k_{arch}.abc", tuple(TOOLCHAIN.flags(arch)))
            for arch in tables.ARCHS]
    write_ninja(tmp_path / "build.ninja", TOOLCHAIN.nvcc, TOOLCHAIN.include_flags(), jobs, tmp_path / "tmp")
    text = (tmp_path / "build.ninja").read_text()
    for job in jobs:
        assert f"build {job.library}: nvcc {job.source}" in text
    assert "compute_90a,code=sm_90a" in text and "compute_100a,code=sm_100a" in text
    assert "mv -T $tmp $entry" in text  # published by rename only once nvcc succeeded


def test_cache_key_covers_source_headers_flags_and_tool_versions():
    headers = {"fp4gen/abi.h": "1" * 64}
    base = cache_key("src", "sm90a", TOOLCHAIN, headers)
    assert base == cache_key("src", "sm90a", TOOLCHAIN, dict(headers))
    variants = [
        cache_key("src2", "sm90a", TOOLCHAIN, headers),
        cache_key("src", "sm100a", TOOLCHAIN, headers),
        cache_key("src", "sm90a", TOOLCHAIN, {"fp4gen/abi.h": "2" * 64}),
        cache_key("src", "sm90a", Toolchain(TOOLCHAIN.nvcc, "Build cuda_13.1", TOOLCHAIN.cutlass_include,
                                            TOOLCHAIN.cutlass_version, TOOLCHAIN.fp4gen_include), headers),
        cache_key("src", "sm90a", Toolchain(TOOLCHAIN.nvcc, TOOLCHAIN.nvcc_version, TOOLCHAIN.cutlass_include,
                                            "4.3.0.0", TOOLCHAIN.fp4gen_include), headers),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    # where the tools are installed is not part of the key: the same inputs elsewhere hit the cache
    moved = Toolchain("/usr/local/cuda/bin/nvcc", TOOLCHAIN.nvcc_version, Path("/venv/cutlass"),
                      TOOLCHAIN.cutlass_version, Path("/other/templates/include"))
    assert cache_key("src", "sm90a", moved, headers) == base


def test_build_seconds_reads_ninja_log(tmp_path):
    (tmp_path / ".ninja_log").write_text("# ninja log v5\n100\t2600\t0\t/c/k.so\tabc\n")
    assert build_seconds(tmp_path) == {"/c/k.so": 2.5}


def _run_build(project, env_changes):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env.update(env_changes)
    return run_build_py(project, env=env)


def test_missing_nvcc_is_a_clear_message(tmp_path):
    result = _run_build(copy_project(tmp_path), {"PATH": str(Path(sys.executable).parent)})
    assert shutil.which("nvcc", path=str(Path(sys.executable).parent)) is None
    assert result.returncode == 2 and "nvcc not found" in result.stderr and "CUDA_HOME" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_cuda_home_is_a_clear_message(tmp_path):
    result = _run_build(copy_project(tmp_path), {"CUDA_HOME": str(tmp_path / "nowhere")})
    assert result.returncode == 2 and "CUDA_HOME=" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to get past the nvcc check")
def test_missing_cutlass_headers_is_a_clear_message(tmp_path):
    result = _run_build(copy_project(tmp_path), {"FP4GEN_CUTLASS_DIR": str(tmp_path / "nowhere")})
    assert result.returncode == 2 and "FP4GEN_CUTLASS_DIR" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc and the CUTLASS headers to compile")
def test_a_gemm_variant_from_a_temporary_spec_compiles(tmp_path):
    # The whole path a user takes to add a tile: a YAML file, then build.py. No Python or template edit. The tile
    # (32 rows, which the rs_tile rule accepts and no shipped spec declares) is of the fused register-source family,
    # whose kernels compile in about 12 s on 2 cores against about 2 minutes for a CUTLASS one.
    project = copy_project(tmp_path / "project")
    (project / "codegen/specs/gemm_extra.yaml").write_text(
        "family: gemm_packed_rs\naxes: {out_dtype: [bf16], rs_tile: [32x128x64], arch: [sm90a]}\n")
    env = dict(os.environ, FP4GEN_CACHE_DIR=str(tmp_path / "cache"), FP4GEN_LIB_DIR=str(tmp_path / "lib"))
    name = "gemm_nvfp4_packedrs_bf16out_t32x128x64_sm90a"
    result = run_build_py(project, "--filter", "t32x128x64", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert name in result.stdout and "1 built" in result.stdout, result.stdout
    library = ctypes.CDLL(str(tmp_path / "lib" / f"{name}.so"))
    assert library.fp4gen_abi_version() == 2
    for entry in ("run", "run_packed", "can_implement", "workspace_size"):
        assert hasattr(library, f"{name}_{entry}"), entry


# --- build.py's options, lib dir and missing-dependency messages (no compile) ---

FIX = ('pip install -e ".[build]" (or pip install ".[build]") in the fp4gen checkout, or '
       'pip install jinja2 pyyaml ninja nvidia-cutlass==4.2.0.0')


def test_a_bad_filter_regex_is_refused_without_a_traceback(tmp_path):
    result = run_build_py(copy_project(tmp_path), "--filter", "(")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--filter '(' is not a valid regular expression: missing ), unterminated subpattern" in result.stderr


@pytest.mark.parametrize("capabilities,archs", [
    ([(9, 0)], ["sm90a"]),
    ([(10, 0)], ["sm100a"]),
    ([(10, 0), (9, 0), (9, 0)], ["sm90a", "sm100a"]),  # two GPUs of different archs: both
    ([], list(tables.ARCHS)),  # no GPU visible (CPU machines, CI): every arch
])
def test_default_archs_are_those_of_the_visible_gpus(capabilities, archs):
    chosen, line = BUILD.default_archs(capabilities)
    assert chosen == archs
    assert ("no CUDA GPU visible: building every arch" in line) == (not capabilities)
    if capabilities:
        assert line.startswith(f"building {', '.join(archs)}, the arch") and "--arch all builds every arch" in line


def test_a_gpu_of_no_fp4gen_arch_is_an_error_naming_it():
    with pytest.raises(BUILD.ArchError) as info:
        BUILD.default_archs([(8, 0)])
    message = str(info.value)
    assert "compute capability 8.0" in message and "sm90a" in message and "sm100a" in message
    assert "--arch all" in message and "\n" not in message
    # next to a GPU that has an arch, it is skipped and named
    chosen, line = BUILD.default_archs([(8, 0), (9, 0)])
    assert chosen == ["sm90a"] and "skipping GPUs of compute capability 8.0" in line


@pytest.mark.parametrize("value,archs", [("all", list(tables.ARCHS)), ("sm100a,sm90a", ["sm90a", "sm100a"]),
                                         ("sm90a", ["sm90a"]), (None, None)])
def test_arch_option_takes_a_list_or_all(value, archs):
    assert BUILD.parse_args([] if value is None else ["--arch", value]).arch == archs


def test_an_unknown_arch_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        BUILD.parse_args(["--arch", "sm90a,sm80"])
    assert info.value.code == 2 and "--arch sm80 is not a known arch" in capsys.readouterr().err


def test_without_a_gpu_every_arch_is_built_and_said(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env.update(PATH=str(Path(sys.executable).parent), CUDA_VISIBLE_DEVICES="")  # no GPU, and no nvcc: no compile
    result = run_build_py(copy_project(tmp_path), env=env)
    assert result.stdout.startswith(f"no CUDA GPU visible: building every arch ({', '.join(tables.ARCHS)})")
    assert result.returncode == 2 and "nvcc not found" in result.stderr


def test_lib_dir_is_the_env_var_else_lib_in_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4GEN_LIB_DIR", str(tmp_path / "libs"))
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    assert BUILD.lib_dir() == tmp_path / "libs"
    monkeypatch.delenv("FP4GEN_LIB_DIR")
    assert BUILD.lib_dir() == tmp_path / "cache" / "lib"
    monkeypatch.delenv("FP4GEN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert BUILD.lib_dir() == tmp_path / "home" / ".cache" / "fp4gen" / "lib"


def test_build_py_runs_from_any_directory(tmp_path):
    project = copy_project(tmp_path / "project")
    (tmp_path / "elsewhere").mkdir()
    for args in (["--list"], ["--check"]):
        result = subprocess.run([sys.executable, str(project / "build.py"), *args], capture_output=True, text=True,
                                cwd=tmp_path / "elsewhere")
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module,package", [("jinja2", "jinja2"), ("yaml", "pyyaml")])
def test_a_missing_build_dependency_is_one_line_with_the_fix(tmp_path, module, package):
    project = copy_project(tmp_path)
    hide = (f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = ['build.py', '--check']; "
            f"runpy.run_path({str(project / 'build.py')!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == f"error: build.py needs the Python package {package}, which is not installed: {FIX}\n"


def test_missing_ninja_and_cutlass_name_the_build_extra(monkeypatch):
    monkeypatch.setattr(ninja_module.shutil, "which", lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "ninja", None)
    with pytest.raises(ToolchainError, match=r"ninja not found: pip install -e \"\.\[build\]\""):
        ninja_module.ninja_executable()
    monkeypatch.delenv("FP4GEN_CUTLASS_DIR", raising=False)
    monkeypatch.setattr(toolchain_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ToolchainError) as info:
        toolchain_module.find_cutlass()
    assert str(info.value).startswith(f"CUTLASS headers not found: {FIX}") and "FP4GEN_CUTLASS_DIR" in str(info.value)
