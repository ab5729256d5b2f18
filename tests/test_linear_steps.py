"""fp4gen.cuda.linear_steps on CPU: the composed plans of fp4gen.nn.Linear's steps, and the C++ launcher's autograd
function that runs a training step (LinearStep), with host functions standing for the kernels.

The quantize plans are stand-ins; the GEMMs' launch plans are made by ops._plan_gemm itself, so their arguments
are in the kernels' C order. The pointer tests check which tensor every pointer of a step's launches comes from.
The layer tests run fp4gen.nn.Linear over steps whose host "kernels" compute with the reference backend, and
compare every output with the layer's separate calls."""
import ctypes
import math
import struct
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint

import fp4gen
from fp4gen import reference
from fp4gen.cuda import launcher, library, linear_steps, ops
from fp4gen.cuda.launch_plan import INPUT, RNG, LaunchPlan, Slot
from fp4gen.errors import KernelError
from fp4gen.formats import NVFP4Data
from fp4gen.options import QuantizeOptions, column_sums_dtype
from fp4gen.rng import RNGState

# positions of the GEMM families' C parameters
A, A_SCALE, B, B_SCALE, D, C, A_AMAX, B_AMAX, BIAS = range(9)
RUN_PACKED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p)


class HostKernel:
    """Stands for a kernel library: its packed entry (a host function the launcher calls) appends (name, words) to
    `calls`, runs body(words) if given, and returns `status`. Python launches record the same words."""

    def __init__(self, name: str, calls: list, body=None, status: int = 0):
        self.name, self.calls, self.body, self.status = name, calls, body, status
        self._arity = None

        def run_packed(words, stream):
            return self._run([words[i] for i in range(self._arity)])
        self._entry = RUN_PACKED(run_packed)  # kept referenced: the launcher holds only its address
        self.run_packed_address = ctypes.cast(self._entry, ctypes.c_void_p).value

    def pack(self, args) -> list:
        """Floats as their fp32 bits, None as 0, the rest as 64-bit words (as library.Kernel.pack does by kind)."""
        self._arity = len(args)
        return [struct.unpack("<I", struct.pack("<f", a))[0] if isinstance(a, float) else int(a or 0) % 2**64
                for a in args]

    def _run(self, words) -> int:
        self.calls.append((self.name, words))
        if self.body is not None:
            self.body(words)
        return self.status

    def raise_for(self, status, call):
        raise KernelError(f"{self.name}: {call} status {status}")


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0


