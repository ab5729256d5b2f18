"""Write and run build.ninja for the kernels whose cache entries are missing, and read per-kernel build
times back from .ninja_log."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .toolchain import BUILD_DEPS_FIX, ToolchainError


@dataclass(frozen=True)
class CompileJob:
    name: str
    arch: str
    source: Path  # generated/<name>.cu
    entry: Path  # cache directory <name>.<key16>; exists only when complete
    flags: tuple
    key: str = ""  # the full cache key (entry is named <name>.<key[:16]>)
    headers: tuple = ()  # ((fp4gen header, sha256), ...) the key was computed from

    @property
    def library(self) -> Path:
        return self.entry / f"lib{self.name}.so"


def _escape(path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_ninja(path: Path, nvcc: str, include_flags: list, jobs: list, tmp_dir: Path) -> None:
    """One build edge per job. nvcc writes into a private temp dir that is renamed into place only when
    complete, so an interrupted or concurrent build never leaves a half-written cache entry."""
    lines = [
        "# Written by build.py; lists only kernels missing from the cache. Do not edit.",
        "ninja_required_version = 1.5",
        f"nvcc = {shlex.quote(nvcc)}",
        f"include_flags = {' '.join(shlex.quote(f) for f in include_flags)}",
        "rule nvcc",
        "  command = rm -rf $tmp && mkdir -p $tmp && $nvcc $flags $include_flags -o $tmp/$libname $in"
        " && mkdir -p $$(dirname $entry) && mv -T $tmp $entry",
        "  description = nvcc $kernel",
        "",
    ]
    for job in jobs:
        lines += [
            f"build {_escape(job.library)}: nvcc {_escape(job.source)}",
            f"  kernel = {job.name}",
            f"  flags = {' '.join(shlex.quote(f) for f in job.flags)}",
            f"  libname = {job.library.name}",
            f"  entry = {shlex.quote(str(job.entry))}",
            f"  tmp = {shlex.quote(str(tmp_dir / job.entry.name))}",
            "",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def ninja_executable() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the pip package ships the binary

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        raise ToolchainError(f"ninja not found: {BUILD_DEPS_FIX}") from None


def run_ninja(build_file: Path, jobs: int) -> int:
    """Run ninja with its own [n/N] progress lines on our stdout; returns its exit code."""
    cmd = [ninja_executable(), "-f", str(build_file), "-j", str(jobs)]
    return subprocess.run(cmd, cwd=build_file.parent, stdout=sys.stdout, stderr=sys.stderr).returncode


def build_seconds(build_dir: Path) -> dict:
    """output path -> seconds of its last build, from ninja's log (start and end in milliseconds)."""
    log = build_dir / ".ninja_log"
    times = {}
    if log.exists():
        for line in log.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) >= 4 and not line.startswith("#"):
                times[fields[3]] = (int(fields[1]) - int(fields[0])) / 1000.0
    return times
