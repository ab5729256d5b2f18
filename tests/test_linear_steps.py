"""fp4gen.cuda.linear_steps' composed plans on CPU. The quantize plans are stand-ins that record their launches;
the GEMMs' launch plans are made by ops._plan_gemm itself, so their arguments are in the kernels' C order. Each test
checks which tensor every pointer of the composed step's launches comes from."""
from types import SimpleNamespace

import pytest
import torch

import fp4gen
from fp4gen import reference
from fp4gen.cuda import linear_steps, ops
from fp4gen.cuda.launch_plan import INPUT, RNG, LaunchPlan
from fp4gen.formats import NVFP4Data
from fp4gen.options import QuantizeOptions
from fp4gen.rng import RNGState

# positions of the GEMM families' C parameters
A, A_SCALE, B, B_SCALE, D, C, A_AMAX, B_AMAX, BIAS = range(9)


@pytest.fixture
def launches(monkeypatch):
    """The (kernel, arguments) of each launch, in order; GEMM choices final unless `pending` holds True."""
    calls, state = [], SimpleNamespace(pending=False, expressible=True)

    def quantize_plan(x, scaling, block, rowwise, columnwise, options, column_sums=False):
        rows, cols = x.shape
        plan = LaunchPlan()

        def copy(r, c):
            return (plan.buffer(r, c // 2), plan.buffer(r, c // 16, dtype=torch.float8_e4m3fn),
                    plan.buffer(r if scaling == "row" else 1, dtype=torch.float32))
        row = copy(rows, cols) if rowwise else None
        col = copy(cols, rows) if columnwise else None
        sums = plan.buffer(cols, dtype=torch.float32) if column_sums else None
        plan.launch("quantize", INPUT, RNG, *(row or (None,) * 3), *(col or (None,) * 3), sums)
        plan.result = (row, col, 448.0, sums)
        return plan

    def gemm_plan_of_operands(a, b, out_dtype, has_bias=False, accumulate_into=None):
        if not state.expressible:
            return None
        plan = SimpleNamespace(n_run=b.shape[0], workspace_bytes=0, kernel="gemm")
        d_stride = accumulate_into.stride(0) if accumulate_into is not None else None
        return ops._plan_gemm(plan, a.device, a.shape[0], a.shape[1], out_dtype, (0,) * 5, d_stride, has_bias,
                              accumulate_into is not None, a.row_scaled, b.row_scaled, a.e4m3_max, b.e4m3_max)

    monkeypatch.setattr(ops, "quantize_plan", quantize_plan)
    monkeypatch.setattr(ops, "gemm_plan_of_operands", gemm_plan_of_operands)
    monkeypatch.setattr(ops, "gemm_choice_pending", lambda a, b, out_dtype: state.pending)
    monkeypatch.setattr(ops, "_launch", lambda kernel, device, *args: calls.append((kernel, args)))
    monkeypatch.setattr(linear_steps, "_FORWARD", {})
    monkeypatch.setattr(linear_steps, "_BACKWARD", {})
    return SimpleNamespace(calls=calls, state=state)


def _operand(rows, cols, amaxes):
    return (torch.zeros(rows, cols // 2, dtype=torch.uint8), torch.zeros(rows, cols // 16, dtype=torch.float8_e4m3fn),
            torch.ones(amaxes))


def _ptr(t):
    return t.data_ptr() if t is not None else None


def test_the_forward_step_feeds_the_quantized_x_and_the_weight_to_the_gemm(launches):
    x, w_row, bias = torch.randn(32, 64), _operand(48, 64, 1), torch.zeros(48)
    step = linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, bias, 448.0, 448.0)
    y, x_col = step.run(x, w_row, bias)
    (quantize, q), (gemm, g) = launches.calls
    assert (quantize, gemm) == ("quantize", "gemm")
    assert q[0] == x.data_ptr() and q[1] is None  # no random state in the forward
    row_data, row_scale, row_amax, col_data, col_scale, col_amax = q[2:8]
    assert (g[A], g[A_SCALE], g[A_AMAX]) == (row_data, row_scale, row_amax)
    assert (g[B], g[B_SCALE], g[B_AMAX]) == tuple(t.data_ptr() for t in w_row)
    assert g[BIAS] == bias.data_ptr() and g[D] == g[C] == y.data_ptr()
    assert tuple(y.shape) == (32, 48) and y.dtype == x.dtype
    assert [t.data_ptr() for t in x_col] == [col_data, col_scale, col_amax]
    # the next step of the same kind reuses the plan, with its own buffers
    launches.calls.clear()
    again = linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, bias, 448.0, 448.0)
    assert again is step
    y2, _ = step.run(x, w_row, bias)
    assert launches.calls[1][1][D] == y2.data_ptr() != y.data_ptr()