@pytest.fixture
def launches(monkeypatch):
    """The (kernel name, argument words) of each launch, in order, whether run from Python or by the C++ launcher;
    GEMM choices final unless `pending` holds True."""
    calls = []
    state = SimpleNamespace(pending=False, expressible=True, calls=calls, quantize=HostKernel("quantize", calls),
                            gemm=HostKernel("gemm", calls))

    def quantize_plan(x, scaling, block, rowwise, columnwise, options, column_sums=None):
        rows, cols = x.shape
        plan = LaunchPlan()

        def copy(r, c):
            return (plan.buffer(r, c // 2), plan.buffer(r, c // 16, dtype=torch.float8_e4m3fn),
                    plan.buffer(r if scaling == "row" else 1, dtype=torch.float32))
        row = copy(rows, cols) if rowwise else None
        col = copy(cols, rows) if columnwise else None
        sums = plan.buffer(cols, dtype=column_sums) if column_sums is not None else None
        plan.launch(state.quantize, INPUT, RNG, *(row or (None,) * 3), *(col or (None,) * 3), sums)
        plan.result = (row, col, 448.0, sums)
        return plan

    def gemm_plan_of_operands(a, b, out_dtype, has_bias=False, accumulate_into=None):
        if not state.expressible:
            return None
        plan = SimpleNamespace(n_run=b.shape[0], workspace_bytes=0, kernel=state.gemm)
        d_stride = accumulate_into.stride(0) if accumulate_into is not None else None
        return ops._plan_gemm(plan, a.device, a.shape[0], a.shape[1], out_dtype, (0,) * 5, d_stride, has_bias,
                              accumulate_into is not None, a.row_scaled, b.row_scaled, a.e4m3_max, b.e4m3_max)

    monkeypatch.setattr(ops, "quantize_plan", quantize_plan)
    monkeypatch.setattr(ops, "gemm_plan_of_operands", gemm_plan_of_operands)
    monkeypatch.setattr(ops, "gemm_choice_pending", lambda a, b, out_dtype: state.pending)
    monkeypatch.setattr(ops, "_launch", lambda kernel, device, *args: kernel._run(kernel.pack(args)))
    monkeypatch.setattr(linear_steps, "_FORWARD", {})
    monkeypatch.setattr(linear_steps, "_TRAINING", {})
    monkeypatch.setattr(linear_steps, "_SEEN", {})
    return state


def _second_call(make):
    """What make() returns at the second call of its kind, when steps are built (the first call returns None)."""
    assert make() is None
    return make()


def _operand(rows, cols, amaxes):
    return (torch.zeros(rows, cols // 2, dtype=torch.uint8), torch.zeros(rows, cols // 16, dtype=torch.float8_e4m3fn),
            torch.ones(amaxes))


def test_the_forward_step_feeds_the_quantized_x_and_the_weight_to_the_gemm(launches):
    x, w_row, bias = torch.randn(32, 64), _operand(48, 64, 1), torch.zeros(48)
    step = _second_call(lambda: linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, bias, 448.0, 448.0))
    y, x_col = step.run(x, w_row, bias)
    (quantize, q), (gemm, g) = launches.calls
    assert (quantize, gemm) == ("quantize", "gemm")
    assert q[0] == x.data_ptr() and q[1] == 0  # no random state in the forward
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
    step = _second_call(lambda: linear_steps.forward_step(x, w_row, fp4gen.Recipe(), False, None, 448.0, 448.0))
    y, x_col = step.run(x, w_row, None)
    (_, q), (_, g) = launches.calls
    assert x_col is None and q[5:8] == [0, 0, 0]
    assert g[BIAS] == 0 and g[D] == y.data_ptr()


def _training(recipe=None, needs_x_grad=True, need_wgrad=True, bias=True, main_grad=False, dtype=torch.float32,
              calls=2):
    """A 64 -> 48 layer's training-step inputs on 32 tokens and its LinearStep (through the fixture's kernels),
    as training_step returns it at the `calls`-th call of the kind."""
    recipe = recipe or fp4gen.Recipe()
    x = torch.randn(32, 64, dtype=dtype, requires_grad=needs_x_grad)
    weight = torch.nn.Parameter(torch.randn(48, 64, dtype=dtype), requires_grad=need_wgrad)
    bias = torch.nn.Parameter(torch.randn(48, dtype=dtype)) if bias else None
    w_row, w_col = _operand(48, 64, 1), _operand(64, 48, 1)
    epilogue_bias = bias.detach().float() if bias is not None else None
    main_grad = torch.zeros(48, 64) if main_grad else None
    for _ in range(calls):
        step = linear_steps.training_step(x, weight, w_row, w_col, recipe, needs_x_grad, need_wgrad, epilogue_bias,
                                          bias.dtype if bias is not None else None, main_grad, 448.0, 448.0)
    rng = torch.tensor([7, 10]) if recipe.stochastic_rounding else None
    return SimpleNamespace(step=step, x=x, weight=weight, bias=bias, w_row=w_row, w_col=w_col, main_grad=main_grad,
                           epilogue_bias=epilogue_bias, rng=rng,
                           run=lambda: linear_steps.run_training_step(step, x, weight, bias, w_row, w_col,
                                                                      epilogue_bias, main_grad, rng))


def test_a_training_step_runs_its_backward_plan_from_autograd_with_the_copies_its_forward_saved(launches):
    t = _training(fp4gen.Recipe(stochastic_rounding=True), main_grad=True)
    y = t.run()
    (_, q), (_, g) = launches.calls
    assert y.grad_fn is not None and g[D] == y.data_ptr() and g[BIAS] == t.epilogue_bias.data_ptr()
    assert q[0] == t.x.data_ptr() and q[1] == 0  # the forward draws no random bits
    x_col = q[5:8]
    launches.calls.clear()
    dy = torch.randn(32, 48)
    y.backward(dy)
    (_, q), (dgrad, dg), (wgrad, wg) = launches.calls
    assert (dgrad, wgrad) == ("gemm", "gemm")
    assert q[0] == dy.data_ptr() and q[1] == t.rng.data_ptr()
    row_data, row_scale, row_amax, col_data, col_scale, col_amax, sums = q[2:9]
    assert (dg[A], dg[A_SCALE], dg[A_AMAX]) == (row_data, row_scale, row_amax)
    assert (dg[B], dg[B_SCALE], dg[B_AMAX]) == tuple(t.data_ptr() for t in t.w_col)
    assert dg[BIAS] == 0 and dg[D] == dg[C] == t.x.grad.data_ptr() and tuple(t.x.grad.shape) == (32, 64)
    assert (wg[A], wg[A_SCALE], wg[A_AMAX]) == (col_data, col_scale, col_amax)
    assert [wg[B], wg[B_SCALE], wg[B_AMAX]] == x_col  # X's columnwise copy, saved by the forward
    assert wg[D] == wg[C] == t.main_grad.data_ptr() and t.weight.grad is None  # accumulated into main_grad
    assert t.bias.grad.data_ptr() == sums and t.bias.grad.dtype == torch.float32  # dY's column sums
    assert t.rng.tolist() == [7, 12]  # advanced past the call's draws, as RNGState.advance does


def test_a_training_step_saves_its_copies_through_autograds_saved_tensor_hooks(launches):
    """Activation offloading and similar hooks see the copies the step saves, and backward reads what they give."""
    packed = []

    def pack(t):
        packed.append(t.data_ptr())
        return t.clone()
    t = _training()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        y = t.run()
    (_, q), _ = launches.calls
    assert set(q[5:8]) <= set(packed) and {w.data_ptr() for w in t.w_col} <= set(packed)
    launches.calls.clear()
    y.backward(torch.randn(32, 48))
    (_, _), (_, dg), (_, wg) = launches.calls
    assert [wg[B], wg[B_SCALE], wg[B_AMAX]] != q[5:8]  # the hooks' copies, not the forward's buffers
    assert dg[B] not in packed
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(torch.randn(32, 48))  # the saved copies are released after a backward


def test_a_training_step_without_dgrad_makes_the_weight_gradient_in_the_weights_dtype(launches):
    t = _training(needs_x_grad=False, bias=False, dtype=torch.bfloat16)
    y = t.run()
    launches.calls.clear()
    y.backward(torch.randn(32, 48, dtype=torch.bfloat16))
    (_, q), (_, wg) = launches.calls
    assert q[2:5] == [0, 0, 0] and q[8] == 0  # no rowwise copy of dY, no column sums
    assert wg[D] == t.weight.grad.data_ptr() and t.weight.grad.dtype == torch.bfloat16
    assert tuple(t.weight.grad.shape) == (48, 64) and t.x.grad is None


def test_a_training_step_takes_the_bias_gradient_in_the_bias_dtype_from_dys_quantization(launches):
    # bias in dY's dtype: the sums are written in it, and db is that buffer itself (no conversion afterwards)
    t = _training(dtype=torch.bfloat16)
    y = t.run()
    launches.calls.clear()
    y.backward(torch.randn(32, 48, dtype=torch.bfloat16))
    (_, q), _, _ = launches.calls
    assert t.bias.grad.data_ptr() == q[8] and t.bias.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("bias_dtype,sums_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                   (torch.float16, torch.float32)])
def test_column_sums_come_in_the_bias_dtype_where_the_kernels_write_it(bias_dtype, sums_dtype):
    # dY in bf16 (autocast): a bf16 or fp32 bias gets its own dtype; an fp16 one fp32 sums, converted after
    assert column_sums_dtype(bias_dtype, torch.bfloat16) == sums_dtype


def test_a_training_step_sums_row_scaled_gradients_for_the_bias_itself(launches):
    t = _training(fp4gen.Recipe(gradient_scaling="row"), dtype=torch.bfloat16)
    y = t.run()
    dy = torch.randn(32, 48, dtype=torch.bfloat16)
    y.backward(dy)
    assert torch.equal(t.bias.grad, dy.sum(0, dtype=torch.float32).to(torch.bfloat16))


def test_a_training_step_hands_its_plans_an_aligned_contiguous_dy_with_the_same_values(launches):
    seen = []

    def read_dy(words):
        seen.append((words[0], ctypes.string_at(words[0], 32 * 48 * 4)))
    launches.quantize.body = read_dy
    t = _training()
    y = t.run()
    wide = torch.randn(32, 2 * 48 + 1)
    dy = wide[:, 1:2 * 48 + 1:2]  # neither contiguous nor aligned
    seen.clear()
    y.backward(dy)
    (address, data), = seen
    assert address % 16 == 0 and data == dy.contiguous().numpy().tobytes()


def _kernel_error(name: str, status: int) -> str:
    """What library.Kernel.raise_for says of a failed run (the launcher's LinearStep raises the same)."""
    with pytest.raises(KernelError) as raised:
        library.Kernel.raise_for(SimpleNamespace(name=name), status, "run")
    return str(raised.value)


@pytest.mark.parametrize("status", [1, 2, 7, 1003])
def test_a_failed_launch_of_a_training_step_raises_the_kernels_error_in_either_direction(launches, status):
    t = _training()
    y = t.run()
    launches.gemm.status = status
    with pytest.raises(KernelError) as backward:
        y.backward(torch.randn(32, 48))
    with pytest.raises(KernelError) as forward:
        t.run()
    assert str(backward.value) == str(forward.value) == _kernel_error("gemm", status)


def test_a_step_is_built_at_the_second_call_of_its_kind_once_its_gemm_choices_are_final(launches, monkeypatch):
    built = []
    for name in ("_build_forward", "_build_training"):
        monkeypatch.setattr(linear_steps, name, lambda *args, _build=getattr(linear_steps, name), _name=name:
                            built.append(_name) or _build(*args))
    x, w_row = torch.randn(32, 64), _operand(48, 64, 1)

    def forward():
        return linear_steps.forward_step(x, w_row, fp4gen.Recipe(), True, None, 448.0, 448.0)
    launches.pending, launches.expressible = True, False
    assert forward() is None and _training(calls=1).step is None and built == []  # a kind's first call: no build
    assert forward() is None and _training(calls=1).step is None
    # (a training step's build makes its forward's first)
    assert built == ["_build_forward", "_build_training", "_build_forward"]  # GEMM choices pending: not remembered
    assert linear_steps._FORWARD == {} and linear_steps._TRAINING == {}
    launches.pending = False
    built.clear()
    assert forward() is None and _training(calls=1).step is None
    assert built == ["_build_forward", "_build_training", "_build_forward"]  # final, no plan: remembered
    assert list(linear_steps._FORWARD.values()) == [None] and list(linear_steps._TRAINING.values()) == [None]
    launches.expressible = True
    built.clear()
    assert forward() is None and _training(calls=1).step is None and built == []  # the separate calls from now on


def _at(address: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The tensor at a launch's pointer, without a copy (writes reach the launcher's buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _layout(plan: LaunchPlan, like: tuple) -> tuple:
    """Buffers of plan shaped and typed like the tensors of `like` (None stays None); (slots, their layouts)."""
    slots = tuple(plan.buffer(*t.shape, dtype=t.dtype) if t is not None else None for t in like)
    return slots, tuple((tuple(t.shape), t.dtype) if t is not None else None for t in like)


def _triple(q):
    return (q.data, q.scale, q.amax) if q is not None else (None, None, None)


class ReferenceSteps:
    """Stands for linear_steps in fp4gen.nn on CPU: a ForwardStep-like forward for calls without autograd, and real
    LinearSteps of the C++ launcher whose plans launch host functions that compute what the CUDA kernels would
    (X's or dY's quantization, then the GEMMs) with the reference backend, reading and writing the launcher's
    buffers in place."""

    run_training_step = staticmethod(linear_steps.run_training_step)
    run_forward_step = staticmethod(linear_steps.run_forward_step)

    def __init__(self):
        self.ran, self.calls = [], []
        self.kernels = []  # the launcher holds only their entries' addresses: keep them alive

    def _kernel(self, name: str, body) -> HostKernel:
        self.kernels.append(HostKernel(name, self.calls, body))
        return self.kernels[-1]

    def forward_step(self, x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max):
        """A ForwardStep: its plan for the launcher (run_forward_step), and run() for _fprop, which computes the
        same with the reference backend in Python."""
        steps = self
        step = linear_steps.ForwardStep()
        step.plan, step.y, step.x_col, _ = self._forward_plan(x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max,
                                                              w_e4m3_max)
        step.native, step.kernels = step.plan._make_native(), ["reference forward"]

        class Step:
            def __getattr__(self, name):
                return getattr(step, name)

            def run(self, x2d, w_row, bias):
                steps.ran.append("forward")
                y, col = _reference_forward(x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max)
                return y, (_triple(col) if col is not None else None)
        return Step()

    def _forward_plan(self, x2d, w_row, recipe, need_wgrad, epilogue_bias, x_e4m3_max, w_e4m3_max):
        """The forward's plan, Y's slot, X's columnwise slots ([] without wgrad) and the layouts of Y and X's
        columnwise copy: a host function that computes the forward with the reference backend."""
        (m, k), n = x2d.shape, w_row[0].shape[0]
        # the buffers' layouts, from one reference call on stand-in values
        y, col = _reference_forward(torch.zeros_like(x2d), w_row, recipe, need_wgrad, epilogue_bias, x_e4m3_max,
                                    w_e4m3_max)
        forward = LaunchPlan(inputs=6)  # x, no random state, W rowwise triple, the epilogue bias
        (y_slot, *x_col), layouts = _layout(forward, (y, *_triple(col)))
        x_col = x_col if col is not None else []

        def run_forward(words):
            self.ran.append("forward")
            x = _at(words[0], (m, k), x2d.dtype)
            w = tuple(_at(a, t.shape, t.dtype) for a, t in zip(words[2:5], w_row))
            bias = _at(words[5], (n,), torch.float32) if words[5] else None
            y, col = _reference_forward(x, w, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max)
            for address, t, layout in zip(words[6:], (y, *_triple(col)), layouts):
                if t is not None:
                    _at(address, *layout).copy_(t)
        forward.launch(self._kernel("reference forward", run_forward), Slot(0), None, Slot(2), Slot(3),
                       Slot(4), Slot(5), y_slot, *x_col)
        linear_steps._share(forward, [y_slot], x_col)  # X's columnwise copy in one allocation, as the real steps
        return forward, y_slot, x_col, layouts

    def training_step(self, x2d, weight, w_row, w_col, recipe, needs_x_grad, need_wgrad, epilogue_bias, bias_dtype,
                      main_grad, x_e4m3_max, w_e4m3_max):
        (m, k), n = x2d.shape, w_row[0].shape[0]
        w_dtype = weight.dtype
        forward, y_slot, x_col, layouts = self._forward_plan(x2d, w_row, recipe, need_wgrad, epilogue_bias,
                                                             x_e4m3_max, w_e4m3_max)
        weight_plan = None
        if w_col is None and needs_x_grad:  # the layer keeps no copy: backward quantizes W first
            weight_plan, w_col_slots, w_col = self._weight_plan(weight, recipe)

        sums_with_dy = bias_dtype is not None and recipe.gradient_scaling == "tensor"
        backward = LaunchPlan(inputs=9)  # dy, the random state, W columnwise, X columnwise, main_grad
        dx = backward.buffer(m, k, dtype=x2d.dtype) if needs_x_grad else None
        dw = backward.buffer(n, k, dtype=w_dtype) if need_wgrad and main_grad is None else None
        sums_dtype = column_sums_dtype(bias_dtype, x2d.dtype) if sums_with_dy else None
        sums = backward.buffer(n, dtype=sums_dtype) if sums_with_dy else None
        x_col_layouts = layouts[1:]

        def run_backward(words):
            self.ran.append("backward")
            dy = _at(words[0], (m, n), x2d.dtype)
            rng = RNGState.from_tensor(_at(words[1], (2,), torch.int64)) if words[1] else None
            options = QuantizeOptions(recipe.gradient_rounding, rng, recipe.hadamard_wgrad and need_wgrad, None)
            out = reference.quantize(dy, recipe.gradient_scaling, (1, 16), needs_x_grad, need_wgrad, options,
                                     column_sums=sums_dtype)
            if needs_x_grad:
                w = NVFP4Data._made_by_fp4gen(*(_at(a, t.shape, t.dtype) for a, t in zip(words[2:5], w_col)),
                                              w_e4m3_max)
                _at(words[9], (m, k), x2d.dtype).copy_(reference.gemm(out[0], w, x2d.dtype, None, False))
            if need_wgrad:
                x = NVFP4Data._made_by_fp4gen(*(_at(a, *layout) for a, layout in zip(words[5:8], x_col_layouts)),
                                              x_e4m3_max)
                if main_grad is not None:
                    reference.gemm(out[1], x, torch.float32, _at(words[8], (n, k), torch.float32), True)
                else:
                    _at(words[10], (n, k), w_dtype).copy_(reference.gemm(out[1], x, w_dtype, None, False))
            if sums_with_dy:
                _at(words[11], (n,), sums_dtype).copy_(out[2])
        backward.launch(self._kernel("reference backward", run_backward), *(Slot(i) for i in range(9)),
                        dx, dw, sums)
        linear_steps._share(backward, [dx, dw, sums])
        native = launcher.module()
        return native.LinearStep(forward._make_native(), ["reference forward"], y_slot, list(x_col),
                                 backward._make_native(), ["reference backward"], linear_steps._slot(dx),
                                 linear_steps._slot(dw), linear_steps._slot(sums),
                                 2 if recipe.gradient_rounding == "stochastic" else 0,
                                 0 if bias_dtype is None else 1 if sums_with_dy else 2,
                                 str(bias_dtype or torch.float32).replace("torch.", ""),
                                 weight_plan._make_native() if weight_plan else None,
                                 ["reference weight"] if weight_plan else [], list(w_col_slots) if weight_plan else [])

    def _weight_plan(self, weight, recipe):
        """The plan that quantizes W's columnwise copy at backward, its slots, and stand-ins shaped as the copy."""
        def quantize(w):
            options = QuantizeOptions("nearest", None, False, recipe.weight_four_over_six)
            return _triple(reference.quantize(w, "tensor", recipe.weight_block, False, True, options)[1])
        stand_in = quantize(torch.zeros_like(weight.detach()))
        plan = LaunchPlan(inputs=2)  # W, no random state
        slots, layouts = _layout(plan, stand_in)

        def run_weight(words):
            self.ran.append("weight")
            for address, t, layout in zip(words[2:], quantize(_at(words[0], weight.shape, weight.dtype)), layouts):
                _at(address, *layout).copy_(t)
        plan.launch(self._kernel("reference weight", run_weight), Slot(0), None, *slots)
        return plan, slots, stand_in


def _reference_forward(x2d, w_row, recipe, need_wgrad, bias, x_e4m3_max, w_e4m3_max):
    options = QuantizeOptions("nearest", None, recipe.hadamard_wgrad and need_wgrad, recipe.activation_four_over_six)
    row, col = reference.quantize(x2d, recipe.activation_scaling, (1, 16), True, need_wgrad, options)
    y = reference.gemm(row, NVFP4Data._made_by_fp4gen(*w_row, w_e4m3_max), x2d.dtype, None, False, bias)
    return y, col


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
    dict(checkpoint=True, recipe=fp4gen.Recipe(stochastic_rounding=True)),
    dict(input_shape=(2, 16, 64)),  # the step takes the 3-D input itself and returns Y and dX shaped as it
    dict(input_shape=(16, 2, 64), transposed=True),  # a 3-D input whose rows are not contiguous: a copy steps
    dict(input_shape=(2, 16, 64), inference=True),
    dict(input_shape=(17, 64)),  # tokens off the 16-token block: the step runs on X completed with zero tokens
    dict(input_shape=(3, 7, 64), recipe=fp4gen.Recipe(stochastic_rounding=True)),
    dict(keep=False),  # no quantized weight kept: the step's backward quantizes W's columnwise copy from W
    dict(keep=False, recipe=fp4gen.Recipe(four_over_six="weights", weight_block=(1, 16)), dtype=torch.bfloat16),
    dict(keep=False, frozen=True),
    dict(keep=False, bias=False, main_grad=True, input_shape=(17, 64)),
    dict(keep=False, checkpoint=True, recipe=fp4gen.Recipe(stochastic_rounding=True)),
]


def linear_steps_outputs(case: dict, device: str, steps: int) -> list:
    """Every output of `steps` eager training steps, each followed by an SGD step (or of inference forwards), of a
    fresh 64 -> 48 fp4gen.nn.Linear made as `case` says (bias, recipe, main_grad, frozen, inference, dtype,
    checkpoint: the layer under torch.utils.checkpoint, which drops what the forward saves and runs it again in
    backward; input_shape, default (32, 64), and transposed: the input is that tensor with its first two dimensions
    swapped), on fixed random data: outputs, input and parameter gradients, the main grad, and the default random
    state at the end."""
    dtype = case.get("dtype", torch.bfloat16 if device == "cuda" else torch.float32)
    torch.manual_seed(3)
    layer = fp4gen.nn.Linear(64, 48, bias=case.get("bias", True), device=device, dtype=dtype,
                             recipe=case.get("recipe"), accumulate_main_grad=case.get("main_grad", False),
                             keep_quantized_weight=case.get("keep", True))
    layer.weight.requires_grad_(not case.get("frozen", False))
    if case.get("main_grad"):
        layer.weight.main_grad = torch.zeros(48, 64, device=device)
    rng = fp4gen.RNGState.default(layer.weight.device)
    rng.reset(5)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)  # new weights each step: their quantization is redone
    outputs = []
    for _ in range(steps):
        x = torch.randn(*case.get("input_shape", (32, 64)), device=device, dtype=dtype,
                        requires_grad=not case.get("inference", False))
        x_in = x.transpose(0, 1) if case.get("transposed") else x
        if case.get("inference"):
            with torch.no_grad():
                outputs.append(layer(x_in))
            continue
        checkpoint = case.get("checkpoint")
        y = torch.utils.checkpoint.checkpoint(layer, x_in, use_reentrant=False) if checkpoint else layer(x_in)
        y.backward(torch.randn_like(y))
        outputs += [y, x.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        if case.get("main_grad"):
            outputs.append(layer.weight.main_grad.clone())
        optimizer.step()
    return outputs + [rng.tensor.clone()]  # advanced alike


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_linear_uses_a_steps_outputs_as_it_uses_its_separate_calls(monkeypatch, case):
    from fp4gen import nn
    separate = linear_steps_outputs(case, "cpu", 2)
    steps = ReferenceSteps()
    monkeypatch.setattr(nn, "_step_plans", lambda ops, t: steps)
    stepped = linear_steps_outputs(case, "cpu", 2)
    assert "forward" in steps.ran and ("backward" in steps.ran or case.get("inference"))
    assert ("weight" in steps.ran) == (case.get("keep") is False)  # the weight plan runs where a step needs it
    shape = case.get("input_shape")
    if shape and not (case.get("transposed") or case.get("inference")) and math.prod(shape[:-1]) % 16 == 0:
        # Y of a 3-D input comes from the step's own node, with no view node between it and the input (a token
        # count off the 16-token block has the padding's slice between them)
        assert "LinearFunction" in stepped[0].grad_fn.name(), stepped[0].grad_fn.name()
    assert len(stepped) == len(separate)
    for ours, theirs in zip(stepped, separate):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_a_second_backward_through_a_training_step_raises(monkeypatch):
    """The launcher's LinearFunction, like the layer's Python function: create_graph=True gives the same first-order
    gradients, and a backward through them raises with fp4gen's message."""
    from fp4gen import nn
    from test_linear import check_a_second_backward_raises
    steps = ReferenceSteps()
    monkeypatch.setattr(nn, "_step_plans", lambda ops, t: steps)
    torch.manual_seed(8)
    layer = fp4gen.nn.Linear(64, 32)
    check_a_second_backward_raises(layer, torch.randn(32, 64),
                                   message="trying to differentiate twice: fp4gen.nn.Linear's")
    assert steps.ran.count("backward") == 6


def test_a_linear_step_checks_its_slots_and_its_weight_plan():
    """LinearStep's constructor refuses what its autograd node could not run: slots outside its plans' buffers, a
    weight plan without its three slots of W's columnwise copy or without a dgrad to feed, slots without a plan."""
    native = launcher.module()

    def plan(buffers: int):
        p = LaunchPlan(inputs=2)
        slots = [p.buffer(16) for _ in range(buffers)]
        return p._make_native(), slots

    (forward, (y, *x_col)), (backward, (dx, dw)), (weight, w_col) = plan(4), plan(2), plan(3)

    def step(x_col=x_col, dx=dx, bias_grad=0, weight=None, w_col=()):
        return native.LinearStep(forward, [], y, list(x_col), backward, [], dx, dw, -1, 0, bias_grad, "float32",
                                 weight, [], list(w_col))

    assert step(weight=weight, w_col=w_col) is not None and step() is not None
    for kwargs, message in [(dict(x_col=x_col[:2]), "3 slots"), (dict(bias_grad=3), "bias_grad is 0, 1 or 2"),
                            (dict(weight=weight, w_col=w_col[:2]), "weight plan"),
                            (dict(weight=weight, w_col=w_col, dx=-1), "weight plan"),
                            (dict(w_col=w_col), "weight plan"),
                            (dict(weight=weight, w_col=[w_col[0], w_col[1], 99]), "must name its plans' buffers"),
                            (dict(x_col=[y, y, 99]), "must name its plans' buffers")]:
        with pytest.raises(RuntimeError, match="fp4gen launcher: .*" + message):
            step(**kwargs)
