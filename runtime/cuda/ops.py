"""The CUDA backend's operations: choose a kernel from the manifest, allocate outputs from the PyTorch
allocator, and launch on the current stream of the tensors' device."""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

from ..formats import NVFP4Data
from ..options import DEFAULT_OPTIONS, QuantizeOptions, check_column_sums
from ..row_layout import row_start_bits, rows_readable
from ..swizzle import swizzle_scales
from .launch_plan import INPUT, RNG, LaunchPlan, Slot, raw_stream, remember
from .library import load_kernel
from .manifest import load_manifest
from . import autotune
from .select import PACKED_WGMMA_MAX_ROWS, Problem, declared, forced_kernels, select, split_k, viable


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(device_index))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _problem(op: str, device: torch.device, dtypes: dict, cols: int = 0, pointers=None, values=None,
             rows: int = 0, n: int = 0) -> Problem:
    return Problem(op, _capability(device.index), {axis: _dtype_name(d) for axis, d in dtypes.items()},
                   values or {}, cols, rows, pointers or {}, n, _multiprocessors(device.index) if n else 0)


_PLANS = {}  # plan key -> loaded kernel: a hit costs building one tuple and one dict lookup
_QUANTIZE_PLANS = {}  # (device, dtype, shape, row stride, x's alignment, the call's arguments) -> LaunchPlan


def _kernel_for(op: str, device: torch.device, dtypes: dict, cols: int = 0, pointers=None, values=None,
                rows: int = 0, n: int = 0):
    """select() + load_kernel(), memoised on everything that decides the choice: the operation, device (hence
    arch), dtypes and spec values, and the rules' inputs (cols modulo 256, which covers every
    `cols_multiple_of`; rows up to the rule's largest M threshold plus one, so that M = 256 and larger M do not
    share a plan, and with a GEMM's N the exact M and N, which decide how many tiles fill the device; addresses
    modulo 16). The key keeps the dicts' insertion order, which each call site fixes, so a hit needs no sorting
    and no Problem."""
    key = (op, device.index, *dtypes.items(), *(values.items() if values else ()), cols % 256,
           (rows, n) if n else min(rows, PACKED_WGMMA_MAX_ROWS + 1))
    if pointers:
        key += tuple((arg, address % 16) for arg, address in pointers.items())
    kernel = _PLANS.get(key)
    if kernel is None:
        problem = _problem(op, device, dtypes, cols, pointers, values, rows, n)
        # bounded: GEMM keys carry M, and a token count may never repeat
        kernel = remember(_PLANS, key, load_kernel(select(problem, load_manifest())))
    return kernel


def check_rows_readable(x: torch.Tensor) -> None:
    """Refuses an x [rows, cols] that the quantize kernels cannot read row by row (row_layout.rows_readable)."""
    if not rows_readable(x):
        raise ValueError(f"x has strides {tuple(x.stride())}: the CUDA quantize kernels read rows of contiguous "
                         f"elements (last stride 1) that do not overlap (row stride at least {x.shape[1]}); pass "
                         f"x.contiguous()")


# The current device, straight from PyTorch's C++ state (a CPU-only build of PyTorch has none; nothing launches
# there).
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _launch(kernel, device: torch.device, *args) -> None:
    index = device.index
    if _current_device() == index:
        kernel.run(*args, stream=raw_stream(index))
    else:
        with torch.cuda.device(index):  # the launch goes to the current device: make it the tensors' device
            kernel.run(*args, stream=raw_stream(index))


def dequantize(operand: NVFP4Data, dtype: torch.dtype) -> torch.Tensor:
    """out = e2m1 * block scale * amax / (6 * e4m3_max), [rows, cols] in dtype."""
    rows, cols = operand.shape
    device = operand.device
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    data, scale = operand.data, operand.scale.view(torch.uint8)
    amax = operand.amax.contiguous()
    kernel = _kernel_for("dequantize", device, {"out_dtype": dtype}, cols,
                         {"data": row_start_bits(data), "out": row_start_bits(out)})
    _launch(kernel, device, data.data_ptr(), scale.data_ptr(), amax.data_ptr(), out.data_ptr(), rows, cols,
            data.stride(0), scale.stride(0), 1 if operand.row_scaled else 0, out.stride(0),
            1.0 / (6.0 * operand.e4m3_max))  # ctypes rounds the double quotient: fl(1/(6 e4m3_max))
    return out


# Row-scaled quantization with a rowwise copy and 1x16 blocks takes the row pass (quantize_row_pass_*: per-row
# amax, rowwise copy and per-column amax from one DRAM read of each row panel: encoded from registers for
# 16-bit rows of up to 8192 elements, read a second time from cache otherwise) and then, for a columnwise copy,
# the columnwise-only quantize kernel, where that beat the amax pass plus the quantize kernel on the H200
# (bench/quantize.py --paths, bench/RESULTS.md, 08b4160, 2026-11-30): with both copies for rows of up to 32 KB
# (64 and 128 KB rows lost, 0.77-0.90x: we take it that a CTA's panels then no longer stay in L1 for the second
# read); with the rowwise copy alone for every width measured, up to 128 KB rows.
# 0 turns the row pass off.
ROW_PASS_MAX_ROW_BYTES = 32 * 1024
ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES = 128 * 1024


