"""Honest rebuilds: a kernel's cache key changes exactly when something that shapes that kernel changes.

The cache keys come from build.py's own plan_jobs (what cmd_build compiles from), on a copy of the project
with a fixed fake toolchain, so no nvcc is needed; one end-to-end test (marked nvcc) runs the real build.
"""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import tables
from codegen.render import MANIFEST, render_all
from codegen.toolchain import Toolchain
from conftest import copy_project, load_build_py

BUILD = load_build_py()
TOOLCHAIN = Toolchain("/opt/cuda/bin/nvcc", "Build cuda_13.0", Path("/cutlass/include"), "4.2.0.0",
                      Path("/repo/templates/include"))


def cache_keys(project: Path) -> dict:
    """kernel name -> cache key of every kernel the project's specs declare, for every arch."""
    files = render_all(project)
    manifest = json.loads(files[MANIFEST])["kernels"]
    # header digests are read from the copy's headers, so the fake toolchain points at them
    toolchain = dataclasses.replace(TOOLCHAIN, fp4gen_include=project / "templates" / "include")
    jobs = BUILD.plan_jobs(files, manifest, toolchain, list(tables.ARCHS), cache=Path("/cache"))
    assert len(jobs) == len(manifest)
    return {job.name: job.key for job in jobs}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


@pytest.fixture
def project(tmp_path):
    return copy_project(tmp_path / "project")


def test_plan_jobs_names_cache_entries_by_key_and_filters(project):
    files = render_all(project)
    manifest = json.loads(files[MANIFEST])["kernels"]
    toolchain = dataclasses.replace(TOOLCHAIN, fp4gen_include=project / "templates" / "include")
    jobs = BUILD.plan_jobs(files, manifest, toolchain, ["sm90a"], re.compile("^dequantize_"), cache=Path("/c"))
    assert sorted(j.name for j in jobs) == sorted(n for n, e in manifest.items()
                                                 if n.startswith("dequantize_") and e["arch"] == "sm90a")
    for job in jobs:
        assert job.arch == "sm90a" and len(job.key) == 64 and job.entry == Path("/c") / f"{job.name}.{job.key[:16]}"
        assert dict(job.headers) and all(h.startswith("fp4gen/") for h in dict(job.headers))


def test_a_spec_comment_changes_no_key(project):
    before = cache_keys(project)
    spec = project / "codegen/specs/quantize.yaml"
    spec.write_text("# an edited comment\n" + spec.read_text().replace("# Quantize kernels", "# Quantise kernels")
                    + "# trailing comment\n")
    assert cache_keys(project) == before


def test_a_description_edit_changes_no_key(project):
    before = cache_keys(project)
    edit(project / "codegen/specs/dequantize.yaml", "description: NVFP4 operand", "description: An NVFP4 operand")
    assert cache_keys(project) == before


def test_a_new_tile_adds_its_kernels_and_changes_no_other_key(project):
    before = cache_keys(project)
    edit(project / "codegen/specs/gemm_sm90.yaml", "tile: [128x256x64, 64x128x64]",
         "tile: [128x256x64, 64x128x64, 128x128x64]")
    after = cache_keys(project)
    added = set(after) - set(before)
    assert added and all("_t128x128x64_" in name for name in added)
    assert set(before) <= set(after)
    assert {name: after[name] for name in before} == before


def test_a_new_spec_file_adds_its_kernels_and_changes_no_other_key(project):
    before = cache_keys(project)
    (project / "codegen/specs/gemm_extra.yaml").write_text(
        "family: gemm_sm90\naxes: {out_dtype: [bf16], tile: [128x128x64], schedule: [cooperative], arch: [sm90a]}\n")
    after = cache_keys(project)
    assert set(after) - set(before) == {"gemm_nvfp4_bf16out_t128x128x64_coop_sm90a"}
    assert {name: after[name] for name in before} == before


