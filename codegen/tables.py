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

# Hopper GEMM tile configurations (CTA tile M x N x K, cluster, schedule). Cooperative 128x256 tiles serve
# large problems; 64-row pingpong tiles serve small M (spec/cutlass-notes.md sections 0-1).
GEMM_TILES = {
    "128x256x64": {"tile_m": 128, "tile_n": 256, "tile_k": 64, "cluster_m": 1, "pingpong": False},
    "64x128x64": {"tile_m": 64, "tile_n": 128, "tile_k": 64, "cluster_m": 1, "pingpong": True},
}

# C parameter type -> how the runtime passes it through ctypes (manifest "params" entries carry these kinds)
C_PARAM_KINDS = {
    "const void*": "pointer",
    "const uint8_t*": "pointer",
    "const float*": "pointer",
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
}
