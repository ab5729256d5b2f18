"""The C++ launcher (launcher.cpp): compiled against the installed PyTorch the first time a process needs it,
then loaded from the build cache.

It is a PyTorch extension, so unlike the kernel libraries it is tied to one PyTorch build: its cache key holds
the source, PyTorch's version and the Python version, and a new PyTorch compiles it again (about half a minute
on two cores, once; a line on stderr says so). FP4GEN_LAUNCHER=python launches from Python instead (ctypes),
which needs no C++ compiler and costs more host time per call.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

import torch

from ..errors import BuildError, KernelError
from . import library
from .manifest import cache_root

SOURCE = Path(__file__).with_name("launcher.cpp")
_LAUNCHERS = ("cpp", "python")


def _is_cpp(choice: str, source: str) -> bool:
    if choice not in _LAUNCHERS:
        raise ValueError(f"{source}{choice!r}: expected one of {', '.join(_LAUNCHERS)}")
    return choice == "cpp"


def enabled() -> bool:
    """Whether plans run through the C++ launcher (FP4GEN_LAUNCHER, read once per process)."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = _is_cpp(os.environ.get("FP4GEN_LAUNCHER", "cpp"), "FP4GEN_LAUNCHER=")
    return _ENABLED


def use(choice: str) -> None:
    """Launch through `choice` ("cpp" or "python") from now on in this process, whatever FP4GEN_LAUNCHER says: for
    benchmarks and tests that compare the two in one process."""
    global _ENABLED
    _ENABLED = _is_cpp(choice, "launcher ")


_ENABLED = None
_MODULE = None


def cache_dir() -> Path:
    """Where compiled launchers live: launcher/ in the build cache ($FP4GEN_CACHE_DIR, else ~/.cache/fp4gen)."""
    return cache_root() / "launcher"


def _key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version_info[:2]}|{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    return digest.hexdigest()[:16]


def module():
    """The compiled launcher module, compiling it first if this PyTorch has none in the cache."""
    global _MODULE
    if _MODULE is None:
        loaded = _load_or_build()
        loaded.set_errors(KernelError, library.failure_message)  # what a Linear step's failed launch raises
        _MODULE = loaded
    return _MODULE


def _load_or_build():
    key = _key()
    name = f"fp4gen_launcher_{key}"
    build_dir = cache_dir() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    # one compile when several processes start at once (not "lock": torch's builder takes that name in build_dir)
    with open(build_dir / "fp4gen.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            print(f"fp4gen: compiling the C++ launcher for torch {torch.__version__} into {build_dir} (once)",
                  file=sys.stderr)
            from torch.utils import cpp_extension

            try:
                cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                                   extra_cflags=["-O2"], verbose=False)
            except Exception as exc:  # a compiler's failure: say what it was and how to do without
                raise BuildError(f"could not compile fp4gen's C++ launcher ({SOURCE}) against torch "
                                 f"{torch.__version__}: {exc}\nIt needs a C++17 compiler and ninja; "
                                 f"FP4GEN_LAUNCHER=python launches from Python instead (slower host path)") from None
    spec = importlib.util.spec_from_file_location(name, library)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded
