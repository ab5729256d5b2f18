"""Every per-enum fact codegen knows, in one place: name tokens, C++ spellings, torch names, nvcc targets.

A spec axis value must be a key of its table; a new dtype or arch is a row here plus a YAML edit.
"""

# arch token -> nvcc target and the compute capability the runtime matches against the device.
ARCHS = {
    "sm90a": {"gencode": "-gencode=arch=compute_90a,code=sm_90a", "compute_capability": [9, 0]},
    "sm100a": {"gencode": "-gencode=arch=compute_100a,code=sm_100a", "compute_capability": [10, 0]},
}

# dtype token -> C++ type, torch dtype name, element size
DTYPES = {
    "bf16": {"cpp": "__nv_bfloat16", "torch": "bfloat16", "bytes": 2},
    "fp16": {"cpp": "__half", "torch": "float16", "bytes": 2},
    "fp32": {"cpp": "float", "torch": "float32", "bytes": 4},
}

# C parameter type -> how the runtime passes it through ctypes (manifest "abi" entries carry these kinds)
C_PARAM_KINDS = {
    "const uint8_t*": "pointer",
    "const float*": "pointer",
    "void*": "pointer",
    "int64_t": "int64",
}
