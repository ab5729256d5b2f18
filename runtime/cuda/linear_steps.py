"""fp4gen.nn.Linear's eager steps as launch plans: the quantization of X (of dY) and the GEMMs that read it,
composed from the same plans that fp4gen.quantize and fp4gen.gemm run, so that one call into the C++ launcher
allocates every output and launches every kernel of a direction.

A small layer's eager step spends its time on the host: each separate call adds Python, argument checks and
operand containers around the launches. Two kinds of step:
- ForwardStep (forward_step): Y = X Wᵀ (+ bias) with X quantized on the way, for a forward without autograd;
- the launcher's LinearStep (training_step): the forward's plan and the backward's (BackwardStep), which the
  launcher's C++ autograd function runs, the backward's from its node in autograd's graph, so no Python runs
  between autograd and the launches.
A step is made at the second call of each kind (shapes, dtypes, alignment, recipe), once the first call's separate
calls have made its GEMM choices final, and kept. A call that a step cannot express gets None here and takes the
separate calls: a GEMM whose call needs tensors made per call (see ops.gemm_plan_of_operands) never has a step;
one whose kernel choice is not final yet (the autotuner has not measured its shape class: the separate calls do
that) gets one at a later call.
"""
from __future__ import annotations

import torch

from ..formats import BLOCK, NVFP4Data
from ..options import QuantizeOptions, column_sums_dtype
from ..rng import OFFSETS_PER_CALL
from . import launcher, ops
from .launch_plan import LaunchPlan, Slot, remember

_FORWARD = {}  # forward_step's key -> ForwardStep, or None where no plan can express the step
_TRAINING = {}  # training_step's key -> the launcher's LinearStep, or None
_SEEN = {}  # ("forward" or "training", key) of calls that came once and have no step yet


def _kept(steps: dict, kind: str, key, build):
    """steps[key], built by build() at the second call of its kind: a kind that comes once (a token count that
    never repeats) costs no build. None when no step expresses the call (remembered), or when build() raises
    _NotYet (tried again at the next call)."""
    try:
        return steps[key]
    except KeyError:
        pass
    if _SEEN.pop((kind, key), None) is None:
        remember(_SEEN, (kind, key), True)
        return None
    try:
        step = build()
    except _NotYet:
        remember(_SEEN, (kind, key), True)
        return None
    return remember(steps, key, step)


def _stand_in(plan: LaunchPlan, slots, device) -> tuple:
    """Tensors shaped like the plan's (data, scale, amax) buffers at `slots`, for choosing the GEMM that reads them:
    fresh allocations, aligned as the plan's own buffers are (never read)."""
    return tuple(torch.empty(plan.buffers[slot - plan.inputs][0], dtype=plan.buffers[slot - plan.inputs][1],
                             device=device) for slot in slots)


def _operand(plan: LaunchPlan, slots, e4m3_max: float, device) -> NVFP4Data:
    return NVFP4Data._made_by_fp4gen(*_stand_in(plan, slots, device), e4m3_max)


def _alignment(*tensors) -> tuple:
    return tuple(t.data_ptr() % 16 if t is not None else None for t in tensors)


class ForwardStep:
    """Y = X Wᵀ (+ bias) with X quantized on the way: inputs (x, no random state, W's (data, scale, amax), the
    bias or None); run() returns (y, X's columnwise (data, scale, amax) or None); run_forward_step() runs it in
    one call into the C++ launcher (native: the plan there, kernels: their names, for errors)."""

    __slots__ = ("plan", "y", "x_col", "native", "kernels")

    def run(self, x2d: torch.Tensor, w_row: tuple, bias) -> tuple:
        buffers = self.plan.run(ops._launch, [x2d, None, *w_row, bias], x2d.device)
        x_col = tuple(self.plan.tensor(buffers, slot) for slot in self.x_col) if self.x_col else None
        return self.plan.tensor(buffers, self.y), x_col


def run_forward_step(step: ForwardStep, x: torch.Tensor, w_row: tuple, bias) -> torch.Tensor:
    """Y [..., N] of a forward without autograd for x [..., K] (the [tokens, K] the step was made for, in any
    contiguous shape of the same memory): one call into the C++ launcher."""
    device = x.device.index if x.is_cuda else -1  # -1: plans of host functions (the CPU tests')
    return launcher.module().forward_step(step.native, step.kernels, step.y, x, [*w_row, bias], device)


def forward_step(x2d: torch.Tensor, w_row: tuple, recipe, need_wgrad: bool, bias, x_e4m3_max: float,
                 w_e4m3_max: float):
    """The ForwardStep of this kind of call, or None (then the caller makes the separate calls)."""
    key = (x2d.device.index, x2d.dtype, *x2d.shape, x2d.stride(0), x2d.data_ptr() % 16, tuple(w_row[0].shape),
           w_row[2].shape[0], _alignment(*w_row, bias), need_wgrad, recipe)
    return _kept(_FORWARD, "forward", key,
                 lambda: _build_forward(x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max))


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
    gemm = _gemm(_operand(quantize, row, x_e4m3_max, device), w, x2d.dtype, bias is not None)
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
    _share(plan, [step.y], step.x_col)
    step.native, step.kernels = plan.native(), _names(plan)
    return step


class BackwardStep:
    """The backward's plan: dY quantized, then dX = dY W and dW = dYᵀ X (or dW accumulated into main_grad); inputs
    (dy, the random state, W's columnwise triple, X's columnwise triple, main_grad or None); dx, dw and sums are
    the slots of dX, dW and dY's column sums (None where the step makes none)."""

    __slots__ = ("plan", "dx", "dw", "sums")


def training_step(x2d: torch.Tensor, weight: torch.Tensor, w_row: tuple, w_col, recipe, needs_x_grad: bool,
                  need_wgrad: bool, epilogue_bias, bias_dtype, main_grad, x_e4m3_max: float, w_e4m3_max: float):
    """The launcher's LinearStep for this kind of training call, or None (then the caller makes the separate
    calls). bias_dtype: the bias parameter's dtype, None without a bias. w_col None: the layer keeps no
    columnwise copy of W, and the step's backward quantizes it from the weight (which must then be contiguous)."""
    weight_in_backward = w_col is None and needs_x_grad
    if weight_in_backward and not weight.is_contiguous():
        return None  # the separate calls quantize a contiguous copy of it
    key = (x2d.device.index, x2d.dtype, *x2d.shape, x2d.stride(0), x2d.data_ptr() % 16, tuple(w_row[0].shape),
           w_row[2].shape[0], _alignment(*w_row, *(w_col or ()), epilogue_bias, main_grad),
           main_grad.stride() if main_grad is not None else None, needs_x_grad, need_wgrad, bias_dtype,
           weight.dtype, w_col is None, weight.data_ptr() % 16 if weight_in_backward else None, recipe)
    return _kept(_TRAINING, "training", key,
                 lambda: _build_training(x2d, weight, w_row, w_col, recipe, needs_x_grad, need_wgrad, epilogue_bias,
                                         bias_dtype, main_grad, x_e4m3_max, w_e4m3_max))


def run_training_step(step, x: torch.Tensor, weight: torch.Tensor, bias, w_row: tuple, w_col: tuple,
                      epilogue_bias, main_grad, rng_state) -> torch.Tensor:
    """Y [..., N] of the step for x [..., K] (the [tokens, K] the step was made for, in any contiguous shape of the
    same memory), with autograd's node for its backward recorded when x, weight or bias requires grad (dX comes back
    shaped as x). rng_state: the random state's tensor with stochastic rounding, else None."""
    device = x.device.index if x.is_cuda else -1  # -1: plans of host functions (the CPU tests')
    return launcher.module().linear_step(step, x, weight, bias,
                                         [*w_row, *(w_col or (None,) * 3), epilogue_bias, main_grad, rng_state],
                                         device)


def _build_training(x2d, weight, w_row, w_col, recipe, needs_x_grad, need_wgrad, epilogue_bias, bias_dtype, main_grad,
                    x_e4m3_max, w_e4m3_max):
    forward = _build_forward(x2d, w_row, recipe, need_wgrad, epilogue_bias, x_e4m3_max, w_e4m3_max)
    if forward is None:
        return None
    weight_plan = None
    if w_col is None and needs_x_grad:  # W's columnwise copy made in backward, as nn.quantize_weight makes it
        options = QuantizeOptions("nearest", None, False, recipe.weight_four_over_six)
        weight_plan = ops.quantize_plan(weight, "tensor", tuple(recipe.weight_block), False, True, options)
        w_col = _stand_in(weight_plan, weight_plan.result[1], x2d.device)
    # db from the pass that quantizes dY where that pass has an amax pass of its own (tensor-scaled gradients);
    # else the launcher sums dY itself
    sums_with_dy = bias_dtype is not None and recipe.gradient_scaling == "tensor"
    # dY as autograd hands it over: contiguous, at an aligned address (the launcher copies any other into one)
    dy = torch.empty(x2d.shape[0], w_row[0].shape[0], dtype=x2d.dtype, device=x2d.device)
    x_col = _stand_in(forward.plan, forward.x_col, x2d.device) if forward.x_col else None
    sums_dtype = column_sums_dtype(bias_dtype, dy.dtype) if sums_with_dy else None
    backward = _build_backward(dy, w_col, x_col, main_grad, recipe, needs_x_grad, need_wgrad, sums_dtype,
                               x2d.dtype, weight.dtype, x_e4m3_max, w_e4m3_max)
    if backward is None:
        return None
    return launcher.module().LinearStep(
        forward.plan.native(), _names(forward.plan), forward.y, list(forward.x_col or ()), backward.plan.native(),
        _names(backward.plan), _slot(backward.dx), _slot(backward.dw), _slot(backward.sums),
        OFFSETS_PER_CALL if recipe.gradient_rounding == "stochastic" else 0,
        0 if bias_dtype is None else 1 if sums_with_dy else 2, str(bias_dtype or torch.float32).replace("torch.", ""),
        weight_plan.native() if weight_plan else None, _names(weight_plan) if weight_plan else [],
        list(weight_plan.result[1]) if weight_plan else [])


def _names(plan: LaunchPlan) -> list:
    return [kernel.name for kernel, _, _ in plan.launches]


def _slot(slot) -> int:
    return -1 if slot is None else slot


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
        gemm = _gemm(_operand(quantize, row, dy_e4m3_max, device), w, x_dtype)
        if gemm is None:
            return None
        g = plan.include(gemm, [q[row[0]], q[row[1]], Slot(2), Slot(3), q[row[2]], Slot(4), None, None])
        step.dx = g[gemm.inputs]
    if need_wgrad:  # wgrad: (dY columnwise = dYᵀ [N, M]) x (X columnwise = Xᵀ [K, M])
        x = NVFP4Data._made_by_fp4gen(*x_col, x_e4m3_max)
        a = _operand(quantize, col, dy_e4m3_max, device)
        gemm = _gemm(a, x, torch.float32 if main_grad is not None else w_dtype, accumulate_into=main_grad)
        if gemm is None:
            return None
        g = plan.include(gemm, [q[col[0]], q[col[1]], Slot(5), Slot(6), q[col[2]], Slot(7), None,
                                Slot(8) if main_grad is not None else None])
        step.dw = g[gemm.inputs] if main_grad is None else None
    step.plan = plan
    _share(plan, [step.dx, step.dw, step.sums])
    return step


def _share(plan: LaunchPlan, outputs: list, together=None) -> None:
    """One allocation for the step's scratch (every buffer but its outputs: X's or dY's copies the GEMMs read, their
    workspaces), one for `together` (X's columnwise copy, saved for backward), and one for each other output."""
    kept = set(outputs) | set(together or ())
    plan.share(*(slot for slot in range(plan.inputs, plan.inputs + len(plan.buffers)) if slot not in kept))
    if together:
        plan.share(*together)


# forgotten with the plans they are made of (ops.clear_plans, ops.row_pass_limits)
ops.DEPENDENT_PLANS += [_FORWARD, _TRAINING, _SEEN]
