"""Every per-enum fact codegen knows, in one place: name tokens, C++ spellings, torch names, nvcc targets.

A spec axis value must be a key of its table; a new dtype or arch is a row here plus a YAML edit.
"""

# arch token -> nvcc target and the compute capability the runtime matches against the device.
# e2m1_cvt: whether the arch has the cvt.rn.satfinite.e2m1x2.f32 instruction (else an exact software encode).
ARCHS = {
    "sm90a": {"gencode": "-gencode=arch=compute_90a,code=sm_90a", "compute_capability": [9, 0], "e2m1_cvt": False},
    "sm100a": {"gencode": "-gencode=arch=compute_100a,code=sm_100a", "compute_capability": [10, 0],
               "e2m1_cvt": True},
}

# dtype token -> C++ type, torch dtype name, element size
DTYPES = {
    "bf16": {"cpp": "__nv_bfloat16", "torch": "bfloat16", "bytes": 2, "cutlass": "cutlass::bfloat16_t"},
    "fp16": {"cpp": "__half", "torch": "float16", "bytes": 2, "cutlass": "cutlass::half_t"},
    "fp32": {"cpp": "float", "torch": "float32", "bytes": 4, "cutlass": "float"},
}

# Which copies a quantize kernel writes: rowwise (x), columnwise (x.T) or both from one read.
DIRECTIONS = {
    "rowwise": {"rowwise": True, "columnwise": False},
    "columnwise": {"rowwise": False, "columnwise": True},
    "both": {"rowwise": True, "columnwise": True},
}

# Second-level scaling: one amax per row (per column for the columnwise copy), or one per tensor.
SCALINGS = {"row": {"row_scaled": True}, "tensor": {"row_scaled": False}}

# Scale block shape: 1x16 (activations, gradients) or 16x16 tiles (weights).
BLOCKS = {"1x16": {"block_2d": False}, "16x16": {"block_2d": True}}

# Training-quality options of the quantize_options kernels (each a compile-time switch of the kernel).
ROUNDINGS = {"nearest": {"stochastic": False}, "stochastic": {"stochastic": True}}
HADAMARDS = {"none": {"hadamard": False}, "rht16": {"hadamard": True}}
FOUR_OVER_SIX = {"none": {"four_over_six": False}, "adaptive": {"four_over_six": True}}


class GemmTiles:
    """GEMM tiles `MxNxK`, accepted by rule rather than from a list, so a new tile is a YAML edit."""

    def __init__(self, m_values: tuple, n_step: int, n_max: int, k_values: tuple, examples: tuple,
                 facts: dict | None = None):
        self.m_values, self.n_step, self.n_max, self.k_values = m_values, n_step, n_max, k_values
        self.EXAMPLES = examples
        # facts of every tile: a value, or a function of (tile M, tile N, tile K) for a fact that varies
        self.facts = facts or {}
        self.RULE = (f"MxNxK with M in {', '.join(map(str, m_values))}, N a multiple of {n_step} from {n_step} "
                     f"to {n_max}, and K in {', '.join(map(str, k_values))}")

    def parse(self, value):
        parts = value.split("x") if isinstance(value, str) else []
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            return None
        m, n, k = map(int, parts)
        ok = m in self.m_values and n % self.n_step == 0 and self.n_step <= n <= self.n_max and k in self.k_values
        return (m, n, k) if ok else None

    def __contains__(self, value):
        return self.parse(value) is not None

    def __getitem__(self, value):
        shape = self.parse(value)
        if shape is None:
            raise KeyError(value)
        facts = {name: value(*shape) if callable(value) else value for name, value in self.facts.items()}
        return {"tile_m": shape[0], "tile_n": shape[1], "tile_k": shape[2], **facts}

    def __iter__(self):
        return iter(self.EXAMPLES)


# Hopper CTA tiles of bf16 wgmma: cooperative 128x256 tiles suit large problems and 64-row pingpong tiles
# small M; the schedule is its own axis.
GEMM_TILES = GemmTiles((64, 128, 256), 16, 256, (64, 128), ("128x256x64", "64x128x64", "128x128x64"))

# Blackwell 1-SM MMA tiles of the block-scaled NVFP4 MMA (K = 256 elements: four 64-element scale atoms).
SM100_MMA_TILES = GemmTiles((128,), 64, 256, (256,), ("128x128x256", "128x256x256"))

# CTA tiles of the Hopper GEMM that reads the packed operands (gemm_fused_dequant): four warps of mma.sync
# over 64-element k-tiles; a warp tile must be whole 16x16 steps (2x2 warps from M = 32 on, 1x4 below).
# reads_packed_operands: for small M the selector prefers these kernels (select._rank says which family
# for which M), so each byte of B is read and dequantized once.
# split_ctas_per_multiprocessor: how many CTAs per multiprocessor split K aims at (select.split_k).
FUSED_GEMM_TILES = GemmTiles((16, 32, 64, 128), 64, 128, (64,), ("16x64x64", "64x64x64", "128x64x64"),
                             facts={"reads_packed_operands": True, "split_ctas_per_multiprocessor": 3})

