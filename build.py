#!/usr/bin/env python3
"""fp4gen's one entry point for code generation and compilation.

    python build.py              render every spec into generated/, compile the kernels of the visible GPUs' archs
                                 (every arch when no GPU is visible), publish them to the lib dir
    python build.py --check      fail (exit 1) when generated/ differs from what the specs render
    python build.py --list       list the kernels the specs declare, without compiling
    python build.py --render-only  regenerate generated/ only
    options: --arch sm90a,sm100a|all  --jobs N  --filter REGEX

Compiled libraries live in a content-hash cache ($FP4GEN_CACHE_DIR, default ~/.cache/fp4gen), so an
unchanged kernel is never rebuilt; the libraries a build selects are published to the lib dir
($FP4GEN_LIB_DIR, default lib/ in the cache dir), where the runtime loads them. Runs from any directory.
Needs nvcc and the build extra (pip install -e ".[build]": jinja2, pyyaml, ninja, nvidia-cutlass).
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

from codegen import tables  # noqa: E402  (tables, errors, ninja and toolchain need only the standard library)
from codegen.errors import SpecError  # noqa: E402
from codegen.ninja import CompileJob, build_seconds, ninja_executable, run_ninja, write_ninja  # noqa: E402
from codegen.toolchain import (BUILD_DEPS_FIX, Toolchain, ToolchainError, cache_key, cache_root,  # noqa: E402
                               default_jobs, discover, included_header_digests)

_BUILD_MODULES = {"jinja2": "jinja2", "markupsafe": "jinja2", "yaml": "pyyaml"}  # import name -> pip package
try:  # rendering needs jinja2 and pyyaml, build-only dependencies: a missing one is a one-line message in main()
    from codegen.render import (MANIFEST, check_generated, load_specs, render_all, variants_by_name,  # noqa: E402
                                write_generated)
    _MISSING_BUILD_DEPS = None
except ImportError as _exc:
    if _exc.name not in _BUILD_MODULES:
        raise  # not a missing dependency but a bug: keep its traceback
    _MISSING_BUILD_DEPS = _BUILD_MODULES[_exc.name]

BUILD_DIR = ROOT / "build"
INDEX = "index.json"  # in the lib dir: kernel -> the source and header digests its library was built from


def lib_dir() -> Path:
    """Where libraries are published and the runtime loads them: $FP4GEN_LIB_DIR, else lib/ in the cache
    root ($FP4GEN_CACHE_DIR, else ~/.cache/fp4gen). The runtime uses the same rule, so it finds them without
    knowing this checkout (a non-editable install)."""
    env = os.environ.get("FP4GEN_LIB_DIR")
    return (Path(env).expanduser() if env else cache_root() / "lib").absolute()


class ArchError(ValueError):
    """The visible GPUs match no fp4gen arch; the message says which and what to pass instead."""


def _cc(capability) -> str:
    return f"{capability[0]}.{capability[1]}"


def default_archs(capabilities) -> tuple:
    """(archs, line to print) for a build without --arch, from the visible GPUs' compute capabilities
    [(major, minor), ...]: the archs of those GPUs (in tables.ARCHS order), or every arch when none is visible.
    Raises ArchError when no visible GPU matches an arch; a GPU without one next to a GPU with one is named
    in the line and skipped."""
    by_cc = {tuple(row["compute_capability"]): arch for arch, row in tables.ARCHS.items()}
    caps = [tuple(int(x) for x in c) for c in capabilities]
    everything = ", ".join(tables.ARCHS)
    if not caps:
        return list(tables.ARCHS), (f"no CUDA GPU visible: building every arch ({everything}); "
                                    f"--arch {next(iter(tables.ARCHS))} (say) builds fewer")
    found = {by_cc[c] for c in caps if c in by_cc}
    unmatched = sorted({_cc(c) for c in caps if c not in by_cc})
    supported = ", ".join(f"{arch} (compute capability {_cc(row['compute_capability'])})"
                          for arch, row in tables.ARCHS.items())
    if not found:
        raise ArchError(f"the visible GPU{'s' if len(caps) > 1 else ''} (compute capability "
                        f"{', '.join(unmatched)}) match{'' if len(caps) > 1 else 'es'} no fp4gen arch; supported: "
                        f"{supported}. Pass --arch all (or --arch sm90a, ...) to build without a matching GPU")
    archs = [arch for arch in tables.ARCHS if arch in found]
    shown = sorted({_cc(c) for c in caps if c in by_cc}, key=lambda v: tuple(map(int, v.split("."))))
    line = (f"building {', '.join(archs)}, the arch{'s' if len(archs) > 1 else ''} of the visible "
            f"GPU{'s' if len(caps) > 1 else ''} (compute capability {', '.join(shown)})")
    if unmatched:
        line += f"; skipping GPUs of compute capability {', '.join(unmatched)} (no fp4gen arch)"
    return archs, line + "; --arch all builds every arch"


def visible_gpu_capabilities() -> list:
    """[(major, minor)] of each visible CUDA device, through torch when it is importable; [] otherwise."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=f"Libraries are published to $FP4GEN_LIB_DIR, else lib/ in the cache dir "
                                       f"($FP4GEN_CACHE_DIR, else ~/.cache/fp4gen); now {lib_dir()}.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail if generated/ is stale")
    mode.add_argument("--list", action="store_true", help="list declared kernels and exit")
    mode.add_argument("--render-only", action="store_true", help="regenerate generated/ without compiling")
    p.add_argument("--arch", default=None,
                   help=f"comma-separated archs to compile ({','.join(tables.ARCHS)}), or 'all' (default: the archs "
                        f"of the visible CUDA GPUs, or all when no GPU is visible)")
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: cores, at most RAM/4 GB)")
    p.add_argument("--filter", default=None, help="only compile kernels whose name matches this regex")
    args = p.parse_args(argv)
    if args.arch is not None:
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
        if not archs:
            p.error(f"--arch {args.arch!r}: name at least one arch ({', '.join(tables.ARCHS)}) or all")
        unknown = [a for a in archs if a not in tables.ARCHS and a != "all"]
        if unknown:
            p.error(f"--arch {','.join(unknown)} is not a known arch; choose from {', '.join(tables.ARCHS)}, or all")
        args.arch = list(tables.ARCHS) if "all" in archs else [a for a in tables.ARCHS if a in archs]
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be at least 1")
    if args.filter is not None:
        try:
            re.compile(args.filter)
        except re.error as exc:
            p.error(f"--filter {args.filter!r} is not a valid regular expression: {exc}")
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