@contextlib.contextmanager
def row_pass_limits(max_row_bytes: int):
    """Both row-width limits set to max_row_bytes inside the block (0: never the row pass): for tests and
    benchmarks that compare the two paths. Not thread-safe: it changes module state."""
    global ROW_PASS_MAX_ROW_BYTES, ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES
    saved = ROW_PASS_MAX_ROW_BYTES, ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES
    ROW_PASS_MAX_ROW_BYTES = ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES = max_row_bytes
    _forget_quantize_plans()  # the plans chose with the limits they saw
    try:
        yield
    finally:
        ROW_PASS_MAX_ROW_BYTES, ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES = saved
        _forget_quantize_plans()


def uses_row_pass(x: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool) -> bool:
    limit = ROW_PASS_MAX_ROW_BYTES if columnwise else ROW_PASS_ROWWISE_ONLY_MAX_ROW_BYTES
    return (scaling == "row" and rowwise and tuple(block) == (1, 16) and limit > 0
            and x.shape[1] * x.element_size() <= limit)


def _declares(op: str, x: torch.Tensor, values: dict) -> bool:
    """Whether the manifest declares a kernel of `op` for x's dtype and device with these spec values."""
    return _declares_for(op, x.device, x.dtype, tuple(values.items()))


@functools.lru_cache(maxsize=None)
def _declares_for(op: str, device: torch.device, dtype: torch.dtype, values: tuple) -> bool:
    return bool(declared(_problem(op, device, {"in_dtype": dtype}, values=dict(values)), load_manifest()))


def plain_kernels_take(x: torch.Tensor, block: tuple, columnwise: bool, options: QuantizeOptions) -> bool:
    """Whether the plain kernels' variants (quantize, row_pass) serve these options: 1x16 blocks (or no option),
    no 4over6, the Hadamard transform only with a columnwise copy, and stochastic rounding where the manifest
    declares a stochastic quantize kernel for x's dtype (the specs declare 16-bit ones). The rest takes the
    quantize_options kernels."""
    if options == DEFAULT_OPTIONS:
        return True
    return (options.four_over_six is None and tuple(block) == (1, 16) and (columnwise or not options.hadamard)
            and (options.rounding == "nearest"
                 or _declares("quantize", x, {"rounding": "stochastic", "block": "1x16"})))


def quantize(x: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
             options: QuantizeOptions = DEFAULT_OPTIONS, column_sums: torch.dtype | None = None):
    """Row-scaled with a rowwise copy (see uses_row_pass): the row pass, then the columnwise-only quantize kernel
    if the columnwise copy is asked for. Otherwise: the amax pass (its outputs zeroed by a kernel of its own),
    then the quantize kernel. Each launch after the first is a programmatic dependent of the one before; no
    host synchronization. Stochastic rounding takes the same kernels' stochastic variants where
    plain_kernels_take says so; the Hadamard transform takes _plan_hadamard; other options take
    _plan_with_options.

    The kernels and their arguments are worked out once per kind of call (device, dtype, shape, row stride,
    x's alignment and the arguments; block is a tuple) and kept as a launch plan (launch_plan.py): a repeated
    call allocates its outputs and launches.

    column_sums (tensor scaling only): also x's column sums [K] (a gradient's bias gradient) in this dtype,
    torch.float32 or x's own (summed in fp32, rounded once), made by the amax pass that reads x anyway
    (amax.cuh); then returns (rowwise, columnwise, sums)."""
    check_column_sums(column_sums, scaling, x.dtype)
    check_rows_readable(x)
    plan = quantize_plan(x, scaling, block, rowwise, columnwise, options, column_sums)
    buffers = plan.run(_launch, [x, _rng_state(options)], x.device)
    row, col, e4m3_max, sums = plan.result
    copies = _copy(plan, buffers, row, e4m3_max), _copy(plan, buffers, col, e4m3_max)
    return (*copies, plan.tensor(buffers, sums)) if column_sums is not None else copies


def quantize_plan(x: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
                  options: QuantizeOptions, column_sums: torch.dtype | None = None) -> LaunchPlan:
    """The launch plan of quantize() for this kind of call (made on the first one): its inputs are x and the random
    state; plan.result is (rowwise copy's (data, scale, amax) slots or None, the columnwise copy's, e4m3_max, the
    column sums' slot or None)."""
    rows, cols = x.shape
    key = (x.device.index, x.dtype, rows, cols, x.stride(0) if rows > 1 else cols, x.data_ptr() % 16, scaling,
           block, rowwise, columnwise, options.rounding, options.hadamard, options.four_over_six, column_sums)
    plan = _QUANTIZE_PLANS.get(key)
    if plan is None:
        plan = remember(_QUANTIZE_PLANS, key, _plan_quantize(x, scaling, block, rowwise, columnwise, options,
                                                             column_sums))
    return plan


def _copy(plan: LaunchPlan, buffers: list, slots, e4m3_max: float):
    """The NVFP4Data of a copy's (data, scale, amax) slots, or None for a copy not asked for."""
    if slots is None:
        return None
    data, scale, amax = (plan.tensor(buffers, slot) for slot in slots)
    return NVFP4Data._made_by_fp4gen(data, scale, amax, e4m3_max)


def _plan_quantize(x: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
                   options: QuantizeOptions, column_sums) -> LaunchPlan:
    if not plain_kernels_take(x, block, columnwise, options):
        return _plan_with_options(x, scaling, block, rowwise, columnwise, options, column_sums)
    if options.hadamard:
        return _plan_hadamard(x, scaling, rowwise, options, column_sums)
    return _plan_plain(x, scaling, block, rowwise, columnwise, options, column_sums)


