"""Kernel selection: a pure function from a problem to a manifest kernel name, with reasons when none fits."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from ..errors import BuildError
from .manifest import build_command


@dataclass(frozen=True)
class Problem:
    op: str
    compute_capability: tuple
    dtypes: dict  # axis -> torch dtype name, e.g. {"out_dtype": "bfloat16"}
    values: dict = field(default_factory=dict)  # other spec axes the kernel must have, e.g. {"direction": "both"}
    cols: int = 0  # the dimension that kernels constrain (`cols_multiple_of`)
    rows: int = 0  # M, for choosing a GEMM tile
    pointers: dict = field(default_factory=dict)  # argument -> address (alignment checks)
    n: int = 0  # a GEMM's N (0: unknown), with multiprocessors for how many tiles fill the GPU
    multiprocessors: int = 0

    def describe(self) -> str:
        dtypes = ", ".join(f"{k}={v}" for k, v in sorted({**self.dtypes, **self.values}.items()))
        cc = ".".join(map(str, self.compute_capability))
        return f"{self.op} on compute capability {cc}" + (f" with {dtypes}" if dtypes else "")


def _rule_violations(kernel: dict, problem: Problem) -> list:
    reasons = []
    multiple = kernel["constraints"].get("cols_multiple_of")
    if multiple and problem.cols % multiple:
        reasons.append(f"{kernel['name']} needs cols to be a multiple of {multiple}, got {problem.cols}")
    for arg, align in kernel["alignment"].items():
        address = problem.pointers.get(arg)
        if address is not None and address % align:
            reasons.append(f"{kernel['name']} needs `{arg}` {align}-byte aligned, got address {address:#x}")
    return reasons


# Up to this M the wgmma kernels that read the packed operands beat the scratch path (H200, bench/RESULTS.md).
PACKED_WGMMA_MAX_ROWS = 256
# Up to this M the kernels that decode B into wgmma's register fragments (gemm_packed_rs) beat them (H200,
# bench/RESULTS.md: M = 16, 64, 128 with N = K = 8192, and M = 192 and 256 at five shapes, since the 128-row
# tile overlaps its decode with wgmma), so the rule takes gemm_fused_wgmma only where no gemm_packed_rs
# kernel is declared.
PACKED_RS_MAX_ROWS = 256


def _rank(kernel: dict, problem: Problem) -> tuple:
    """Smaller is better. GEMMs: first, up to M = 256, a kernel that decodes B into wgmma's register fragments
    (gemm_packed_rs, packed_rs): the smallest tile that covers M, counting M as at least 64 unless it is at
    most 16 (tiles of 17-63 rows measured slower than 64-row ones; a 16-row tile is the fastest up to M = 16),
    the tallest when none covers; then the widest; tiles whose manifest fact rule_candidate is false after all
    of these (the autotuner's candidates). Then (reached only where no gemm_packed_rs kernel is
    declared), up to M = 256, a kernel that reads the packed operands with wgmma (gemm_fused_wgmma,
    packed_wgmma), so B's codes are read and dequantized once, which is what bounds small-M GEMMs: the
    smallest tile that covers M (the tallest when none does), then the narrowest.
    Otherwise the wgmma tiles over fp16 scratch: the tallest no taller than M (at least the smallest tile), so
    small M gets 64-row pingpong tiles instead of half-empty 128-row ones; then the widest tile; but first
    those whose tiles of the M x N output number at least half the multiprocessors (where N and the device
    are known), so that a small output is not left to a few large tiles (1024^3 on the H200: 13.1 us on
    64x128 tiles against 20.0 on 128x256 ones, 32 tiles for 132 multiprocessors), and among tiles that do not
    fill, the smallest. The other
    packed-operand kernels (the mma.sync ones, gemm_fused_dequant, which measured slower than the wgmma ones
    at M = 16 and 64 since A is dequantized once per GEMM) come last, the smallest covering tile first.
    Kernels without tile facts rank by name only. The rule follows measurements on the H200
    (bench/RESULTS.md); the autotuner replaces it where it has measured."""
    facts = kernel.get("facts", {})
    tile_m = facts.get("tile_m")
    if tile_m is None:
        return (0, 0, 0, 0, kernel["name"])
    if facts.get("reads_packed_operands"):
        rows, covers = problem.rows, problem.rows <= tile_m
        if facts.get("packed_rs") and rows <= PACKED_RS_MAX_ROWS:
            covers = (rows if rows <= 16 else max(rows, 64)) <= tile_m
            group = 2 if not facts.get("rule_candidate", True) else 0 if covers else 1
            return (-1, group, tile_m if covers else -tile_m, -facts["tile_n"], kernel["name"])
        if facts.get("packed_wgmma") and rows <= PACKED_WGMMA_MAX_ROWS:
            return (0, 0 if covers else 1, tile_m if covers else -tile_m, facts["tile_n"], kernel["name"])
        return (2, 0 if covers else 1, tile_m if covers else -tile_m, facts["tile_n"], kernel["name"])
    fits = tile_m <= max(problem.rows, 64)
    tile_n = facts.get("tile_n", 0)
    fills = True
    if problem.n > 0 and problem.multiprocessors > 0 and tile_n > 0:
        tiles = -(-max(problem.rows, 1) // tile_m) * -(-problem.n // tile_n)
        fills = 2 * tiles >= problem.multiprocessors
    if not fills:  # the smallest tile first
        return (1, 0 if fits else 1, 1, tile_m, tile_n, kernel["name"])
    return (1, 0 if fits else 1, 0, -tile_m if fits else tile_m, -tile_n, kernel["name"])


def declared(problem: Problem, manifest: dict) -> list:
    """The manifest's kernels of the problem's operation, arch, dtypes and spec values (rules not checked)."""
    return [k for name, k in sorted(manifest["kernels"].items())
            if k["op"] == problem.op and tuple(k["compute_capability"]) == tuple(problem.compute_capability)
            and all(k["torch_dtypes"].get(axis) == v for axis, v in problem.dtypes.items())
            and all(k["values"].get(axis) == v for axis, v in problem.values.items())]


def forced_kernels() -> list:
    """Kernel names in FP4GEN_KERNEL (comma-separated): for each problem, a listed kernel of its operation
    replaces the rule's choice."""
    return [name.strip() for name in os.environ.get("FP4GEN_KERNEL", "").split(",") if name.strip()]