def plan_jobs(files: dict, manifest: dict, toolchain: Toolchain, archs, pattern=None, cache: Path | None = None,
              generated: Path | None = None) -> list:
    """The CompileJob (with its cache key) of every kernel in `manifest` whose arch is in `archs` and whose name
    `pattern` (a compiled regex, or None for all) matches. Pure apart from reading the fp4gen headers under
    toolchain.fp4gen_include: a kernel's key depends on its rendered source, the headers it includes, its
    arch and the tools, never on other kernels or on paths. `files` is render_all's output."""
    cache = cache if cache is not None else cache_root()
    generated = generated if generated is not None else ROOT / "generated"
    jobs = []
    for name, entry in manifest.items():
        if entry["arch"] not in archs or (pattern is not None and not pattern.search(name)):
            continue
        source = files[f"{name}.cu"]
        headers = included_header_digests(source, toolchain.fp4gen_include)
        key = cache_key(source, entry["arch"], toolchain, headers)
        jobs.append(CompileJob(name, entry["arch"], generated / f"{name}.cu", cache / f"{name}.{key[:16]}",
                               tuple(toolchain.flags(entry["arch"])), key, tuple(headers.items())))
    return jobs


def cmd_build(args, files) -> int:
    toolchain = discover(ROOT)
    ninja_executable()  # a missing ninja is reported before anything is compiled
    manifest = json.loads(files[MANIFEST])["kernels"]
    cache = cache_root().absolute()  # ninja runs in build/: a relative $FP4GEN_CACHE_DIR must not move
    pattern = re.compile(args.filter) if args.filter else None
    jobs = plan_jobs(files, manifest, toolchain, args.arch, pattern, cache)
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
            edited = [job for job in missing if dict(job.headers)
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
    if _MISSING_BUILD_DEPS is not None:
        print(f"error: build.py needs the Python package {_MISSING_BUILD_DEPS}, which is not installed: "
              f"{BUILD_DEPS_FIX}", file=sys.stderr)
        return 2
    try:
        if args.list:
            return cmd_list()
        building = not (args.check or args.render_only)
        if building and args.arch is None:
            args.arch, line = default_archs(visible_gpu_capabilities())
            print(line, flush=True)
        files = render_all(ROOT)
        if args.check:
            return cmd_check(files)
        changed = write_generated(ROOT / "generated", files)
        print(f"rendered {len(files) - 1} kernels into generated/ ({len(changed)} files changed)")
        if args.render_only:
            return 0
        return cmd_build(args, files)
    except (SpecError, ToolchainError, ArchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
