#!/usr/bin/env python3
"""fp4gen's one entry point for code generation and compilation.

    python build.py              render every spec into generated/, compile every kernel, publish build/lib
    python build.py --check      fail (exit 1) when generated/ differs from what the specs render
    python build.py --list       list the kernels the specs declare, without compiling
    python build.py --render-only  regenerate generated/ only
    options: --arch sm90a,sm100a  --jobs N  --filter REGEX

Compiled libraries live in a content-hash cache (FP4GEN_CACHE_DIR, default ~/.cache/fp4gen), so an
unchanged kernel is never rebuilt; the libraries of this checkout are published to build/lib (or
FP4GEN_LIB_DIR), where the runtime loads them.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from codegen import tables  # noqa: E402
from codegen.errors import SpecError  # noqa: E402
from codegen.ninja import CompileJob, build_seconds, run_ninja, write_ninja  # noqa: E402
from codegen.render import MANIFEST, check_generated, render_all, variants_by_name, load_specs, write_generated  # noqa: E402
from codegen.toolchain import (ToolchainError, cache_key, cache_root, default_jobs, discover,  # noqa: E402
                               included_header_digests)

BUILD_DIR = ROOT / "build"
INDEX = "index.json"  # in the lib dir: kernel -> the source and header digests its library was built from


def lib_dir() -> Path:
    return Path(os.environ.get("FP4GEN_LIB_DIR") or BUILD_DIR / "lib")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail if generated/ is stale")
    mode.add_argument("--list", action="store_true", help="list declared kernels and exit")
    mode.add_argument("--render-only", action="store_true", help="regenerate generated/ without compiling")
    p.add_argument("--arch", default=",".join(tables.ARCHS),
                   help=f"comma-separated archs to compile (default: all: {','.join(tables.ARCHS)})")
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: cores, at most RAM/4 GB)")
    p.add_argument("--filter", default=None, help="only compile kernels whose name matches this regex")
    args = p.parse_args(argv)
    args.arch = [a for a in args.arch.split(",") if a]
    unknown = [a for a in args.arch if a not in tables.ARCHS]
    if unknown:
        p.error(f"--arch {','.join(unknown)} is not a known arch; choose from {', '.join(tables.ARCHS)}")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be at least 1")
    return args


def cmd_check(files) -> int:
    problems = check_generated(ROOT / "generated", files)
    if problems:
        print("generated/ is stale; run `python build.py --render-only` (or `python build.py`) and commit:")
        print("\n".join("  " + p for p in problems))
        return 1
    print(f"generated/ is up to date ({len(files) - 1} kernels)")
    return 0


def cmd_list() -> int:
    variants = variants_by_name(load_specs(ROOT))
    print(f"{'kernel':<48} {'op':<12} {'arch':<7} spec")
    for name, v in variants.items():
        print(f"{name:<48} {v.spec.family.op:<12} {v.value('arch'):<7} {v.spec.file}")
    print(f"{len(variants)} kernels")
    return 0


def _library_loads(path: Path) -> bool:
    """A cache entry counts only if its library loads and reports an ABI version; anything else is a
    miss to rebuild (a corrupt library never becomes a crash later)."""
    try:
        return ctypes.CDLL(str(path)).fp4gen_abi_version() > 0
    except (OSError, AttributeError):
        return False


def _publish(jobs, manifest) -> None:
    """Copy each library into the lib dir atomically and record which sources it was built from."""
    out = lib_dir()
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}  # absent or unreadable: rebuilt from this run
    # keep entries of kernels not built this time only while they still match the manifest
    index = {k: v for k, v in index.items() if k in manifest
             and v.get("headers_sha256") == manifest[k]["headers_sha256"]
             and v.get("source_sha256") == manifest[k]["source_sha256"]}
    for job in jobs:
        tmp = out / f".{job.name}.{uuid.uuid4().hex}.tmp"
        shutil.copy2(job.library, tmp)
        os.replace(tmp, out / f"{job.name}.so")
        index[job.name] = {"source_sha256": manifest[job.name]["source_sha256"],
                           "headers_sha256": manifest[job.name]["headers_sha256"],
                           "cache_entry": str(job.entry), "arch": job.arch}
    tmp = out / f".{INDEX}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    os.replace(tmp, index_path)


def cmd_build(args, files) -> int:
    toolchain = discover(ROOT)
    manifest_doc = json.loads(files[MANIFEST])
    manifest = manifest_doc["kernels"]
    cache = cache_root()
    pattern = re.compile(args.filter) if args.filter else None
    jobs, headers = [], {}
    for name, entry in manifest.items():
        if entry["arch"] not in args.arch or (pattern and not pattern.search(name)):
            continue
        source = files[f"{name}.cu"]
        headers[name] = included_header_digests(source, toolchain.fp4gen_include)
        key = cache_key(source, entry["arch"], toolchain, headers[name])
        jobs.append(CompileJob(name, entry["arch"], ROOT / "generated" / f"{name}.cu", cache / f"{name}.{key[:16]}",
                               tuple(toolchain.flags(entry["arch"]))))
    if not jobs:
        print("no kernel matches --arch/--filter")
        return 1
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time per cache: entries are never half-written
        missing = []
        for job in jobs:
            if job.entry.exists() and not _library_loads(job.library):
                shutil.rmtree(job.entry)
            if not job.entry.exists():
                missing.append(job)
        n_jobs = args.jobs or default_jobs()
        started = time.time()
        if missing:
            print(f"compiling {len(missing)} of {len(jobs)} kernels with {n_jobs} parallel nvcc jobs "
                  f"({toolchain.nvcc_version}, CUTLASS {toolchain.cutlass_version})", flush=True)
            build_file = BUILD_DIR / "build.ninja"
            write_ninja(build_file, toolchain.nvcc, toolchain.include_flags(), missing, cache / "tmp")
            ok = run_ninja(build_file, n_jobs) == 0
            # the cache keys hold the headers as they were when the build started: a library compiled while
            # one of its headers changed may hold either version, so it is dropped
            edited = [job for job in missing if headers[job.name]
                      != included_header_digests(files[f"{job.name}.cu"], toolchain.fp4gen_include)]
            for job in edited:
                shutil.rmtree(job.entry, ignore_errors=True)
            if edited:
                print(f"error: headers of {len(edited)} kernels changed while compiling ({edited[0].name}, ...); "
                      f"rerun python build.py", file=sys.stderr)
                return 1
            if not ok:
                print("build failed: the nvcc errors are above. Fix the spec or template and rerun python build.py",
                      file=sys.stderr)
                return 1
        seconds = build_seconds(BUILD_DIR)
        _publish(jobs, manifest)
    built = {job.name for job in missing}
    print(f"\n{'kernel':<48} {'arch':<7} {'status':<7} {'seconds':>8}")
    for job in jobs:
        status = "built" if job.name in built else "cached"
        secs = f"{seconds.get(str(job.library), 0.0):8.1f}" if status == "built" else f"{'-':>8}"
        print(f"{job.name:<48} {job.arch:<7} {status:<7} {secs}")
    print(f"{len(built)} built, {len(jobs) - len(built)} cached in {time.time() - started:.1f} s; "
          f"libraries in {lib_dir()}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.list:
            return cmd_list()
        files = render_all(ROOT)
        if args.check:
            return cmd_check(files)
        changed = write_generated(ROOT / "generated", files)
        print(f"rendered {len(files) - 1} kernels into generated/ ({len(changed)} files changed)")
        if args.render_only:
            return 0
        return cmd_build(args, files)
    except (SpecError, ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