def select(problem: Problem, manifest: dict) -> str:
    """Filter the manifest by operation, arch, dtypes and spec values (declared), then by each kernel's rules,
    and take the best by _rank, unless FP4GEN_KERNEL names a kernel that is declared for the problem.

    A problem no declared kernel covers is a BuildError (declare it in a spec); a declared kernel whose
    rules the problem breaks (a forced one included) is a ValueError naming the rule. A forced name that
    no built kernel has is a ValueError too, so a typo does not pass silently.
    """
    candidates = declared(problem, manifest)
    if not candidates:
        raise BuildError(f"no kernel in the kernel manifest implements {problem.describe()}: declare it in a spec "
                         f"under codegen/specs/ and run {build_command()} (backend='reference' runs anywhere)")
    forced = forced_kernels()
    unknown = [name for name in forced if name not in manifest["kernels"]]
    if unknown:
        raise ValueError(f"FP4GEN_KERNEL names {', '.join(unknown)}, which the kernel manifest does not have "
                         f"(python build.py --list lists the declared kernels)")
    forced_here = [k for k in candidates if k["name"] in forced]
    reasons = []
    for kernel in forced_here or sorted(candidates, key=lambda k: _rank(k, problem)):
        violations = _rule_violations(kernel, problem)
        if not violations:
            if os.environ.get("FP4GEN_PRINT_CONFIGS") == "1":
                how = "forced by FP4GEN_KERNEL" if forced_here else "by rule"
                print(f"fp4gen: {problem.describe()} -> {kernel['name']} ({how})", file=sys.stderr)
            return kernel["name"]
        reasons += violations
    raise ValueError(f"no kernel can take {problem.describe()}: " + "; ".join(reasons))


def viable(problem: Problem, manifest: dict) -> list:
    """The names of the declared kernels whose rules the problem meets, in the rule's order (the first is
    what select() takes without FP4GEN_KERNEL): the autotuner's candidates."""
    return [k["name"] for k in sorted(declared(problem, manifest), key=lambda k: _rank(k, problem))
            if not _rule_violations(k, problem)]


def split_k(tile_m: int, tile_n: int, m: int, n: int, k_tiles: int, multiprocessors: int,
            ctas_per_multiprocessor: int) -> int:
    """CTAs per output tile along K for the GEMMs that read the packed operands. Small M gives few output
    tiles, so K is split until the CTAs fill ctas_per_multiprocessor per multiprocessor without starting a
    second, partial wave (the kernel's fact: the H200 measured three for the mma.sync kernels, one for the
    wgmma ones, bench/RESULTS.md); each split keeps at least 8 k-tiles, and there are at most 8 (each costs 4
    bytes of partial sums per output)."""
    tiles = -(-m // tile_m) * -(-n // tile_n)
    wanted = ctas_per_multiprocessor * multiprocessors // tiles
    return max(1, min(wanted, 8, k_tiles // 8))
