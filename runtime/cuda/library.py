"""Load built kernel libraries with ctypes and call their C ABI (templates/include/fp4gen/abi.h)."""
from __future__ import annotations

import ctypes
import functools
import json
import struct

from ..errors import BuildError, KernelError
from .manifest import INDEX, build_command, lib_dir, load_manifest

ABI_VERSION = 2  # must equal FP4GEN_ABI_VERSION in templates/include/fp4gen/abi.h
_CTYPES = {"pointer": ctypes.c_void_p, "int64": ctypes.c_int64, "float32": ctypes.c_float}
_STATUS = {  # a kernel's refusal statuses (1000 + e: CUDA error e)
    1: "the problem breaks the kernel's shape or stride rules",
    2: "a pointer or row stride breaks the kernel's alignment",
}


def failure_message(name: str, call: str, status: int) -> str:
    """What a KernelError says of kernel `name`'s `call` that returned the nonzero `status` (the C++ launcher's
    Linear steps raise the same text: launcher.module() hands it this function)."""
    if status >= 1000:
        return f"{name}: {call} failed with CUDA error {status - 1000}"
    return f"{name}: {call} refused the problem (status {status}: {_STATUS.get(status, 'unknown status')})"


def _build_hint(entry: dict) -> str:
    return f"run {build_command(entry['arch'])}; it publishes the libraries to {lib_dir()}"


class Kernel:
    """One built kernel library; `run(*args)` launches it on the given stream and raises on failure."""

    def __init__(self, entry: dict):
        self.name = entry["name"]
        self.family = entry["family"]
        self.facts = entry.get("facts", {})
        self.alignment = entry.get("alignment", {})
        self.constraints = entry.get("constraints", {})
        path = lib_dir() / f"{self.name}.so"
        if not path.exists():
            raise BuildError(f"kernel {self.name} is declared in the kernel manifest but not built "
                             f"(no {path}): {_build_hint(entry)}")
        try:
            built = json.loads((lib_dir() / INDEX).read_text()).get(self.name, {})
        except (OSError, ValueError):
            built = {}
        if (built.get("source_sha256") != entry["source_sha256"]
                or built.get("headers_sha256") != entry["headers_sha256"]):
            raise BuildError(f"the built library {path} is stale: generated/{self.name}.cu or its headers changed "
                             f"since it was built; {_build_hint(entry)}")
        try:
            lib = ctypes.CDLL(str(path))
            version = lib.fp4gen_abi_version()
        except (OSError, AttributeError) as exc:
            raise BuildError(f"{path} does not load as an fp4gen kernel library ({exc}); {_build_hint(entry)}") from None
        if version != ABI_VERSION:
            raise BuildError(f"{path} has ABI version {version}, this runtime expects {ABI_VERSION}; "
                             f"{_build_hint(entry)}")
        argtypes = [_CTYPES[kind] for _, _, kind in entry["params"]]
        self._run = getattr(lib, entry["symbols"]["run"])
        self._run.argtypes, self._run.restype = argtypes + [ctypes.c_void_p], ctypes.c_int
        self._can_implement = getattr(lib, entry["symbols"]["can_implement"])
        self._can_implement.argtypes, self._can_implement.restype = argtypes, ctypes.c_int
        self._workspace_size = getattr(lib, entry["symbols"]["workspace_size"])
        self._workspace_size.argtypes, self._workspace_size.restype = argtypes, ctypes.c_size_t
        # <name>_run_packed: the same run with one 64-bit word a parameter, for the C++ launcher (launcher.cpp)
        self.run_packed_address = ctypes.cast(getattr(lib, entry["symbols"]["run_packed"]), ctypes.c_void_p).value
        self._kinds = [kind for _, _, kind in entry["params"]]

    def pack(self, args) -> list:
        """run()'s arguments (without the stream) as <name>_run_packed's words: a pointer or int64 as its 64 bits
        (None: 0), a float as its fp32 bits (rounded from the double as ctypes rounds it)."""
        if len(args) != len(self._kinds):
            raise TypeError(f"{self.name} takes {len(self._kinds)} arguments, got {len(args)}")
        words = []
        for kind, value in zip(self._kinds, args):
            if kind == "float32":
                words.append(struct.unpack("<I", struct.pack("<f", value))[0])
            else:
                words.append(int(value or 0) & 0xFFFFFFFFFFFFFFFF)
        return words

    def raise_for(self, status: int, call: str):
        raise KernelError(failure_message(self.name, call, status))

    def can_implement(self, *args) -> int:
        return self._can_implement(*args)

    def workspace_size(self, *args) -> int:
        return self._workspace_size(*args)

    def run(self, *args, stream: int) -> None:
        status = self._run(*args, stream)
        if status:
            self.raise_for(status, "run")


@functools.lru_cache(maxsize=None)
def load_kernel(name: str) -> Kernel:
    manifest = load_manifest()
    if name not in manifest["kernels"]:
        raise BuildError(f"kernel {name} is not in the kernel manifest; declare it in a spec and run "
                         f"{build_command()}")
    return Kernel(manifest["kernels"][name])
