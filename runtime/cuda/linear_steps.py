"""fp4gen.nn.Linear's eager forward and backward, each as one launch plan: the quantization of X (of dY) and the
GEMMs that read it, composed from the same plans that fp4gen.quantize and fp4gen.gemm run, so one call into the
C++ launcher allocates every output and launches every kernel of the step.

A small layer's eager step spends its time on the host: each separate call adds Python, argument checks and
operand containers around the launches. A step plan is made at the first step of each kind (shapes, dtypes,
alignment, recipe), after that step ran the separate calls (which also let the autotuner measure its GEMMs),
and is kept. A step that a plan cannot express returns None here and takes the separate calls: a GEMM whose call needs
tensors made per call (see ops.gemm_plan_of_operands) never has a step plan; one whose kernel choice is not
final yet (the autotuner has not measured its shape class) gets one at a later step, once it is.
"""
from __future__ import annotations

import torch

from ..formats import BLOCK, NVFP4Data
from ..options import QuantizeOptions
from . import ops
from .launch_plan import LaunchPlan, Slot, remember

_FORWARD = {}  # forward_step's key -> ForwardStep, or None where no plan can express the step
_BACKWARD = {}  # backward_step's key -> BackwardStep, or None


def _stand_in(plan: LaunchPlan, slots, e4m3_max: float, device) -> NVFP4Data:
    """An operand shaped like the plan's (data, scale, amax) buffers at `slots`, for choosing the GEMM that reads
    them: fresh allocations, aligned as the plan's own buffers are (never read)."""
    data, scale, amax = (torch.empty(plan.buffers[slot - plan.inputs][0], dtype=plan.buffers[slot - plan.inputs][1],
                                     device=device) for slot in slots)
    return NVFP4Data._made_by_fp4gen(data, scale, amax, e4m3_max)


def _alignment(*tensors) -> tuple:
    return tuple(t.data_ptr() % 16 if t is not None else None for t in tensors)


class ForwardStep:
    """Y = X Wᵀ (+ bias) with X quantized on the way: inputs (x, w data, w scale, w amax, bias or None); run()
    returns (y, X's columnwise (data, scale, amax) or None)."""

    __slots__ = ("plan", "y", "x_col")

    def run(self, x2d: torch.Tensor, w_row: tuple, bias) -> tuple:
        buffers = self.plan.run(ops._launch, [x2d, None, *w_row, bias], x2d.device)
        x_col = tuple(self.plan.tensor(buffers, slot) for slot in self.x_col) if self.x_col else None
        return self.plan.tensor(buffers, self.y), x_col


def forward_step(x2d: torch.Tensor, w_row: tuple, recipe, need_wgrad: bool, bias, x_e4m3_max: float,
                 w_e4m3_max: float):
    """The ForwardStep of this kind of call, or None (then the caller makes the separate calls)."""
    key = (x2d.device.index, x2d.dtype, *x2d.shape, x2d.stride(0), x2d.data_ptr() % 16, tuple(w_row[0].shape),
           w_row[2].shape[0], _alignment(*w_row, bias), need_wgrad, recipe)
    try:
        return _FORWARD[key]
    except KeyError:
        pass
    try:
        step = _build_forward(x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max)
    except _NotYet:
        return None
    return remember(_FORWARD, key, step)


class _NotYet(Exception):
    """A GEMM's kernel choice is not final yet: build the step at a later call, once it is."""


def _gemm(a: NVFP4Data, b: NVFP4Data, out_dtype, has_bias: bool = False, accumulate_into=None):
    """The GEMM's launch plan, or None where a plan cannot express it (the step then never takes one)."""
    plan = ops.gemm_plan_of_operands(a, b, out_dtype, has_bias, accumulate_into)
    if plan is None and ops.gemm_choice_pending(a, b, out_dtype):
        raise _NotYet
    return plan


def _build_forward(x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max):
    device = x2d.device
    options = QuantizeOptions("nearest", None, recipe.hadamard_wgrad and need_wgrad, recipe.activation_four_over_six)
    quantize = ops.quantize_plan(x2d, recipe.activation_scaling, (1, BLOCK), True, need_wgrad, options)
    row, col, _, _ = quantize.result
    w = NVFP4Data._made_by_fp4gen(*w_row, w_e4m3_max)
    gemm = _gemm(_stand_in(quantize, row, x_e4m3_max, device), w, x2d.dtype, bias is not None)
    if gemm is None:
        return None
    plan = LaunchPlan(inputs=6)  # x, the random state (none), W's (data, scale, amax), the bias
    q = plan.include(quantize, [Slot(0), Slot(1)])
    # the GEMM's inputs (ops._GEMM_INPUTS): A's codes and scales, B's codes and scales, A's and B's amaxes, bias, D
    g = plan.include(gemm, [q[row[0]], q[row[1]], Slot(2), Slot(3), q[row[2]], Slot(4),
                            Slot(5) if bias is not None else None, None])
    step = ForwardStep()
    step.plan, step.y = plan, g[gemm.inputs]  # D: the GEMM's first buffer
    step.x_col = tuple(q[slot] for slot in col) if col is not None else None
    return step