def test_a_changed_tile_replaces_its_kernels_only(project):
    before = cache_keys(project)
    edit(project / "codegen/specs/gemm_sm90.yaml", "tile: [128x256x64, 64x128x64]", "tile: [128x256x64, 64x192x64]")
    after = cache_keys(project)
    removed, added = set(before) - set(after), set(after) - set(before)
    assert removed and removed == {name for name in before if "_t64x128x64_" in name and name.startswith("gemm_nvfp4_")
                                   and not name.startswith(("gemm_nvfp4_packed", "gemm_nvfp4_grouped"))}
    assert added == {name.replace("_t64x128x64_", "_t64x192x64_") for name in removed}
    assert not set(after.values()) & {before[name] for name in removed}  # new kernels, new keys
    assert {name: after[name] for name in set(before) - removed} == {n: before[n] for n in set(before) - removed}


_INCLUDE = re.compile(r'^\s*#\s*include\s+"(fp4gen/[^"]+)"', re.MULTILINE)


def includers(project: Path, header: str) -> set:
    """Kernels whose source includes `header` directly or through other fp4gen headers (by reading them)."""
    include_dir = project / "templates" / "include"

    def reached(text, seen):
        for name in _INCLUDE.findall(text):
            if name not in seen:
                seen.add(name)
                reached((include_dir / name).read_text(), seen)
        return seen

    return {fname[:-3] for fname, text in render_all(project).items()
            if fname.endswith(".cu") and header in reached(text, set())}


@pytest.mark.parametrize("header,family", [
    ("fp4gen/dequantize.cuh", "dequantize"),  # included by the dequantize kernels' sources
    ("fp4gen/nvfp4.cuh", "quantize"),  # included only through other headers
    ("fp4gen/bilateral_epilogue.hpp", "gemm_sm90"),
])
def test_a_header_edit_changes_exactly_the_keys_of_its_includers(project, header, family):
    before = cache_keys(project)
    expected = includers(project, header)
    manifest = json.loads((project / "generated" / MANIFEST).read_text())["kernels"]
    assert {n for n, e in manifest.items() if e["family"] == family} <= expected < set(before)
    path = project / "templates" / "include" / header
    path.write_text(path.read_text() + "// an edited comment\n")
    after = cache_keys(project)
    assert set(after) == set(before)
    assert {name for name in before if after[name] != before[name]} == expected


def _run(project, *args, env, cwd):
    return subprocess.run([sys.executable, str(project / "build.py"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiles a kernel: needs nvcc and the CUTLASS headers")
def test_build_py_reuses_a_kernel_after_a_spec_comment_and_a_new_variant(tmp_path):
    project = copy_project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"  # build.py works from any current directory
    elsewhere.mkdir()
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "FP4GEN_LIB_DIR"}
    env.update(FP4GEN_CACHE_DIR=str(cache))
    args = ("--arch", "sm90a", "--filter", "^dequantize_nvfp4_to_bf16_sm90a$")
    first = _run(project, *args, env=dict(env, FP4GEN_LIB_DIR=str(tmp_path / "lib")), cwd=elsewhere)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 built, 0 cached" in first.stdout and (tmp_path / "lib" / "dequantize_nvfp4_to_bf16_sm90a.so").is_file()

    spec = project / "codegen/specs/dequantize.yaml"
    spec.write_text(spec.read_text().replace("# NVFP4 dequantization kernels", "# The NVFP4 dequantization kernels"))
    (project / "codegen/specs/gemm_extra.yaml").write_text(  # a new kernel the filter does not select
        "family: gemm_sm90\naxes: {out_dtype: [bf16], tile: [128x128x64], schedule: [cooperative], arch: [sm90a]}\n")
    second = _run(project, *args, env=env, cwd=elsewhere)  # no FP4GEN_LIB_DIR: lib/ in the cache dir
    assert second.returncode == 0, second.stdout + second.stderr
    assert "0 built, 1 cached" in second.stdout, second.stdout
    assert f"libraries in {cache / 'lib'}" in second.stdout
    assert (project / "generated/gemm_nvfp4_bf16out_t128x128x64_coop_sm90a.cu").is_file()
    index = json.loads((cache / "lib" / "index.json").read_text())
    assert list(index) == ["dequantize_nvfp4_to_bf16_sm90a"]
    assert (cache / "lib" / "dequantize_nvfp4_to_bf16_sm90a.so").is_file()
