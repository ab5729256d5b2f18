"""GEMM kernel selection by measurement.

Every built GEMM kernel that can take a problem (declared for its arch and output dtype, its rules met) is a
candidate. The first time a shape class is seen (M rounded up to a power of two, N and K exact, the operand
alignments), each candidate is timed on the real operands and the fastest is kept: in memory, and on disk in
one JSON file per GPU model, driver version and set of built GEMM kernels, so later processes start with
it. Measuring never happens while a CUDA graph is being captured or under torch.compile tracing; there, and
when FP4GEN_AUTOTUNE=0, the deterministic rule (select.py) serves, or an earlier measurement. FP4GEN_KERNEL
overrides both.

This module holds what needs no GPU (the shape class, the choice, the cache file); ops.py times launches.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..errors import KernelError
from .manifest import cache_root

# A candidate replaces the rule's choice only when it is this much faster: launch-to-launch noise on a
# loaded GPU is a few percent, and a flip-flopping choice would make runs differ for nothing.
MARGIN = 0.03


def enabled() -> bool:
    return os.environ.get("FP4GEN_AUTOTUNE", "1") != "0"


def m_bucket(m: int) -> int:
    """M rounded up to a power of two (at least 16): the batch of tokens varies from step to step, N and K
    are the layer's, so M is what shape classes share."""
    return max(16, 1 << (max(m, 1) - 1).bit_length())


def choose(candidates: list, time_ms: Callable[[str], float]) -> tuple:
    """(the chosen name, {name: milliseconds}). candidates come in the rule's order; the first is the rule's
    choice, and another replaces it only when it is faster by more than MARGIN. A candidate that refuses the
    problem at launch (KernelError) or runs out of memory is left out, said on stderr and recorded as None;
    any other error propagates."""
    times = {}
    for name in candidates:
        try:
            times[name] = float(time_ms(name))
        except (KernelError, torch.OutOfMemoryError) as exc:
            print(f"fp4gen: autotune left out {name}: {exc}", file=sys.stderr)
            times[name] = None
    timed = [name for name in candidates if times[name] is not None]
    if not timed:
        return candidates[0], times
    best = min(timed, key=lambda name: times[name])
    baseline = timed[0]
    if times[best] < times[baseline] * (1.0 - MARGIN):
        return best, times
    return baseline, times


def driver_version() -> str:
    """The kernel driver's release (e.g. 580.159.04); the CUDA driver API version where that is not readable."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return f"cuda{version.value}"
    except (OSError, AttributeError):
        return "unknown"


def kernel_set(manifest: dict, op: str, compute_capability: tuple) -> str:
    """A digest of the op's kernels for one arch (names and source hashes): a rebuilt or added kernel makes
    a new set, whose measurements start afresh."""
    entries = sorted((name, k["source_sha256"], k["headers_sha256"]) for name, k in manifest["kernels"].items()
                     if k["op"] == op and tuple(k["compute_capability"]) == tuple(compute_capability))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """$FP4GEN_CACHE_DIR/autotune, default ~/.cache/fp4gen/autotune."""
    return cache_root() / "autotune"


class TuningCache:
    """Measured choices of one GPU model, driver and kernel set, read once and written through."""

    def __init__(self, directory: Path, gpu: str, driver: str, kernels: str):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-") or "gpu"
        self.path = Path(directory) / f"{slug}-driver{driver}-kernels{kernels}.json"
        self.choices = self._read()

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return {key: entry for key, entry in data.items() if isinstance(entry, dict) and "kernel" in entry}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # unreadable: measure again, and overwrite it then
            print(f"fp4gen: ignoring the autotune cache {self.path} ({exc})", file=sys.stderr)
            return {}

    def get(self, key: str):
        entry = self.choices.get(key)
        return entry["kernel"] if entry else None

    def put(self, key: str, kernel: str, times: dict) -> None:
        # keep what other processes wrote since this one read the file
        self.choices = {**self._read(), **self.choices, key: {"kernel": kernel, "ms": times}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # another process may write the same file: each writes a whole file and renames it into place
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
                json.dump(self.choices, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, self.path)
        except OSError as exc:  # a read-only cache still tunes, in memory
            print(f"fp4gen: cannot write the autotune cache {self.path} ({exc})", file=sys.stderr)