def test_a_forward_without_wgrad_or_bias_makes_no_columnwise_copy_and_passes_a_null_bias(launches):
    x, w_row = torch.randn(32, 64), _operand(48, 64, 1)
    y, x_col = linear_steps.forward_step(x, w_row, fp4gen.Recipe(), False, None, 448.0, 448.0).run(x, w_row, None)
    (_, q), (_, g) = launches.calls
    assert x_col is None and q[5:8] == (None, None, None)
    assert g[BIAS] is None and g[D] == y.data_ptr()


def test_the_backward_step_feeds_dys_copies_and_the_saved_operands_to_dgrad_and_wgrad(launches):
    dy, rng = torch.randn(32, 48), torch.zeros(2, dtype=torch.int64)
    w_col, x_col = _operand(64, 48, 1), _operand(64, 32, 64)  # Wᵀ [K, N]; Xᵀ [K, M] with per-column amaxes
    main_grad = torch.zeros(48, 64)
    step = linear_steps.backward_step(dy, w_col, x_col, main_grad, fp4gen.Recipe(stochastic_rounding=True), True,
                                      True, True, torch.float32, torch.float32, 448.0, 448.0)
    dx, dw, sums = step.run(dy, rng, w_col, x_col, main_grad)
    (_, q), (dgrad, dg), (wgrad, wg) = launches.calls
    assert q[0] == dy.data_ptr() and q[1] == rng.data_ptr()
    row_data, row_scale, row_amax, col_data, col_scale, col_amax, sums_ptr = q[2:9]
    assert (dg[A], dg[A_SCALE], dg[A_AMAX]) == (row_data, row_scale, row_amax)
    assert (dg[B], dg[B_SCALE], dg[B_AMAX]) == tuple(t.data_ptr() for t in w_col)
    assert dg[BIAS] is None and dg[D] == dg[C] == dx.data_ptr() and tuple(dx.shape) == (32, 64)
    assert (wg[A], wg[A_SCALE], wg[A_AMAX]) == (col_data, col_scale, col_amax)
    assert (wg[B], wg[B_SCALE], wg[B_AMAX]) == tuple(t.data_ptr() for t in x_col)
    assert wg[D] == wg[C] == main_grad.data_ptr() and dw is None  # accumulated into main_grad
    assert sums.data_ptr() == sums_ptr


def test_a_backward_without_dgrad_launches_the_wgrad_only_into_a_new_gradient(launches):
    dy = torch.randn(32, 48)
    w_col, x_col = _operand(64, 48, 1), _operand(64, 32, 1)
    step = linear_steps.backward_step(dy, w_col, x_col, None, fp4gen.Recipe(), False, True, False,
                                      torch.bfloat16, torch.bfloat16, 448.0, 448.0)
    dx, dw, sums = step.run(dy, None, w_col, x_col, None)
    (_, q), (_, wg) = launches.calls
    assert dx is None and sums is None and q[2:5] == (None, None, None)
    assert wg[D] == wg[C] == dw.data_ptr() and tuple(dw.shape) == (48, 64) and dw.dtype == torch.bfloat16


def test_a_step_waits_for_final_gemm_choices_and_remembers_one_no_plan_can_express(launches):
    x, w_row = torch.randn(32, 64), _operand(48, 64, 1)
    launches.state.pending, launches.state.expressible = True, False
    assert linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, None, 448.0, 448.0) is None
    assert linear_steps._FORWARD == {}  # not remembered: a later step tries again
    launches.state.pending = False
    assert linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, None, 448.0, 448.0) is None
    assert list(linear_steps._FORWARD.values()) == [None]  # remembered: the separate calls from now on
    launches.state.expressible = True
    assert linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, None, 448.0, 448.0) is None


