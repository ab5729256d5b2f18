"""The compiler side of a build: find nvcc and the CUTLASS headers, assemble nvcc flags per arch, and
compute the content-hash cache key of each kernel library."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import tables

CUTLASS_WHEEL = "nvidia-cutlass"
CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"
# How to install what build.py needs besides nvcc (the package's optional extra `build`), for messages.
BUILD_DEPS_FIX = (f'pip install -e ".[build]" (or pip install ".[build]") in the fp4gen checkout, or '
                  f'pip install jinja2 pyyaml ninja {CUTLASS_PIN}')
COMMON_FLAGS = ("-std=c++17", "--expt-relaxed-constexpr", "-O3", "-DNDEBUG", "-Xcompiler", "-fPIC", "-shared")


class ToolchainError(RuntimeError):
    """A build prerequisite is missing; the message says what and how to get it."""


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cutlass_include: Path
    cutlass_version: str
    fp4gen_include: Path

    def flags(self, arch: str) -> list:
        """nvcc flags for one arch, without include paths (those are machine-specific, see include_flags)."""
        return list(COMMON_FLAGS) + [tables.ARCHS[arch]["gencode"]]

    def include_flags(self) -> list:
        return [f"-I{self.fp4gen_include}", f"-I{self.cutlass_include}"]


def find_nvcc() -> str:
    """nvcc from $CUDA_HOME/bin, else from PATH."""
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home:
        candidate = Path(cuda_home) / "bin" / "nvcc"
        if candidate.is_file():
            return str(candidate.resolve())
        raise ToolchainError(f"CUDA_HOME={cuda_home} but {candidate} does not exist; point CUDA_HOME at a CUDA "
                             f"toolkit (12.8 or newer, for sm_100a) or unset it to use the nvcc on PATH")
    found = shutil.which("nvcc")
    if not found:
        raise ToolchainError("nvcc not found: install the CUDA toolkit (12.8 or newer, for sm_100a) and put its "
                             "bin/ on PATH, or set CUDA_HOME to the toolkit directory")
    return str(Path(found).resolve())


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ToolchainError(f"{nvcc} --version failed: {exc}") from None
    return out.strip().splitlines()[-1]  # "Build cuda_13.0.r13.0/compiler.36424714_0"


def find_cutlass() -> tuple:
    """(include dir, version): $FP4GEN_CUTLASS_DIR, else the headers inside the nvidia-cutlass wheel."""
    override = os.environ.get("FP4GEN_CUTLASS_DIR")
    if override:
        include = Path(override)
        version_h = include / "cutlass" / "version.h"
        if not version_h.is_file():
            raise ToolchainError(f"FP4GEN_CUTLASS_DIR={override} holds no cutlass/version.h; point it at a "
                                 f"CUTLASS include/ directory")
        return include.resolve(), "headers-sha256:" + hashlib.sha256(version_h.read_bytes()).hexdigest()[:16]
    spec = importlib.util.find_spec("cutlass_library")
    include = Path(list(spec.submodule_search_locations)[0]) / "source" / "include" if spec else None
    if include is None or not (include / "cutlass" / "version.h").is_file():
        raise ToolchainError(f"CUTLASS headers not found: {BUILD_DEPS_FIX} (the {CUTLASS_WHEEL} wheel ships them "
                             f"under cutlass_library/source/include), or set FP4GEN_CUTLASS_DIR to a CUTLASS include/")
    return include.resolve(), importlib.metadata.version(CUTLASS_WHEEL)


def discover(root: Path) -> Toolchain:
    nvcc = find_nvcc()
    cutlass_include, cutlass_version = find_cutlass()
    return Toolchain(nvcc, nvcc_version(nvcc), cutlass_include, cutlass_version,
                     (root / "templates" / "include").resolve())


_FP4GEN_INCLUDE = re.compile(r'^\s*#\s*include\s+"(fp4gen/[^"]+)"', re.MULTILINE)


def included_header_digests(source: str, include_dir: Path) -> dict:
    """sha256 of each fp4gen header `source` includes, directly or through other fp4gen headers: a header
    edit rebuilds the kernels that include it and no others. (CUTLASS and CUDA headers are covered by
    their versions in the cache key.)"""
    digests, pending = {}, _FP4GEN_INCLUDE.findall(source)
    while pending:
        name = pending.pop()
        if name in digests:
            continue
        path = include_dir / name
        if not path.is_file():
            raise ToolchainError(f"{name} is included but does not exist under {include_dir}")
        text = path.read_bytes()
        digests[name] = hashlib.sha256(text).hexdigest()
        pending += _FP4GEN_INCLUDE.findall(text.decode())
    return dict(sorted(digests.items()))


def digest_of(headers: dict) -> str:
    return hashlib.sha256(json.dumps(headers, sort_keys=True).encode()).hexdigest()


def cache_key(source: str, arch: str, toolchain: Toolchain, headers: dict) -> str:
    """Content hash of everything that determines a library's bytes; never file paths or mtimes."""
    material = {
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "headers": headers,
        "cutlass": toolchain.cutlass_version,
        "nvcc": toolchain.nvcc_version,
        "flags": toolchain.flags(arch),
        "arch": arch,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("FP4GEN_CACHE_DIR") or Path.home() / ".cache" / "fp4gen").expanduser()


def default_jobs() -> int:
    """Parallel nvcc jobs: one per core, but no more than one per 4 GB of RAM (compiling a CUTLASS GEMM
    translation unit peaks near 4 GB of RAM)."""
    cores = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return cores
    return max(1, min(cores, int(mem_gb // 4)))