def _plan_column_sums(plan: LaunchPlan, amax_kernel, x: torch.Tensor, dtype, vector_amax: bool) -> tuple:
    """The amax pass's (col_sum, col_sum_in_x_dtype, workspace) arguments for x's column sums in `dtype`
    (torch.float32 or x's dtype), or (None, 0, None) for no sums (dtype None). The workspace size depends only on
    the shape and on which amaxes the pass makes (workspace_size reads no pointer: a placeholder address stands
    for each output that is not null)."""
    if dtype is None:
        return None, 0, None
    rows, cols = x.shape
    in_x_dtype = 1 if dtype == x.dtype else 0  # fp32 x: either way
    col_sum = plan.buffer(cols, dtype=dtype)
    amaxes = (16, 16, None) if vector_amax else (None, None, 16)
    if amax_kernel.family == "amax_hadamard":
        amaxes = (16, 16, None, None) if vector_amax else (None, None, 16, 16)
    workspace_bytes = amax_kernel.workspace_size(None, cols, rows, cols, *amaxes, 16, in_x_dtype, None) \
        if rows and cols else 0
    return col_sum, in_x_dtype, (plan.buffer(workspace_bytes) if workspace_bytes else None)


def _plan_plain(x: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
                options: QuantizeOptions, column_sums) -> LaunchPlan:
    """The row pass (then the columnwise-only kernel), or the amax pass then the quantize kernels."""
    rows, cols = x.shape
    device, row_scaled = x.device, scaling == "row"
    row_pass = uses_row_pass(x, scaling, block, rowwise, columnwise)
    pointers = {"x": row_start_bits(x)} if x.numel() else {}  # an empty x is never read
    in_dtype = {"in_dtype": x.dtype}
    rounding = {"rounding": options.rounding}
    if row_pass:
        first_kernel = _kernel_for("row_pass", device, in_dtype, cols, pointers, {"hadamard": "none", **rounding})
    else:
        first_kernel = _kernel_for("amax", device, in_dtype, cols, pointers)
    if row_pass:
        directions = ["columnwise"] if columnwise else []
    elif rowwise and columnwise:
        # with stochastic rounding, the rowwise-only and the columnwise-only kernel (each tile read twice), which
        # measured faster than a both-copies kernel (spec quantize_stochastic.yaml declares none)
        directions = ["rowwise", "columnwise"] if options.rounding == "stochastic" else ["both"]
    else:
        directions = ["rowwise" if rowwise else "columnwise"]
    quantize_kernels = [(direction, _kernel_for("quantize", device, in_dtype, cols, pointers, {
        "direction": direction, "scaling": scaling, "block": f"{block[0]}x{block[1]}", "hadamard": "none",
        **rounding})) for direction in directions]

    plan = LaunchPlan()
    if row_scaled:  # per-row amax for the rowwise copy, per-column amax for the columnwise copy
        row_amax = _amax(plan, rows) if rowwise else None
        col_amax = _amax(plan, cols) if columnwise else None
        tensor_amax = None
    else:
        row_amax = col_amax = tensor_amax = _amax(plan, 1)
    row_data, row_scale, col_data, col_scale = _plan_outputs(plan, rows, cols, rowwise, columnwise)
    sums = _plan_column_sums(plan, first_kernel, x, column_sums, False)
    plan.result = _result(rowwise, columnwise, row_data, row_scale, row_amax, col_data, col_scale, col_amax, 448.0,
                          sums[0])
    stride = x.stride(0) if rows > 1 else cols
    if rows == 0 or cols == 0:  # nothing to read; an empty extent has amax 0 (as in the reference), sums 0
        plan.zero(row_amax, col_amax, sums[0])
    elif row_pass:
        workspace_bytes = _row_pass_workspace_bytes(first_kernel, device.index, rows, cols, col_amax is not None)
        # from the allocator, on the launching stream: its memory is not reused before the kernels that read it ran
        workspace = plan.buffer(workspace_bytes) if workspace_bytes else None
        plan.launch(first_kernel, INPUT, stride, rows, cols, row_amax, col_amax, row_data, row_scale, workspace, RNG)
        if quantize_kernels:
            plan.launch(quantize_kernels[0][1], INPUT, stride, rows, cols, None, col_amax, None, None, col_data,
                        col_scale, RNG)
    else:
        if tensor_amax is None:
            plan.launch(first_kernel, INPUT, stride, rows, cols, row_amax, col_amax, None, *sums)
        else:
            plan.launch(first_kernel, INPUT, stride, rows, cols, None, None, tensor_amax, *sums)
        for direction, kernel in quantize_kernels:
            row = (row_amax, row_data, row_scale) if direction != "columnwise" else (None, None, None)
            col = (col_amax, col_data, col_scale) if direction != "rowwise" else (None, None, None)
            plan.launch(kernel, INPUT, stride, rows, cols, row[0], col[0], row[1], row[2], col[1], col[2], RNG)
    return plan


def _rng_state(options: QuantizeOptions):
    """The device tensor [seed, offset] that stochastic rounding reads, or None."""
    return options.rng.tensor if options.rounding == "stochastic" else None


def _amax(plan: LaunchPlan, count: int) -> Slot:
    return plan.buffer(count, dtype=torch.float32)