# CTA tiles of the Hopper GEMM that reads the packed operands and multiplies with wgmma (gemm_fused_wgmma):
# one warp group per 64 rows (at most two), wgmma N up to 256 in whole 64-row swizzle groups, 64-element
# k-tiles. reads_packed_operands as above.
WGMMA_FUSED_GEMM_TILES = GemmTiles((64, 128), 64, 256, (64,), ("128x256x64", "128x128x64", "64x128x64"),
                                   facts={"reads_packed_operands": True, "packed_wgmma": True,
                                          # two CTAs share a multiprocessor up to tile N = 128, one
                                          # above: the kernels' launch bound too (gemm_fused_wgmma.cuh
                                          # checks that shared memory holds that many)
                                          "split_ctas_per_multiprocessor": lambda m, n, k: 2 if n <= 128 else 1})

# CTA tiles of the Hopper GEMM for small M that decodes B into wgmma's register fragments (gemm_packed_rs):
# M rows of A (wgmma N: whole eight-row groups), N = 64 or 128 rows of B (a warp group per 64); two CTAs share
# a multiprocessor for tiles of up to 128 rows of A, one for 256 rows (whose accumulators take 128 registers a
# thread): the kernels' launch bound too (gemm_packed_rs.cuh checks their shared memory). packed_rs: the
# rule ranks them first for small M (select._rank); reads_packed_operands as above. rule_candidate: whether the
# deterministic rule may take the tile; the 256-row tile is the autotuner's alone (on the H200 8-13% faster than
# two 128-row tiles at N = K = 8192 for M = 160-256, 14-21% slower at N x K = 14336 x 4096 and 4096 x 14336, with
# no rule of M, N and K found to tell them apart; bench/RESULTS.md, 2026-12-04).
PACKED_RS_TILES = GemmTiles((16, 32, 64, 128, 256), 64, 128, (64,), ("128x128x64", "64x128x64", "16x128x64"),
                            facts={"reads_packed_operands": True, "packed_rs": True,
                                   "split_ctas_per_multiprocessor": lambda m, n, k: 1 if m > 128 else 2,
                                   "rule_candidate": lambda m, n, k: m <= 128})

# Hopper GEMM kernel schedules: two consumer warp groups sharing a tile (cooperative, needs tile M >= 128)
# or alternating between tiles (pingpong).
GEMM_SCHEDULES = {"cooperative": {"pingpong": False}, "pingpong": {"pingpong": True}}

# Hopper thread-block clusters of the CUTLASS GEMM (CTAs along M x along N): a cluster's CTAs share each
# operand tile that they have in common through TMA multicast, one L2 read for several CTAs.
GEMM_CLUSTERS = {"1x1": {"cluster_m": 1, "cluster_n": 1}, "2x1": {"cluster_m": 2, "cluster_n": 1},
                 "1x2": {"cluster_m": 1, "cluster_n": 2}}

# C parameter type -> how the runtime passes it through ctypes (manifest "params" entries carry these kinds)
C_PARAM_KINDS = {
    "const void*": "pointer",
    "const uint8_t*": "pointer",
    "const float*": "pointer",
    "const int64_t*": "pointer",
    "uint8_t*": "pointer",
    "float*": "pointer",
    "void*": "pointer",
    "int64_t": "int64",
    "float": "float32",
}

# The table each spec axis takes its values from. Rendering exposes a dtype row as `<axis minus dtype>ctype`
# (in_dtype -> in_ctype) and every boolean or integer fact of any other row under its own name (booleans
# as C++ `true`/`false`); the manifest records those facts too, for kernel selection.
AXIS_TABLES = {
    "arch": ARCHS,
    "in_dtype": DTYPES,
    "out_dtype": DTYPES,
    "direction": DIRECTIONS,
    "scaling": SCALINGS,
    "block": BLOCKS,
    "tile": GEMM_TILES,
    "mma_tile": SM100_MMA_TILES,
    "fused_tile": FUSED_GEMM_TILES,
    "packed_tile": WGMMA_FUSED_GEMM_TILES,
    "rs_tile": PACKED_RS_TILES,
    "schedule": GEMM_SCHEDULES,
    "cluster": GEMM_CLUSTERS,
    "rounding": ROUNDINGS,
    "hadamard": HADAMARDS,
    "four_over_six": FOUR_OVER_SIX,
}


def variant_facts(values: dict) -> dict:
    """The boolean and integer facts of the table rows a variant's axis values select."""
    facts = {}
    for axis, value in values.items():
        if not axis.endswith("dtype"):
            facts.update({k: v for k, v in AXIS_TABLES[axis][value].items() if isinstance(v, (bool, int))})
    return facts