class ReferenceSteps:
    """Stands for linear_steps in fp4gen.nn on CPU: steps that compute what the real ones launch (X's or dY's
    quantization, then the GEMMs) with the reference backend, so that the layer's handling of a step's outputs
    (what it saves, returns and advances) can be compared with its separate calls."""

    def __init__(self):
        self.ran = []

    def forward_step(self, x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max):
        steps = self

        class Step:
            def run(self, x2d, w_row, bias):
                steps.ran.append("forward")
                options = QuantizeOptions("nearest", None, recipe.hadamard_wgrad and need_wgrad,
                                          recipe.activation_four_over_six)
                row, col = reference.quantize(x2d, recipe.activation_scaling, (1, 16), True, need_wgrad, options)
                y = reference.gemm(row, NVFP4Data._made_by_fp4gen(*w_row, w_e4m3_max), x2d.dtype, None, False, bias)
                return y, ((col.data, col.scale, col.amax) if col is not None else None)
        return Step()

    def backward_step(self, dy, w_col, x_col, main_grad, recipe, needs_x_grad, need_wgrad, column_sums, x_dtype,
                      w_dtype, x_e4m3_max, w_e4m3_max):
        steps = self

        class Step:
            def run(self, dy, rng_state, w_col, x_col, main_grad):
                steps.ran.append("backward")
                rng = RNGState.from_tensor(rng_state) if rng_state is not None else None
                options = QuantizeOptions(recipe.gradient_rounding, rng, recipe.hadamard_wgrad and need_wgrad, None)
                out = reference.quantize(dy, recipe.gradient_scaling, (1, 16), needs_x_grad, need_wgrad, options,
                                         column_sums=column_sums)
                row, col, sums = out[0], out[1], out[2] if column_sums else None
                dx = dw = None
                if needs_x_grad:
                    dx = reference.gemm(row, NVFP4Data._made_by_fp4gen(*w_col, w_e4m3_max), x_dtype, None, False)
                if need_wgrad:
                    x = NVFP4Data._made_by_fp4gen(*x_col, x_e4m3_max)
                    if main_grad is not None:
                        reference.gemm(col, x, torch.float32, main_grad, True)
                    else:
                        dw = reference.gemm(col, x, w_dtype, None, False)
                return dx, dw, sums
        return Step()


LAYER_CASES = [
    dict(),
    dict(recipe=fp4gen.Recipe(row_scaled_activation=False)),
    dict(recipe=fp4gen.Recipe(stochastic_rounding=True)),
    dict(recipe=fp4gen.Recipe(stochastic_rounding=True, gradient_scaling="row")),
    dict(recipe=fp4gen.Recipe(four_over_six="all", hadamard_wgrad=False)),
    dict(bias=False, main_grad=True),
    dict(dtype=torch.bfloat16, frozen=True),
    dict(dtype=torch.float32),
    dict(inference=True),
]


def linear_steps_outputs(case: dict, device: str, steps: int) -> list:
    """Every output of `steps` eager training steps (or inference forwards) of a fresh 64 -> 48 fp4gen.nn.Linear
    made as `case` says (bias, recipe, main_grad, frozen, inference, dtype), on fixed random data: outputs, input
    and parameter gradients, the main grad, and the default random state at the end."""
    dtype = case.get("dtype", torch.bfloat16 if device == "cuda" else torch.float32)
    torch.manual_seed(3)
    layer = fp4gen.nn.Linear(64, 48, bias=case.get("bias", True), device=device, dtype=dtype,
                             recipe=case.get("recipe"), accumulate_main_grad=case.get("main_grad", False))
    layer.weight.requires_grad_(not case.get("frozen", False))
    if case.get("main_grad"):
        layer.weight.main_grad = torch.zeros(48, 64, device=device)
    rng = fp4gen.RNGState.default(layer.weight.device)
    rng.reset(5)
    outputs = []
    for _ in range(steps):
        x = torch.randn(32, 64, device=device, dtype=dtype, requires_grad=not case.get("inference", False))
        if case.get("inference"):
            with torch.no_grad():
                outputs.append(layer(x))
            continue
        y = layer(x)
        y.backward(torch.randn_like(y))
        outputs += [y, x.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        if case.get("main_grad"):
            outputs.append(layer.weight.main_grad.clone())
    return outputs + [rng.tensor.clone()]  # advanced alike


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_linear_uses_a_steps_outputs_as_it_uses_its_separate_calls(monkeypatch, case):
    from fp4gen import nn
    separate = linear_steps_outputs(case, "cpu", 2)
    steps = ReferenceSteps()
    monkeypatch.setattr(nn, "_step_plans", lambda ops, t: steps)
    stepped = linear_steps_outputs(case, "cpu", 2)
    assert "forward" in steps.ran and ("backward" in steps.ran or case.get("inference"))
    assert len(stepped) == len(separate)
    for ours, theirs in zip(stepped, separate):
        assert torch.equal(ours, theirs)