def _plan_outputs(plan: LaunchPlan, rows: int, cols: int, rowwise: bool, columnwise: bool) -> tuple:
    """(row data, row scale, col data, col scale) buffers, None for a copy not asked for; the scales are
    allocated as float8_e4m3fn, the operands' dtype (the kernels write their bytes)."""
    e4m3 = torch.float8_e4m3fn
    row = (plan.buffer(rows, cols // 2), plan.buffer(rows, cols // 16, dtype=e4m3)) if rowwise else (None, None)
    col = (plan.buffer(cols, rows // 2), plan.buffer(cols, rows // 16, dtype=e4m3)) if columnwise else (None, None)
    return (*row, *col)


def _result(rowwise, columnwise, row_data, row_scale, row_amax, col_data, col_scale, col_amax, e4m3_max,
            col_sum=None) -> tuple:
    """A quantize plan's result: the (data, scale, amax) slots of each copy asked for (else None), e4m3_max, and
    the column sums' slot (else None)."""
    return ((row_data, row_scale, row_amax) if rowwise else None,
            (col_data, col_scale, col_amax) if columnwise else None, e4m3_max, col_sum)


def _plan_with_options(x: torch.Tensor, scaling: str, block: tuple, rowwise: bool, columnwise: bool,
                       options: QuantizeOptions, column_sums) -> LaunchPlan:
    """The options the plain kernels do not take (plain_kernels_take): an amax pass (amax_hadamard with the
    transform: the columnwise amaxes are then those of the transformed copy), then the quantize_options kernel
    of the options, which takes the copies, the scaling and the block shape as arguments. Stochastic rounding
    reads the state's seed and offset on the device; fp4gen.quantize advances the offset afterwards."""
    rows, cols = x.shape
    device, row_scaled = x.device, scaling == "row"
    pointers = {"x": row_start_bits(x)} if x.numel() else {}
    in_dtype = {"in_dtype": x.dtype}
    values = {"rounding": options.rounding, "hadamard": "rht16" if options.hadamard else "none",
              "four_over_six": "none" if options.four_over_six is None else "adaptive"}
    amax_op = "amax_hadamard" if options.hadamard else "amax"
    amax_kernel = _kernel_for(amax_op, device, in_dtype, cols, pointers)
    kernel = _kernel_for("quantize_options", device, in_dtype, cols, pointers, values)

    plan = LaunchPlan()
    if row_scaled:
        row_amax = _amax(plan, rows) if rowwise else None
        col_amax = _amax(plan, cols) if columnwise else None
    elif options.hadamard:  # the two copies have their own tensor amax: of x, and of the transformed x.T
        row_amax = _amax(plan, 1) if rowwise else None
        col_amax = _amax(plan, 1)
    else:
        row_amax = col_amax = _amax(plan, 1)
    row_data, row_scale, col_data, col_scale = _plan_outputs(plan, rows, cols, rowwise, columnwise)
    sums = _plan_column_sums(plan, amax_kernel, x, column_sums, row_scaled)
    e4m3_max = 448.0 if options.four_over_six is None else 256.0
    plan.result = _result(rowwise, columnwise, row_data, row_scale, row_amax, col_data, col_scale, col_amax,
                          e4m3_max, sums[0])
    if rows == 0 or cols == 0:
        plan.zero(row_amax, col_amax, sums[0])
        return plan
    stride = x.stride(0) if rows > 1 else cols
    if options.hadamard:
        _plan_amax_hadamard(plan, amax_kernel, stride, rows, cols, row_scaled, row_amax, col_amax, sums)
    elif row_scaled:
        plan.launch(amax_kernel, INPUT, stride, rows, cols, row_amax, col_amax, None, *sums)
    else:
        plan.launch(amax_kernel, INPUT, stride, rows, cols, None, None, row_amax, *sums)
    plan.launch(kernel, INPUT, stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data, col_scale, RNG,
                1 if row_scaled else 0, 1 if tuple(block) == (16, 16) else 0, 1 if options.four_over_six == "mse" else 0)
    return plan


def _plan_hadamard(x: torch.Tensor, scaling: str, rowwise: bool, options: QuantizeOptions,
                   column_sums) -> LaunchPlan:
    """The columnwise copy with the Hadamard transform (and the rowwise copy, if asked for), 1x16 blocks, rounded
    as options say, in the plain kernels' structure: the columnwise-only quantize kernel transforms each tile in
    place. Before it, row scaling with a rowwise copy takes the row pass with the transform where the manifest
    declares one for x's dtype and rounding (16-bit, to nearest) and the rows fit its cluster (its cols_at_most),
    which also makes the rowwise copy; anything else takes the amax_hadamard pass and, for a rowwise copy, the
    rowwise-only kernel."""
    rows, cols = x.shape
    device, row_scaled = x.device, scaling == "row"
    pointers = {"x": row_start_bits(x)} if x.numel() else {}
    in_dtype = {"in_dtype": x.dtype}
    row_pass_kernel = None
    row_pass_values = {"hadamard": "rht16", "rounding": options.rounding}
    # (row_pass_limits(0) turns it off, as for the plain path)
    if row_scaled and rowwise and ROW_PASS_MAX_ROW_BYTES > 0 and _declares("row_pass", x, row_pass_values):
        row_pass_kernel = _kernel_for("row_pass", device, in_dtype, cols, pointers, row_pass_values)
        if cols > row_pass_kernel.constraints["cols_at_most"]:
            row_pass_kernel = None

    def quantize_kernel(direction, hadamard):
        return _kernel_for("quantize", device, in_dtype, cols, pointers, {
            "direction": direction, "scaling": scaling, "block": "1x16", "hadamard": hadamard,
            "rounding": options.rounding})

    col_kernel = quantize_kernel("columnwise", "rht16")
    plan = LaunchPlan()
    if row_scaled:
        row_amax = _amax(plan, rows) if rowwise else None
        col_amax = _amax(plan, cols)
    else:  # the two copies have their own tensor amax: of x, and of the transformed x.T
        row_amax = _amax(plan, 1) if rowwise else None
        col_amax = _amax(plan, 1)
    row_data, row_scale, col_data, col_scale = _plan_outputs(plan, rows, cols, rowwise, True)
    # (column sums come with tensor scaling, which never takes the row pass)
    amax_kernel = None if row_pass_kernel is not None else _kernel_for("amax_hadamard", device, in_dtype, cols, pointers)
    sums = _plan_column_sums(plan, amax_kernel, x, column_sums, row_scaled)
    plan.result = _result(rowwise, True, row_data, row_scale, row_amax, col_data, col_scale, col_amax, 448.0, sums[0])
    if rows == 0 or cols == 0:
        plan.zero(row_amax, col_amax, sums[0])
        return plan
    stride = x.stride(0) if rows > 1 else cols
    if row_pass_kernel is not None:
        plan.launch(row_pass_kernel, INPUT, stride, rows, cols, row_amax, col_amax, row_data, row_scale, None, None)
    else:
        _plan_amax_hadamard(plan, amax_kernel, stride, rows, cols, row_scaled, row_amax, col_amax, sums)
        if rowwise:
            plan.launch(quantize_kernel("rowwise", "none"), INPUT, stride, rows, cols, row_amax, None, row_data,
                        row_scale, None, None, RNG)
    plan.launch(col_kernel, INPUT, stride, rows, cols, None, col_amax, None, None, col_data, col_scale, RNG)
    return plan


def _plan_amax_hadamard(plan: LaunchPlan, kernel, stride: int, rows: int, cols: int, row_scaled: bool, row_amax,
                        col_amax, sums: tuple) -> None:
    """row_amax (of x) and col_amax (of the transformed x.T), either may be None: per row / per column with
    row scaling, else one each (the kernel's tensor outputs); sums: _plan_column_sums's arguments."""
    per_vector = (row_amax, col_amax) if row_scaled else (None, None)
    per_tensor = (None, None) if row_scaled else (row_amax, col_amax)
    plan.launch(kernel, INPUT, stride, rows, cols, *per_vector, *per_tensor, *sums)


@functools.lru_cache(maxsize=1024)
def _row_pass_workspace_bytes(kernel, device_index: int, rows: int, cols: int, columns: bool) -> int:
    """The row pass's workspace (one slice of column maxima per CTA): it depends only on the shape and on the
    device, whose multiprocessors the grid fills. workspace_size reads no pointer; it only tests col_amax for
    null, so a placeholder address stands for it."""
    col_amax_placeholder = 16 if columns else None
    with torch.cuda.device(device_index):
        return kernel.workspace_size(None, cols, rows, cols, None, col_amax_placeholder, None, None, None, None)


def gemm_alpha(a: NVFP4Data, b: NVFP4Data) -> float:
    return _alpha(a.e4m3_max, b.e4m3_max)


def _alpha(a_e4m3_max: float, b_e4m3_max: float) -> float:
    """The epilogue's fl(1 / (6 * a_e4m3_max * 6 * b_e4m3_max)), fl(1/2688^2) for standard operands: ctypes (and
    the launcher's packing) rounds the double quotient (of an exact double product) to fp32, which equals the fp32
    quotient."""
    return 1.0 / ((6.0 * a_e4m3_max) * (6.0 * b_e4m3_max))


def _scratch_operands(a: NVFP4Data, b: NVFP4Data, plan: "_GemmPlan") -> tuple:
    """Hopper over scratch: the packed codes and scales as they are (the library copies both operands' block-scaled
    values, exact in bf16, into its workspace), their row strides in bytes, and B's rows (the kernel runs on
    n_run, the rows past B's multiplying as zeros). Returns ((a codes, a scales, b codes, b scales), the
    row-stride arguments)."""
    a_data, a_scale, b_data, b_scale = a.data, a.scale, b.data, b.scale
    return ((a_data, a_scale, b_data, b_scale),
            (a_data.stride(0), a_scale.stride(0), b_data.stride(0), b_scale.stride(0), b.shape[0]))


def _blockscaled_operands(a: NVFP4Data, b: NVFP4Data, plan: "_GemmPlan") -> tuple:
    """Blackwell: the packed codes as they are and the scales in the 128x4 swizzled layout; B gets zero
    rows (codes and scales) up to n_run. Returns ((a codes, b codes, a scales, b scales: the order of its
    pointer arguments), no row-stride arguments). Never run: no Blackwell GPU was available."""
    n_run = plan.n_run
    for name, op in (("a", a), ("b", b)):
        if op.data.stride(0) != op.data.shape[1] or op.data.data_ptr() % 16:
            raise ValueError(f"{name}.data must be contiguous and 16-byte aligned for the Blackwell GEMM, got "
                             f"strides {tuple(op.data.stride())} at address {op.data.data_ptr():#x}")
    b_data, b_scale = b.data, b.scale.view(torch.uint8)
    if n_run != b.shape[0]:
        b_data = torch.cat([b_data, b_data.new_zeros(n_run - b.shape[0], b_data.shape[1])])
        b_scale = torch.cat([b_scale, b_scale.new_zeros(n_run - b.shape[0], b_scale.shape[1])])
    return (a.data, b_data, swizzle_scales(a.scale), swizzle_scales(b_scale)), ()


def _packed_operands(a: NVFP4Data, b: NVFP4Data, plan: "_GemmPlan") -> tuple:
    """The fused Hopper GEMM: codes and scales as they are (the scale bytes at their float8 addresses), with
    their row strides in bytes, and the number of CTAs that split K (the plan's, from select.split_k)."""
    a_data, a_scale, b_data, b_scale = a.data, a.scale, b.data, b.scale
    return ((a_data, a_scale, b_data, b_scale),
            (a_data.stride(0), a_scale.stride(0), b_data.stride(0), b_scale.stride(0), plan.split))


# How each GEMM family takes its operands.
_GEMM_OPERANDS = {
    "gemm_sm90": _scratch_operands,
    "gemm_sm100": _blockscaled_operands,
    "gemm_fused_dequant": _packed_operands,
    "gemm_fused_wgmma": _packed_operands,
    "gemm_packed_rs": _packed_operands,
}


class _GemmPlan:
    """A GEMM problem's kernel and, from its first launch on, the launch facts that depend only on the problem
    (its key in _GEMM_PLANS): the N the kernel runs on, how the operands go in, the K split of the kernels
    that read the packed operands, the workspace size. A query through gemm_kernel needs only the kernel."""

    __slots__ = ("kernel", "n_run", "d_alignment", "d_align", "operands", "split", "workspace_bytes", "launch_plans")

    def __init__(self, kernel):
        self.kernel = kernel
        self.n_run = None  # not prepared
        self.launch_plans = {}  # _gemm_launch's key -> LaunchPlan
    def prepare(self, a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype) -> None:
        kernel = self.kernel
        (m, k), n = a.shape, b.shape[0]
        # A kernel that needs D's rows aligned (a TMA epilogue: `d` in the manifest's alignment) needs N to be a
        # multiple of that many bytes of output: otherwise the GEMM runs on N rounded up, over zero rows of B
        # (and a padded column amax), into a padded D whose first n columns are kept.
        self.d_alignment = kernel.alignment.get("d", 1)  # bytes
        self.d_align = max(self.d_alignment // out_dtype.itemsize, 1)  # elements
        self.n_run = -(-n // self.d_align) * self.d_align
        self.operands = _GEMM_OPERANDS[kernel.family]
        self.split = None
        if self.operands is _packed_operands:
            facts = kernel.facts
            self.split = split_k(facts["tile_m"], facts["tile_n"], m, self.n_run, k // facts["tile_k"],
                                 _multiprocessors(a.device.index), facts["split_ctas_per_multiprocessor"])
        self.workspace_bytes = None  # asked of the library by the first launch plan, which has the arguments


_GEMM_PLANS = {}  # (device, out dtype, M, N, K, operand row strides and address residues) -> _GemmPlan
_TUNING_CACHES = {}  # device index -> autotune.TuningCache


# Caches of plans composed from the ones above (linear_steps.py): forgotten with them.
DEPENDENT_PLANS = []


def _forget_quantize_plans() -> None:
    _QUANTIZE_PLANS.clear()
    for plans in DEPENDENT_PLANS:
        plans.clear()


def clear_plans() -> None:
    """Forget every memoised kernel choice and launch plan: the next call of each kind of problem chooses
    again, reading FP4GEN_KERNEL and FP4GEN_AUTOTUNE afresh (measurements on disk stay)."""
    _PLANS.clear()
    _GEMM_PLANS.clear()
    _forget_quantize_plans()


def _tuning_cache(device: torch.device) -> autotune.TuningCache:
    cache = _TUNING_CACHES.get(device.index)
    if cache is None:
        kernels = autotune.kernel_set(load_manifest(), "gemm", _capability(device.index))
        cache = _TUNING_CACHES[device.index] = autotune.TuningCache(
            autotune.cache_dir(), torch.cuda.get_device_name(device.index), autotune.driver_version(), kernels)
    return cache


def _measuring_forbidden() -> bool:
    """During CUDA-graph capture a timed launch would be captured, not run; under torch.compile tracing
    nothing runs."""
    return torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()


def gemm_kernel(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, measure: bool = False,
                accumulate: bool = False):
    """The kernel fp4gen.gemm runs for these operands: FP4GEN_KERNEL's if it names one, else the autotuner's
    measured choice for their shape class (autotune.py), else the rule's (select.py). With measure=True (an
    eager fp4gen.gemm call) a shape class seen for the first time is measured; otherwise the rule serves
    until it is. FP4GEN_PRINT_CONFIGS=1 prints each choice."""
    return _gemm_plan(a, b, out_dtype, measure, accumulate).kernel


def _gemm_plan(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, measure: bool, accumulate: bool) -> _GemmPlan:
    """The problem's _GemmPlan, kept once its kernel choice is final (a rule's choice that a later eager call
    may replace by a measurement is not kept)."""
    key = _gemm_key(a, b, out_dtype)
    plan = _GEMM_PLANS.get(key)
    if plan is None:
        kernel, final = _choose_gemm_kernel(a, b, out_dtype, measure, accumulate)
        plan = _GemmPlan(kernel)
        if final:
            remember(_GEMM_PLANS, key, plan)
    return plan


def _gemm_key(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype) -> tuple:
    (m, k), n = a.shape, b.shape[0]
    a_data, a_scale, b_data, b_scale = a.data, a.scale, b.data, b.scale
    return (a_data.device.index, out_dtype, m, n, k, a_data.stride(0), a_scale.stride(0), b_data.stride(0),
            b_scale.stride(0), a_data.data_ptr() % 16, a_scale.data_ptr() % 16, b_data.data_ptr() % 16,
            b_scale.data_ptr() % 16)


def _choose_gemm_kernel(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, measure: bool,
                        accumulate: bool) -> tuple:
    """(the kernel gemm_kernel describes, whether the choice is final)."""
    (m, k), n = a.shape, b.shape[0]
    pointers = {"a_codes": row_start_bits(a.data), "a_scale": row_start_bits(a.scale),
                "b_codes": row_start_bits(b.data), "b_scale": row_start_bits(b.scale)}
    bucket = autotune.m_bucket(m)
    rule = _kernel_for("gemm", a.device, {"out_dtype": out_dtype}, k, pointers, rows=m, n=n)
    if forced_kernels() or not autotune.enabled():
        return rule, True
    cache = _tuning_cache(a.device)
    shape_class = (f"gemm|{_dtype_name(out_dtype)}|m{bucket}|n{n}|k{k}|align"
                   + ",".join(str(p % 16) for p in pointers.values()))
    name = cache.get(shape_class)
    if name is None:
        if not measure or _measuring_forbidden():
            return rule, False  # not remembered: an eager call measures it later
        problem = _problem("gemm", a.device, {"out_dtype": out_dtype}, k, pointers, rows=m, n=n)
        candidates = viable(problem, load_manifest())
        name, times = autotune.choose(
            candidates, lambda candidate: _time_gemm(load_kernel(candidate), a, b, out_dtype, accumulate))
        cache.put(shape_class, name, times)
        if os.environ.get("FP4GEN_PRINT_CONFIGS") == "1":
            measured = ", ".join(f"{c} {t:.4f} ms" if t is not None else f"{c} failed" for c, t in times.items())
            print(f"fp4gen: {problem.describe()} M class {bucket} N {n} K {k} -> {name} (measured: {measured})",
                  file=sys.stderr)
    return load_kernel(name), True


def _time_gemm(kernel, a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, accumulate: bool) -> float:
    """GPU milliseconds of one whole fp4gen.gemm call with `kernel`: its operand preparation (the scale swizzle of
    the Blackwell one; the other families' copies are launched by their own library call) and its launches, into a
    scratch output (C = that output when accumulating). The calls are captured in a CUDA graph and
    replayed, so host time does not count; best of three replays."""
    device = a.device
    into = torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype, device=device) if accumulate else None

    plan = _GemmPlan(kernel)

    def call():
        launches, inputs, _ = _gemm_launch(plan, a, b, out_dtype, into, accumulate)
        launches.run(_launch, inputs, device)

    with torch.cuda.device(device):
        call()  # eagerly first: one-time setup, and any launch error comes out here
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        reps = max(1, min(32, int(1.0 / max(start.elapsed_time(end), 1e-3))))  # about a millisecond a replay
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph, which also collects garbage and empties the
        # allocator's cache; thread-local, so other threads' CUDA calls are not disturbed
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(reps):
                    call()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        best = float("inf")
        for _ in range(3):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / reps)
        del graph
    return best


# A GEMM launch plan's inputs, in this order: the four operand tensors (as the family's operands function gives
# them), A's row amax, B's column amax, the bias (or None) and D when it is the caller's tensor (else None).
_GEMM_INPUTS = 8


def _gemm_launch(plan: _GemmPlan, a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, out, accumulate: bool,
                 bias=None) -> tuple:
    """(the launch plan of D = A @ B.T (+ bias) (+ C = out when accumulating), its inputs, D if it is not the
    launch plan's own buffer). D has plan.n_run columns: it is `out` where the kernel can write out directly,
    else a new tensor (a copy of out when accumulating) or the launch plan's buffer.

    The operands go in as the kernel family needs them: packed codes and scales for the Hopper GEMMs (which
    read them or copy them into scratch in their workspace), packed codes with swizzled scales for the Blackwell
    one. The inputs list keeps every tensor it points to referenced until the launch is queued."""
    m, n = a.shape[0], b.shape[0]
    if plan.n_run is None:
        plan.prepare(a, b, out_dtype)
    n_run = plan.n_run
    operands, operand_strides = plan.operands(a, b, plan)
    col_amax = b.amax.contiguous()
    if b.row_scaled and n_run != n:
        col_amax = torch.cat([col_amax, col_amax.new_ones(n_run - n)])
    if bias is not None:
        # the kernels take fp32, 16-byte aligned, n_run entries (the padded columns are dropped anyway)
        bias = bias.to(torch.float32).contiguous()
        if n_run != n:
            bias = torch.cat([bias, bias.new_zeros(n_run - n)])
        elif bias.data_ptr() % 16:
            bias = bias.clone()
    d = None
    if (n_run == n and out is not None and out.stride(1) == 1 and
            (plan.d_alignment == 1 or (out.stride(0) % plan.d_align == 0 and out.data_ptr() % plan.d_alignment == 0))):
        d = out
    elif accumulate:
        d = torch.empty(m, n_run, dtype=out_dtype, device=a.device)
        d[:, :n].copy_(out)
    launches = _gemm_launch_plan(plan, a, b, out_dtype, operand_strides, d.stride(0) if d is not None else None,
                                 bias is not None, accumulate)
    return launches, [*operands, a.amax.contiguous(), col_amax, bias, d], d


def _gemm_launch_plan(plan: _GemmPlan, a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, operand_strides: tuple,
                      d_stride, has_bias: bool, accumulate: bool) -> LaunchPlan:
    key = (operand_strides, d_stride, has_bias, accumulate, a.row_scaled, b.row_scaled, a.e4m3_max, b.e4m3_max)
    launches = plan.launch_plans.get(key)
    if launches is None:
        launches = plan.launch_plans[key] = _plan_gemm(plan, a.device, a.shape[0], a.shape[1], out_dtype, *key)
    return launches


def gemm_choice_pending(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype) -> bool:
    """Whether fp4gen.gemm's kernel choice for these operands is not final yet (no call kept a plan for them)."""
    return _gemm_key(a, b, out_dtype) not in _GEMM_PLANS


def gemm_plan_of_operands(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, has_bias: bool = False,
                          accumulate_into: torch.Tensor | None = None):
    """The GEMM's launch plan when its inputs can be the operands' own tensors (_GEMM_INPUTS: codes, scales,
    amaxes, the fp32 bias, and D = accumulate_into when accumulating), for composing into a larger plan; None
    where a call needs tensors made per call (a padded N, Blackwell's swizzled scales, an output the kernel
    cannot write directly) or where the kernel choice is not final yet (the autotuner has not measured the
    shape class: an eager fp4gen.gemm call of it does). D is the plan's first buffer unless accumulating."""
    plan = _GEMM_PLANS.get(_gemm_key(a, b, out_dtype))
    if plan is None:
        return None
    if plan.n_run is None:
        plan.prepare(a, b, out_dtype)
    if plan.n_run != b.shape[0] or plan.operands is _blockscaled_operands:
        return None
    if not (a.amax.is_contiguous() and b.amax.is_contiguous()):
        return None
    d_stride = None
    if accumulate_into is not None:
        out = accumulate_into
        if out.stride(1) != 1 or (plan.d_alignment > 1 and (out.stride(0) % plan.d_align
                                                            or out.data_ptr() % plan.d_alignment)):
            return None
        d_stride = out.stride(0)
    return _gemm_launch_plan(plan, a, b, out_dtype, plan.operands(a, b, plan)[1], d_stride, has_bias,
                             accumulate_into is not None)


def _plan_gemm(plan: _GemmPlan, device: torch.device, m: int, k: int, out_dtype: torch.dtype, operand_strides: tuple,
               d_stride, has_bias: bool, accumulate: bool, a_row_scaled: bool, b_row_scaled: bool, a_e4m3_max: float,
               b_e4m3_max: float) -> LaunchPlan:
    """The GEMM's one launch over _GEMM_INPUTS inputs; D is the first buffer when d_stride is None (no D input)."""
    n_run = plan.n_run
    launches = LaunchPlan(inputs=_GEMM_INPUTS)
    d = Slot(7) if d_stride is not None else launches.buffer(m, n_run, dtype=out_dtype)
    d_stride = d_stride if d_stride is not None else n_run
    args = (Slot(0), Slot(1), Slot(2), Slot(3), d, d, Slot(4), Slot(5), Slot(6) if has_bias else None,
            _alpha(a_e4m3_max, b_e4m3_max), 1.0 if accumulate else 0.0, m, n_run, k, *operand_strides, d_stride,
            d_stride, int(a_row_scaled), int(b_row_scaled))
    if plan.workspace_bytes is None:  # it depends on the shape, the split and the device, not on addresses
        with torch.cuda.device(device):
            plan.workspace_bytes = plan.kernel.workspace_size(*(16 if type(arg) is Slot else arg for arg in args), None)
    launches.launch(plan.kernel, *args, launches.buffer(plan.workspace_bytes) if plan.workspace_bytes else None)
    return launches


def gemm(a: NVFP4Data, b: NVFP4Data, out_dtype: torch.dtype, out, accumulate: bool, bias=None):
    """D = A @ B.T with the epilogue alpha * row_amax[i] * col_amax[j] (+ bias[j]) (+ C = out when
    accumulating), by the kernel gemm_kernel chooses (measuring a new shape class first when autotuning)."""
    (m, k), n = a.shape, b.shape[0]
    if m == 0 or n == 0:
        return out if out is not None else torch.empty(m, n, dtype=out_dtype, device=a.device)
    if k == 0:  # an empty sum (a weight gradient over no tokens): the epilogue's other terms alone
        if out is None:
            out = torch.zeros(m, n, dtype=out_dtype, device=a.device)
        elif not accumulate:
            out.zero_()
        return out.add_(bias) if bias is not None else out
    plan = _gemm_plan(a, b, out_dtype, True, accumulate)
    launches, inputs, d = _gemm_launch(plan, a, b, out_dtype, out, accumulate, bias)
    buffers = launches.run(_launch, inputs, a.device)
    if d is None:
        d = buffers[0]
    if out is None:
        return d if plan.n_run == n else d[:, :n]
    if d is not out:
        out.copy_(d[:, :n])
    return out