class BackwardStep:
    """dY quantized, then dX = dY W and dW = dYᵀ X (or dW accumulated into main_grad): inputs (dy, the random
    state, W's columnwise triple, X's columnwise triple, main_grad or None); run() returns (dx or None, dw or
    None, dY's column sums or None)."""

    __slots__ = ("plan", "dx", "dw", "sums")

    def run(self, dy: torch.Tensor, rng_state, w_col: tuple, x_col: tuple, main_grad) -> tuple:
        buffers = self.plan.run(ops._launch, [dy, rng_state, *w_col, *(x_col or (None,) * 3), main_grad], dy.device)
        return tuple(self.plan.tensor(buffers, slot) for slot in (self.dx, self.dw, self.sums))


def backward_step(dy: torch.Tensor, w_col: tuple, x_col, main_grad, recipe, needs_x_grad: bool, need_wgrad: bool,
                  column_sums: bool, x_dtype, w_dtype, x_e4m3_max: float, w_e4m3_max: float):
    """The BackwardStep of this kind of call, or None (then the caller makes the separate calls)."""
    key = (dy.device.index, dy.dtype, *dy.shape, dy.stride(0), dy.data_ptr() % 16, tuple(w_col[0].shape),
           _alignment(*w_col, *(x_col or ()), main_grad), main_grad.stride() if main_grad is not None else None,
           needs_x_grad, need_wgrad, column_sums, x_dtype, w_dtype, x_e4m3_max, w_e4m3_max, recipe)
    try:
        return _BACKWARD[key]
    except KeyError:
        pass
    try:
        step = _build_backward(dy, w_col, x_col, main_grad, recipe, needs_x_grad, need_wgrad, column_sums, x_dtype,
                               w_dtype, x_e4m3_max, w_e4m3_max)
    except _NotYet:
        return None
    return remember(_BACKWARD, key, step)


def _build_backward(dy, w_col, x_col, main_grad, recipe, needs_x_grad, need_wgrad, column_sums, x_dtype, w_dtype,
                    x_e4m3_max, w_e4m3_max):
    device = dy.device
    options = QuantizeOptions(recipe.gradient_rounding, None, recipe.hadamard_wgrad and need_wgrad, None)
    quantize = ops.quantize_plan(dy, recipe.gradient_scaling, (1, BLOCK), needs_x_grad, need_wgrad, options,
                                 column_sums)
    row, col, dy_e4m3_max, sums = quantize.result
    plan = LaunchPlan(inputs=9)  # dy, the random state, W's columnwise triple, X's columnwise triple, main_grad
    q = plan.include(quantize, [Slot(0), Slot(1)])
    step = BackwardStep()
    step.dx = step.dw = None
    step.sums = q[sums] if sums is not None else None
    if needs_x_grad:  # dgrad: dY [M, N] x (W columnwise = Wᵀ [K, N])
        w = NVFP4Data._made_by_fp4gen(*w_col, w_e4m3_max)
        gemm = _gemm(_stand_in(quantize, row, dy_e4m3_max, device), w, x_dtype)
        if gemm is None:
            return None
        g = plan.include(gemm, [q[row[0]], q[row[1]], Slot(2), Slot(3), q[row[2]], Slot(4), None, None])
        step.dx = g[gemm.inputs]
    if need_wgrad:  # wgrad: (dY columnwise = dYᵀ [N, M]) x (X columnwise = Xᵀ [K, M])
        x = NVFP4Data._made_by_fp4gen(*x_col, x_e4m3_max)
        a = _stand_in(quantize, col, dy_e4m3_max, device)
        gemm = _gemm(a, x, torch.float32 if main_grad is not None else w_dtype, accumulate_into=main_grad)
        if gemm is None:
            return None
        g = plan.include(gemm, [q[col[0]], q[col[1]], Slot(5), Slot(6), q[col[2]], Slot(7), None,
                                Slot(8) if main_grad is not None else None])
        step.dw = g[gemm.inputs] if main_grad is None else None
    step.plan = plan
    return step


# forgotten with the plans they are made of (ops.clear_plans, ops.row_pass_limits)
ops.DEPENDENT_PLANS += [_FORWARD, _BACKWARD]
