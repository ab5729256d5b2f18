"""Launch plans (fp4gen.cuda.launch_plan) and the plan caches of fp4gen.cuda.ops, on CPU: a recording launch
function stands for the kernels."""
from types import SimpleNamespace

import pytest
import torch

from fp4gen.cuda import launch_plan, ops
from fp4gen.cuda.launch_plan import INPUT, RNG, LaunchPlan, Slot, remember
from fp4gen.formats import NVFP4Data
from fp4gen.options import DEFAULT_OPTIONS


def recording():
    calls = []

    def launch(kernel, device, *args):
        calls.append((kernel, device, args))
    return calls, launch


def test_a_run_allocates_the_buffers_and_fills_the_slots_in_launch_order():
    plan = LaunchPlan()
    amax = plan.buffer(3, dtype=torch.float32)
    codes = plan.buffer(3, 8)
    plan.launch("first", INPUT, 7, amax, None, RNG)
    plan.launch("second", codes, INPUT, 2.5, amax)
    calls, launch = recording()
    x, rng = torch.zeros(3, 16), torch.zeros(2, dtype=torch.int64)
    buffers = plan.run(launch, [x, rng], x.device)
    assert [tuple(b.shape) for b in buffers] == [(3,), (3, 8)]
    assert [b.dtype for b in buffers] == [torch.float32, torch.uint8]
    assert plan.tensor(buffers, amax) is buffers[0] and plan.tensor(buffers, None) is None
    first, second = calls
    assert first == ("first", x.device, (x.data_ptr(), 7, buffers[0].data_ptr(), None, rng.data_ptr()))
    assert second == ("second", x.device, (buffers[1].data_ptr(), x.data_ptr(), 2.5, buffers[0].data_ptr()))
    # a second run allocates its own buffers; without a random state its slot is a null pointer
    calls.clear()
    again = plan.run(launch, [x, None], x.device)
    assert again[0] is not buffers[0]
    assert calls[0][2][4] is None and calls[1][2][0] == again[1].data_ptr()


def test_an_int_constant_is_not_taken_for_a_slot():
    plan = LaunchPlan()
    plan.buffer(1)
    plan.launch("k", 0, 1, 2)  # plain ints equal to slot indices stay constants
    calls, launch = recording()
    plan.run(launch, [torch.zeros(1), None], torch.device("cpu"))
    assert calls[0][2] == (0, 1, 2)


def test_zeroed_buffers_are_zero_after_a_run_and_each_is_zeroed_once():
    plan = LaunchPlan()
    a, b = plan.buffer(4, dtype=torch.float32), plan.buffer(4, dtype=torch.float32)
    plan.zero(a, None, a)
    assert plan.zeroed == [a]
    calls, launch = recording()
    buffers = plan.run(launch, [torch.zeros(1), None], torch.device("cpu"))
    assert calls == [] and torch.equal(buffers[0], torch.zeros(4))


def test_remember_empties_a_full_cache():
    plans = {}
    for i in range(5):
        remember(plans, i, f"plan {i}", limit=3)
    assert plans == {3: "plan 3", 4: "plan 4"}


