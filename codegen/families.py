"""Kernel families: what a spec of each `family` may vary, and the fixed facts of its kernels.

A family names its template, the axes a spec enumerates (with the table each value comes from), the
order of name tokens, the C ABI parameter list and the problem constraints that go into the manifest.
Adding a variant never touches this file; adding a new kind of kernel does.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import tables


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str

    @property
    def kind(self) -> str:
        return tables.C_PARAM_KINDS[self.ctype]


@dataclass(frozen=True)
class Family:
    name: str
    op: str  # the runtime operation the kernels implement
    description: str
    template: str  # file under templates/
    name_prefix: str  # first token of every kernel name of the family
    axes: dict  # axis -> {allowed value: name token} (or a TileTokens), in name-token order
    params: tuple  # C ABI parameters of <name>_can_implement / _workspace_size / _run (run adds the stream)
    constraints: dict  # problem rules the dispatcher checks and reports, e.g. {"cols_multiple_of": 16}
    alignment: dict  # pointer argument -> required byte alignment
    # combinations no kernel can be built for: ((predicate(values, facts) -> True to drop, reason), ...);
    # expansion drops them, and a spec left with none is a SpecError giving the reasons
    excluded: tuple = ()
    # axis -> the value a spec that leaves the axis out gets (an axis added later, so older specs still load)
    defaults: tuple = ()  # ((axis, value), ...)
    # values -> the constraints of that variant beyond `constraints`, e.g. a width limit of one variant
    variant_constraints: object = None


def _tokens(table: dict, fmt: str = "{}") -> dict:
    return {key: fmt.format(key) for key in table}


class TileTokens:
    """Name tokens of a rule-checked tile axis: "t" + the tile, for every tile the table accepts."""

    def __init__(self, table):
        self.table = table
        self.RULE = table.RULE

    def __contains__(self, value):
        return value in self.table

    def __getitem__(self, value):
        self.table[value]  # KeyError for a tile the rule refuses
        return f"t{value}"

    def __iter__(self):
        return iter(self.table)


# The output dtypes every GEMM family offers (bf16 for activations, fp32 for main-grad accumulation).
_GEMM_OUT_DTYPES = {"bf16": "bf16out", "fp32": "fp32out"}

# The parameters every GEMM family shares, around its operand parameters.
_GEMM_EPILOGUE_PARAMS = (
    Param("c", "const void*"),  # [M, N] like D; read only when beta != 0
    Param("d", "void*"),  # [M, N], row stride ldd
    Param("row_amax", "const float*"),  # [M] or [1]: a's amax
    Param("col_amax", "const float*"),  # [N] or [1]: b's amax
    Param("bias", "const float*"),  # [N] fp32 added to every row before rounding, or null
    Param("alpha", "float"),  # fl(1 / 2688^2)
    Param("beta", "float"),  # 0, or 1 to accumulate into C
    Param("m", "int64_t"),
    Param("n", "int64_t"),
    Param("k", "int64_t"),
)
_GEMM_OUTPUT_PARAMS = (
    Param("ldc", "int64_t"),
    Param("ldd", "int64_t"),
    Param("row_is_vector", "int64_t"),  # 1: row_amax has M entries; 0: broadcast row_amax[0]
    Param("col_is_vector", "int64_t"),
    Param("workspace", "void*"),  # workspace_size() bytes from the caller's allocator
)

# The input every quantize-side family reads: x [rows, cols], rows x_row_stride elements apart.
_INPUT_PARAMS = (
    Param("x", "const void*"),
    Param("x_row_stride", "int64_t"),  # elements
    Param("rows", "int64_t"),
    Param("cols", "int64_t"),
)

# The hadamard and rounding axes that the plain quantize and row-pass families gained later: `none` and
# `nearest` add no name token, so the kernels declared before them keep their names, and are the defaults of
# specs that leave the axes out.
_PLAIN_HADAMARD_TOKENS = {"none": "", "rht16": "rht16"}
_PLAIN_ROUNDING_TOKENS = {"nearest": "", "stochastic": "sr"}
_PLAIN_DEFAULTS = (("hadamard", "none"), ("rounding", "nearest"))
# [seed, offset] of stochastic rounding, read on the device (null when rounding to nearest)
_RNG_STATE_PARAM = Param("rng_state", "const int64_t*")


# The C ABI of the grouped GEMM families (one call for either grouping).
_GROUPED_GEMM_PARAMS = (
    Param("a_codes", "const uint8_t*"),  # [M, K/2], row stride lda bytes
    Param("a_scale", "const uint8_t*"),
    Param("b_codes", "const uint8_t*"),  # [N, K/2] (a group's, b_group_stride bytes apart)
    Param("b_scale", "const uint8_t*"),
    *_GEMM_EPILOGUE_PARAMS,
    Param("lda", "int64_t"),  # bytes
    Param("lda_scale", "int64_t"),
    Param("ldb", "int64_t"),
    Param("ldb_scale", "int64_t"),
    *_GEMM_OUTPUT_PARAMS[:-1],
    Param("offsets", "const int64_t*"),  # [groups] cumulative ends along M (rows) or K (elements)
    Param("groups", "int64_t"),
    Param("along_k", "int64_t"),  # 1: groups along K (one [M, N] output a group); 0: along M
    Param("b_group_stride", "int64_t"),  # bytes from one group's B codes to the next (along M)
    Param("b_scale_group_stride", "int64_t"),
    Param("c_group_stride", "int64_t"),  # elements from one group's C / D to the next (along K)
    Param("d_group_stride", "int64_t"),
    Param("row_amax_group_stride", "int64_t"),  # elements from one group's row amaxes to the next
    Param("col_amax_group_stride", "int64_t"),
    Param("bias_group_stride", "int64_t"),
    _GEMM_OUTPUT_PARAMS[-1],  # the workspace
)

def _stochastic_needs_16bit_1x16(values, facts):
    return facts["stochastic"] and (values["in_dtype"] == "fp32" or values.get("block", "1x16") != "1x16")


# The widest row the row pass with the transform takes: a cluster of at most 8 CTAs of 2048 columns holds a
# 16-row panel (kRhtMaxCols in row_pass_hadamard.cuh, whose can_implement refuses wider rows;
# tests/test_runtime_cpu.py checks the two agree). The manifest carries it as the variants' cols_at_most.
ROW_PASS_HADAMARD_MAX_COLS = 16384


def _row_pass_constraints(values: dict) -> dict:
    return {"cols_at_most": ROW_PASS_HADAMARD_MAX_COLS} if values["hadamard"] == "rht16" else {}


_STOCHASTIC_EXCLUSION = (
    _stochastic_needs_16bit_1x16,
    "stochastic rounding with fp32 input or 16x16 blocks: the plain kernels' stochastic variants take 16-bit "
    "gradients in 1x16 blocks (a rowwise block's two lanes share its random words); the quantize_options "
    "kernels take the rest")

# The Hopper GEMMs that read the packed operands (gemm_fused_dequant, gemm_fused_wgmma, gemm_packed_rs) share one
# C ABI.
_PACKED_GEMM_PARAMS = (
    Param("a_codes", "const uint8_t*"),  # [M, K/2] packed E2M1, row stride lda bytes
    Param("a_scale", "const uint8_t*"),  # [M, K/16] E4M3, row stride lda_scale bytes
    Param("b_codes", "const uint8_t*"),  # [N, K/2]
    Param("b_scale", "const uint8_t*"),  # [N, K/16]
    *_GEMM_EPILOGUE_PARAMS,
    Param("lda", "int64_t"),  # bytes
    Param("lda_scale", "int64_t"),
    Param("ldb", "int64_t"),
    Param("ldb_scale", "int64_t"),
    Param("split_k", "int64_t"),  # CTAs per output tile along K (>= 1); > 1 needs the workspace
    *_GEMM_OUTPUT_PARAMS,
)
# ... and one set of rules: whole 64-element k-tiles; cp.async moves 16-byte chunks of codes and 4-byte words
# of scales.
_PACKED_GEMM_ABI = dict(params=_PACKED_GEMM_PARAMS, constraints={"cols_multiple_of": 64},
                        alignment={"a_codes": 16, "b_codes": 16, "a_scale": 4, "b_scale": 4})
# gemm_sm90 takes the packed operands too (one library call dequantizes both into fp16 scratch in its workspace,
# then multiplies), with B's rows: those of N past b_rows multiply as zeros (N rounded up for D's TMA store).
_SCRATCH_GEMM_PARAMS = (
    *_PACKED_GEMM_PARAMS[:4],
    *_GEMM_EPILOGUE_PARAMS,
    *(p for p in _PACKED_GEMM_PARAMS if p.name in ("lda", "lda_scale", "ldb", "ldb_scale")),
    Param("b_rows", "int64_t"),
    *_GEMM_OUTPUT_PARAMS,
)

FAMILIES = {
    "dequantize": Family(
        name="dequantize",
        op="dequantize",
        description="NVFP4 operand (E2M1 codes, E4M3 block scales, fp32 amax) -> 16- or 32-bit tensor",
        template="dequantize.cu.j2",
        name_prefix="dequantize_nvfp4",
        axes={"out_dtype": _tokens(tables.DTYPES, "to_{}"), "arch": _tokens(tables.ARCHS)},
        params=(
            Param("data", "const uint8_t*"),
            Param("scale", "const uint8_t*"),
            Param("amax", "const float*"),
            Param("out", "void*"),
            Param("rows", "int64_t"),
            Param("cols", "int64_t"),
            Param("data_row_stride", "int64_t"),  # bytes
            Param("scale_row_stride", "int64_t"),  # bytes
            Param("amax_stride", "int64_t"),  # elements: 1 per-row amax, 0 per-tensor
            Param("out_row_stride", "int64_t"),  # elements
            Param("inverse_decode_numerator", "float"),  # fl(1 / (6 * e4m3_max)): fl(1/2688), or fl(1/1536) (4over6)
        ),
        # each thread loads the codes of one 16-byte output vector (up to 4 bytes) and stores the vector
        constraints={"cols_multiple_of": 16},
        alignment={"data": 4, "out": 16},
    ),
    "amax": Family(
        name="amax",
        op="amax",
        description="per-row, per-column and/or tensor amax of x [M, K] in one read (NaN-propagating)",
        template="amax.cu.j2",
        name_prefix="amax",
        axes={"in_dtype": _tokens(tables.DTYPES), "arch": _tokens(tables.ARCHS)},
        params=(
            *_INPUT_PARAMS,
            Param("row_amax", "float*"),  # [rows] or null
            Param("col_amax", "float*"),  # [cols] or null
            Param("tensor_amax", "float*"),  # [1] or null
            Param("col_sum", "void*"),  # [cols] column sums of x (a bias gradient), or null
            Param("col_sum_in_x_dtype", "int64_t"),  # 1: col_sum in x's dtype (rounded once), 0: in fp32
            Param("workspace", "void*"),  # workspace_size() bytes: the column sums' partials (none without col_sum)
        ),
        constraints={"cols_multiple_of": 16},
        alignment={"x": 16},  # and the row stride: 16-byte vector loads
    ),
    "quantize": Family(
        name="quantize",
        op="quantize",
        description="x [M, K] -> rowwise and/or columnwise NVFP4 from one read of each tile",
        template="quantize.cu.j2",
        name_prefix="quantize_nvfp4",
        axes={
            "in_dtype": _tokens(tables.DTYPES),
            "direction": {"rowwise": "row", "columnwise": "col", "both": "rowcol"},
            "scaling": {"row": "rowscaled", "tensor": "tensorscaled"},
            "block": {"1x16": "b1x16", "16x16": "b16x16"},
            "hadamard": _PLAIN_HADAMARD_TOKENS,
            "rounding": _PLAIN_ROUNDING_TOKENS,
            "arch": _tokens(tables.ARCHS),
        },
        params=(
            *_INPUT_PARAMS,
            Param("row_amax", "const float*"),  # [rows] (row scaling) or [1]
            Param("col_amax", "const float*"),  # [cols] (row scaling) or [1]
            Param("row_data", "uint8_t*"),  # [rows, cols/2], contiguous
            Param("row_scale", "uint8_t*"),  # [rows, cols/16], contiguous
            Param("col_data", "uint8_t*"),  # [cols, rows/2], contiguous
            Param("col_scale", "uint8_t*"),  # [cols, rows/16], contiguous
            _RNG_STATE_PARAM,
        ),
        # rows_multiple_of applies to the columnwise copy and to 16x16 blocks (see the kernel's can_implement)
        constraints={"cols_multiple_of": 16},
        alignment={"x": 16},
        excluded=((lambda values, facts: values["scaling"] == "row" and values["block"] == "16x16",
                   "row scaling with 16x16 blocks: a 16x16 block shares one scale across 16 rows, so it cannot "
                   "take a per-row amax"),
                  (lambda values, facts: facts["hadamard"] and (values["direction"] != "columnwise"
                                                                or values["block"] != "1x16"),
                   "the Hadamard transform in a kernel with a rowwise copy or 16x16 blocks: the transform is of "
                   "the columnwise 1x16 copy, which the columnwise-only kernel makes (transforming each tile in "
                   "place)"),
                  _STOCHASTIC_EXCLUSION),
        defaults=_PLAIN_DEFAULTS,
    ),
    "row_pass": Family(
        name="row_pass",
        op="row_pass",
        description="row scaling: x [M, K] -> per-row amax, rowwise NVFP4 and (optionally) per-column amax, "
                    "from one DRAM read of each row panel",
        template="row_pass.cu.j2",
        name_prefix="quantize_row_pass",
        axes={"in_dtype": _tokens(tables.DTYPES), "hadamard": _PLAIN_HADAMARD_TOKENS,
              "rounding": _PLAIN_ROUNDING_TOKENS, "arch": _tokens(tables.ARCHS)},
        params=(
            *_INPUT_PARAMS,
            Param("row_amax", "float*"),  # [rows]
            # [cols], or null for no per-column amax (and no workspace); with rht16, of the transformed x.T (required)
            Param("col_amax", "float*"),
            Param("row_data", "uint8_t*"),  # [rows, cols/2], contiguous
            Param("row_scale", "uint8_t*"),  # [rows, cols/16], contiguous
            Param("workspace", "void*"),  # workspace_size() bytes: each CTA's column maxima
            _RNG_STATE_PARAM,
        ),
        # the column maxima live in shared memory: can_implement refuses rows of more than 200 KB with col_amax;
        # rht16 takes whole 16-row panels and rows of up to cols_at_most elements (a cluster of CTAs holds a panel)
        constraints={"cols_multiple_of": 16},
        variant_constraints=_row_pass_constraints,
        alignment={"x": 16},
        excluded=((lambda values, facts: facts["hadamard"] and values["in_dtype"] == "fp32",
                   "rht16 with fp32 input: the kernel's lanes hold 8 16-bit columns (fp32 rows with the transform "
                   "take the amax_hadamard pass and the plain rowwise and columnwise quantize kernels)"),
                  (lambda values, facts: facts["stochastic"] and facts["hadamard"],
                   "stochastic rounding in the row pass with the transform: row scaling with both takes the "
                   "amax_hadamard pass and the plain rowwise and columnwise quantize kernels"),
                  _STOCHASTIC_EXCLUSION),
        defaults=_PLAIN_DEFAULTS,
    ),
    "amax_hadamard": Family(
        name="amax_hadamard",
        op="amax_hadamard",
        description="the amaxes of x [M, K] (per row and/or tensor) and of the 16-point random Hadamard "
                    "transform of x.T (per column and/or tensor) in one read (NaN-propagating)",
        template="amax_hadamard.cu.j2",
        name_prefix="amax_hadamard",
        axes={"in_dtype": _tokens(tables.DTYPES), "arch": _tokens(tables.ARCHS)},
        params=(
            *_INPUT_PARAMS,
            Param("row_amax", "float*"),  # [rows] or null: of x's rows
            Param("col_amax", "float*"),  # [cols] or null: of the transformed copy's rows (x's columns)
            Param("row_tensor_amax", "float*"),  # [1] or null: of x
            Param("col_tensor_amax", "float*"),  # [1] or null: of the transformed copy
            Param("col_sum", "void*"),  # [cols] column sums of x (untransformed: a bias gradient), or null
            Param("col_sum_in_x_dtype", "int64_t"),  # 1: col_sum in x's dtype (rounded once), 0: in fp32
            Param("workspace", "void*"),  # workspace_size() bytes: the column sums' partials (none without col_sum)
        ),
        # rows: whole 16-row groups of the transform
        constraints={"cols_multiple_of": 16},
        alignment={"x": 16},
    ),
    "quantize_options": Family(
        name="quantize_options",
        op="quantize_options",
        description="x [M, K] -> rowwise and/or columnwise NVFP4 with stochastic rounding, the random Hadamard "
                    "transform of the columnwise copy and/or 4over6; copies, scaling and block shape at run time",
        template="quantize_options.cu.j2",
        name_prefix="quantize_nvfp4_options",
        axes={
            "in_dtype": _tokens(tables.DTYPES),
            "rounding": {"nearest": "rn", "stochastic": "sr"},
            "hadamard": {"none": "plain", "rht16": "rht16"},
            "four_over_six": {"none": "max6", "adaptive": "4over6"},
            "arch": _tokens(tables.ARCHS),
        },
        params=(
            *_INPUT_PARAMS,
            Param("row_amax", "const float*"),  # [rows] (vector_amax) or [1]
            Param("col_amax", "const float*"),  # [cols] (vector_amax) or [1]; of the transformed copy with RHT
            Param("row_data", "uint8_t*"),  # [rows, cols/2], contiguous, or null: no rowwise copy
            Param("row_scale", "uint8_t*"),  # [rows, cols/16], contiguous
            Param("col_data", "uint8_t*"),  # [cols, rows/2], contiguous, or null: no columnwise copy
            Param("col_scale", "uint8_t*"),  # [cols, rows/16], contiguous
            _RNG_STATE_PARAM,
            Param("vector_amax", "int64_t"),  # 1: per-row / per-column amaxes; 0: per tensor
            Param("block_2d", "int64_t"),  # 1: 16x16 blocks (per tensor, no transform); 0: 1x16
            Param("error_mse", "int64_t"),  # 4over6's error: 1 squared, 0 absolute
        ),
        constraints={"cols_multiple_of": 16},
        alignment={"x": 16},
        excluded=(
            (lambda values, facts: not (facts["stochastic"] or facts["hadamard"] or facts["four_over_six"]),
             "no option: the plain quantize kernels (family quantize) cover it"),
            (lambda values, facts: facts["stochastic"] and facts["four_over_six"],
             "stochastic rounding with 4over6: 4over6 chooses between two round-to-nearest candidates"),
        ),
    ),
    "quantize_grouped": Family(
        name="quantize_grouped",
        op="quantize_grouped",
        description="grouped x [T, K] (tokens sorted by group, group ends on the device) or stacked x [E, N, K] "
                    "-> rowwise and/or per-group columnwise NVFP4 copies; every option at run time",
        template="quantize_grouped.cu.j2",
        name_prefix="quantize_grouped_nvfp4",
        axes={"in_dtype": _tokens(tables.DTYPES), "arch": _tokens(tables.ARCHS)},
        params=(
            *_INPUT_PARAMS,
            Param("offsets", "const int64_t*"),  # [groups] cumulative row ends (device)
            Param("padded_ends", "const int64_t*"),  # [groups] cumulative ends of the padded sizes (multiples of 16)
            Param("groups", "int64_t"),
            Param("capacity", "int64_t"),  # padded rows, a multiple of 16 (>= padded_ends[-1])
            Param("row_amax", "float*"),  # written: [rows] (vector_amax) or [groups]
            Param("col_amax", "float*"),  # written: [groups, cols] (vector_amax) or [groups]
            Param("row_data", "uint8_t*"),  # [rows, cols/2], contiguous, or null: no rowwise copy
            Param("row_scale", "uint8_t*"),  # [rows, cols/16], contiguous
            Param("col_data", "uint8_t*"),  # the columnwise copy (layout: quantize_grouped.cuh), or null
            Param("col_scale", "uint8_t*"),
            Param("col_group_stride", "int64_t"),  # codes bytes from one group's matrix to the next (stacked)
            Param("col_row_stride", "int64_t"),  # codes bytes a row of the columnwise copy
            Param("stacked", "int64_t"),  # 1: the columnwise copy is one [cols, rows of the group] matrix a group
            _RNG_STATE_PARAM,
            Param("vector_amax", "int64_t"),  # 1: per-row / per-(group, column) amaxes; 0: per group
            Param("block_2d", "int64_t"),  # 1: 16x16 blocks (stacked, per group, no transform)
            Param("hadamard", "int64_t"),  # 1: the columnwise copy from the 16-point RHT along rows
            Param("four_over_six", "int64_t"),  # 0 none, 1 MAE, 2 MSE
            Param("stochastic", "int64_t"),  # 1: stochastic rounding
            Param("workspace", "void*"),  # workspace_size() bytes (stacked weights: the one-grid launch's counters)
        ),
        constraints={"cols_multiple_of": 16},
        alignment={"x": 16},
    ),
    "gemm_sm90": Family(
        name="gemm_sm90",
        op="gemm",
        description="Hopper D = A @ B.T: both packed operands copied to block-scaled fp16 scratch in the workspace, "
                    "then CUTLASS wgmma with the bilateral amax epilogue",
        template="gemm_sm90.cu.j2",
        name_prefix="gemm_nvfp4",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "tile": TileTokens(tables.GEMM_TILES),
            "schedule": {"cooperative": "coop", "pingpong": "pingpong"},
            "cluster": {"1x1": "", "2x1": "cl2x1", "1x2": "cl1x2"},  # 1x1 adds nothing to the name
            "arch": {"sm90a": "sm90a"},
        },
        defaults=(("cluster", "1x1"),),  # a spec without the axis declares single-CTA kernels
        params=_SCRATCH_GEMM_PARAMS,
        # K is a multiple of 16 (NVFP4 blocks); the copies read codes a word at a time; TMA needs 16-byte aligned
        # pointers and row strides of C and D
        constraints={"cols_multiple_of": 16},
        alignment={"a_codes": 4, "b_codes": 4, "c": 16, "d": 16},
        excluded=((lambda values, facts: values["schedule"] == "cooperative" and facts["tile_m"] < 128,
                   "a cooperative schedule splits the tile's M across two warp groups: tile M must be >= 128"),),
    ),
    "gemm_fused_dequant": Family(
        name="gemm_fused_dequant",
        op="gemm",
        description="Hopper D = A @ B.T for small M, read straight from the packed NVFP4 operands: codes and "
                    "scales staged by cp.async, dequantized on chip to fp16 (exact), mma.sync, the bilateral "
                    "amax epilogue",
        template="gemm_fused_dequant.cu.j2",
        name_prefix="gemm_nvfp4_fused",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "fused_tile": TileTokens(tables.FUSED_GEMM_TILES),
            "arch": {"sm90a": "sm90a"},
        },
        **_PACKED_GEMM_ABI,
        excluded=((lambda values, facts: facts["tile_n"] % (64 if facts["tile_m"] < 32 else 32),
                   "four warps split the tile 1x4 below M = 32 (else 2x2) and a warp takes whole 16-column "
                   "steps: tile N must be a multiple of 64 (tile M 16) or 32"),),
    ),
    "gemm_fused_wgmma": Family(
        name="gemm_fused_wgmma",
        op="gemm",
        description="Hopper D = A @ B.T read straight from the packed NVFP4 operands: codes and scales staged by "
                    "cp.async, dequantized on chip to fp16 (exact) while asynchronous wgmma multiplies the "
                    "previous k-tile, the bilateral amax epilogue",
        template="gemm_fused_wgmma.cu.j2",
        name_prefix="gemm_nvfp4_packed",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "packed_tile": TileTokens(tables.WGMMA_FUSED_GEMM_TILES),
            "arch": {"sm90a": "sm90a"},
        },
        **_PACKED_GEMM_ABI,
    ),
    "gemm_packed_rs": Family(
        name="gemm_packed_rs",
        op="gemm",
        description="Hopper D = A @ B.T for small M read from the packed NVFP4 operands: each warp group decodes "
                    "its rows of B straight into wgmma's register fragments (D^T = B A^T, A's fp16 rows from "
                    "shared memory), the bilateral amax epilogue",
        template="gemm_packed_rs.cu.j2",
        name_prefix="gemm_nvfp4_packedrs",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "rs_tile": TileTokens(tables.PACKED_RS_TILES),
            "arch": {"sm90a": "sm90a"},
        },
        **_PACKED_GEMM_ABI,
    ),
    "gemm_grouped_wgmma": Family(
        name="gemm_grouped_wgmma",
        op="grouped_gemm",
        description="Hopper grouped D = A @ B.T for mixture-of-experts layers, groups along M (stacked B) or "
                    "along K (one output a group), group ends read on the device; gemm_fused_wgmma's tile and "
                    "bilateral epilogue with each group's amaxes",
        template="gemm_grouped_wgmma.cu.j2",
        name_prefix="gemm_nvfp4_grouped",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "packed_tile": TileTokens(tables.WGMMA_FUSED_GEMM_TILES),
            "arch": {"sm90a": "sm90a"},
        },
        params=_GROUPED_GEMM_PARAMS,
        constraints={"cols_multiple_of": 64},
        alignment={"a_codes": 16, "b_codes": 16, "a_scale": 4, "b_scale": 4},
    ),
    "gemm_grouped_tma": Family(
        name="gemm_grouped_tma",
        op="grouped_gemm",
        description="Hopper grouped D = A @ B.T for mixture-of-experts layers (as gemm_grouped_wgmma) through "
                    "CUTLASS's SM90 grouped GEMM over fp16 copies of both operands (exact block-scaled values), "
                    "group shapes and pointers written on the device, the bilateral amax epilogue per group",
        template="gemm_grouped_tma.cu.j2",
        name_prefix="gemm_nvfp4_grouped_tma",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "tile": TileTokens(tables.GEMM_TILES),
            "schedule": {"cooperative": "coop", "pingpong": "pingpong"},
            "cluster": {"1x1": "", "2x1": "cl2x1", "1x2": "cl1x2"},  # 1x1 adds nothing to the name
            "arch": {"sm90a": "sm90a"},
        },
        # specs written before the schedule axis declared cooperative kernels
        defaults=(("cluster", "1x1"), ("schedule", "cooperative")),
        params=_GROUPED_GEMM_PARAMS,
        constraints={"cols_multiple_of": 64},
        # TMA stores D's rows (and loads C's): 16-byte aligned; the codes and scales as the packed kernel reads them
        alignment={"a_codes": 16, "b_codes": 16, "a_scale": 4, "b_scale": 4, "c": 16, "d": 16},
        excluded=((lambda values, facts: values["schedule"] == "cooperative" and facts["tile_m"] < 128,
                   "the cooperative schedule splits the tile's M across two warp groups: tile M must be >= 128"),
                  (lambda values, facts: values["schedule"] == "pingpong" and facts["tile_m"] * facts["tile_n"] > 128 * 128,
                   "a pingpong warp group holds the whole tile's fp32 accumulators: at most 128 x 128")),
    ),
    "gemm_grouped_sm100": Family(
        name="gemm_grouped_sm100",
        op="grouped_gemm",
        description="Blackwell grouped D = A @ B.T for mixture-of-experts layers (as gemm_grouped_wgmma) through "
                    "CUTLASS's SM100 grouped block-scaled GEMM on the packed codes, each group's scales copied "
                    "into the swizzled layout on the device, the bilateral amax epilogue per group",
        template="gemm_grouped_sm100.cu.j2",
        name_prefix="gemm_nvfp4_grouped_blockscaled",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "mma_tile": TileTokens(tables.SM100_MMA_TILES),
            "arch": {"sm100a": "sm100a"},
        },
        params=_GROUPED_GEMM_PARAMS,
        constraints={"cols_multiple_of": 64},
        alignment={"a_codes": 16, "b_codes": 16, "c": 16, "d": 16},
    ),
    "gemm_sm100": Family(
        name="gemm_sm100",
        op="gemm",
        description="Blackwell D = A @ B.T with native block-scaled NVFP4 MMA and the bilateral amax epilogue",
        template="gemm_sm100.cu.j2",
        name_prefix="gemm_nvfp4",
        axes={
            "out_dtype": _GEMM_OUT_DTYPES,
            "mma_tile": TileTokens(tables.SM100_MMA_TILES),
            "arch": {"sm100a": "sm100a"},
        },
        params=(
            Param("a", "const void*"),  # [M, K/2] packed E2M1, contiguous rows
            Param("b", "const void*"),  # [N, K/2] packed E2M1, contiguous rows
            Param("sfa", "const void*"),  # a's E4M3 scales, 128x4 swizzled (fp4gen.swizzle)
            Param("sfb", "const void*"),  # b's E4M3 scales, 128x4 swizzled
            *_GEMM_EPILOGUE_PARAMS,
            *_GEMM_OUTPUT_PARAMS,
        ),
        # TMA reads 16-byte rows of packed codes: K a multiple of 32 elements
        constraints={"cols_multiple_of": 32},
        alignment={"a": 16, "b": 16, "c": 16, "d": 16},
    ),
}