@pytest.fixture
def counted_quantize_plans(monkeypatch):
    """ops.quantize on CPU tensors with plans that launch a recording function: the plans made, the launches."""
    made, calls = [], []

    def plan_quantize(x, scaling, block, rowwise, columnwise, options, column_sums):
        rows, cols = x.shape
        plan = LaunchPlan()
        amax = plan.buffer(rows, dtype=torch.float32)
        data, scale = plan.buffer(rows, cols // 2), plan.buffer(rows, cols // 16, dtype=torch.float8_e4m3fn)
        plan.launch(f"kernel {len(made)}", INPUT, x.stride(0), amax, data, scale, RNG)
        plan.result = ((data, scale, amax), None, 448.0, None)
        made.append((tuple(x.shape), x.stride(0), scaling, block))
        return plan

    monkeypatch.setattr(ops, "_QUANTIZE_PLANS", {})
    monkeypatch.setattr(ops, "_plan_quantize", plan_quantize)
    monkeypatch.setattr(ops, "_launch", lambda kernel, device, *args: calls.append((kernel, args)))
    return SimpleNamespace(made=made, calls=calls)


def test_quantize_plans_once_per_kind_of_call(counted_quantize_plans):
    x = torch.randn(32, 64)
    first, _ = ops.quantize(x, "row", (1, 16), True, False, DEFAULT_OPTIONS)
    second, _ = ops.quantize(torch.randn(32, 64), "row", (1, 16), True, False, DEFAULT_OPTIONS)
    assert len(counted_quantize_plans.made) == 1 and len(counted_quantize_plans.calls) == 2
    assert isinstance(first, NVFP4Data) and first.shape == (32, 64) and first.e4m3_max == 448.0
    assert first.data.data_ptr() != second.data.data_ptr()  # each call has its own outputs
    assert counted_quantize_plans.calls[0][1][0] == x.data_ptr()
    # another shape, row stride, scaling or block is another kind of call
    ops.quantize(torch.randn(48, 64), "row", (1, 16), True, False, DEFAULT_OPTIONS)
    ops.quantize(torch.randn(32, 128)[:, :64], "row", (1, 16), True, False, DEFAULT_OPTIONS)
    ops.quantize(x, "tensor", (1, 16), True, False, DEFAULT_OPTIONS)
    ops.quantize(x, "tensor", (16, 16), True, False, DEFAULT_OPTIONS)
    assert len(counted_quantize_plans.made) == 5
    # the row-pass limits decide between kernels, so changing them forgets the plans
    with ops.row_pass_limits(0):
        ops.quantize(x, "row", (1, 16), True, False, DEFAULT_OPTIONS)
    assert len(counted_quantize_plans.made) == 6
    ops.quantize(x, "row", (1, 16), True, False, DEFAULT_OPTIONS)
    assert len(counted_quantize_plans.made) == 7
    ops.clear_plans()
    ops.quantize(x, "row", (1, 16), True, False, DEFAULT_OPTIONS)
    assert len(counted_quantize_plans.made) == 8


def test_a_gemm_plan_is_kept_only_once_its_kernel_choice_is_final(monkeypatch):
    choices = []

    def choose(a, b, out_dtype, measure, accumulate):
        final = measure  # stands for: the rule serves until an eager call has measured
        choices.append(final)
        return SimpleNamespace(name="k"), final

    monkeypatch.setattr(ops, "_GEMM_PLANS", {})
    monkeypatch.setattr(ops, "_choose_gemm_kernel", choose)

    def operand(rows, k):
        return NVFP4Data(torch.zeros(rows, k // 2, dtype=torch.uint8),
                         torch.zeros(rows, k // 16, dtype=torch.float8_e4m3fn), torch.ones(1))

    a, b = operand(16, 64), operand(32, 64)
    ops.gemm_kernel(a, b, torch.bfloat16)  # a query: the rule's choice, not kept
    ops.gemm_kernel(a, b, torch.bfloat16)
    assert choices == [False, False]
    ops.gemm_kernel(a, b, torch.bfloat16, measure=True)  # final: kept
    ops.gemm_kernel(a, b, torch.bfloat16)
    assert choices == [False, False, True] and len(ops._GEMM_PLANS) == 1
    ops.gemm_kernel(operand(17, 64), b, torch.bfloat16, measure=True)  # another M is another problem
    assert len(ops._GEMM_PLANS) == 2


def test_an_included_plan_takes_its_inputs_from_the_outer_plan_and_its_buffers_become_the_outer_plans():
    inner = LaunchPlan(inputs=3)
    out = inner.buffer(4, dtype=torch.float32)
    inner.zero(out)
    inner.launch("inner", Slot(0), Slot(1), Slot(2), out, 5)
    outer = LaunchPlan(inputs=2)
    first = outer.buffer(8)
    outer.launch("outer", INPUT, first)
    mapping = outer.include(inner, [first, INPUT, None])  # inner's inputs: outer's buffer, outer's input, null
    assert mapping[out] == Slot(3) and outer.zeroed == [Slot(3)]
    calls, launch = recording()
    x = torch.zeros(2)
    buffers = outer.run(launch, [x, None], x.device)
    assert [tuple(b.shape) for b in buffers] == [(8,), (4,)] and torch.equal(buffers[1], torch.zeros(4))
    assert calls[1] == ("inner", x.device, (buffers[0].data_ptr(), x.data_ptr(), None, buffers[1].data_ptr(), 5))
    with pytest.raises(ValueError, match="takes 3 inputs, got 2"):
        outer.include(inner, [first, INPUT])
