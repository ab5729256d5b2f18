"""The C++ launcher against launches from Python (FP4GEN_LAUNCHER=python): the same kernels with the same
arguments, so every output must be the same bytes; and a failing launch raises the kernel's error through it."""
import pytest
import torch

import fp4gen
from fp4gen.cuda import launcher, ops
from fp4gen.options import DEFAULT_OPTIONS
from test_linear_steps import LAYER_CASES, linear_steps_outputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def launch_with(monkeypatch):
    def use(choice):
        monkeypatch.setattr(launcher, "_ENABLED", choice == "cpp")
        ops.clear_plans()  # plans keep their native copy; start each path from fresh plans
    yield use
    ops.clear_plans()


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t


QUANTIZE_CASES = [
    dict(scaling="row", rowwise=True, columnwise=True),
    dict(scaling="row", rowwise=True, columnwise=True, hadamard=True),
    dict(scaling="tensor", rowwise=True, columnwise=True),
    dict(scaling="tensor", block=(16, 16)),
    dict(scaling="tensor", rowwise=True, columnwise=True, rounding="stochastic"),
    dict(scaling="row", rowwise=True, columnwise=True, four_over_six="mae"),
]


@pytest.mark.parametrize("case", QUANTIZE_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_quantize_through_the_cpp_launcher_equals_launches_from_python(launch_with, case):
    torch.manual_seed(0)
    x = torch.randn(272, 320, device="cuda", dtype=torch.bfloat16)
    outputs = {}
    for choice in ("python", "cpp"):
        launch_with(choice)
        rng = fp4gen.RNGState(seed=7, device="cuda") if case.get("rounding") == "stochastic" else None
        q = fp4gen.quantize(x, **case, **({"rng": rng} if rng is not None else {}))
        outputs[choice] = [_bytes(t) for copy in (q.rowwise, q.columnwise) if copy is not None
                           for t in (copy.data, copy.scale, copy.amax)]
        if rng is not None:
            outputs[choice].append(rng.tensor.clone())  # both advance the state alike
    assert len(outputs["cpp"]) == len(outputs["python"]) > 0
    for ours, theirs in zip(outputs["cpp"], outputs["python"]):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("m", [16, 200, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_through_the_cpp_launcher_equals_launches_from_python(launch_with, m, bias):
    torch.manual_seed(1)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, device="cuda") if bias else None
    a_q = fp4gen.quantize(x, scaling="row", columnwise=False).rowwise  # M = 200: rows with a tail (no columnwise copy)
    w_q = fp4gen.quantize(w, scaling="tensor").rowwise
    c = torch.randn(m, 384, device="cuda")
    results = {}
    for choice in ("python", "cpp"):
        launch_with(choice)
        results[choice] = fp4gen.gemm(a_q, w_q, bias=b)
        results[choice + " accumulate"] = fp4gen.gemm(a_q, w_q, out=c.clone(), accumulate=True)
    assert torch.equal(results["cpp"], results["python"])
    assert torch.equal(results["cpp accumulate"], results["python accumulate"])


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_linear_steps_as_one_plan_equal_the_separate_calls(launch_with, monkeypatch, case):
    """fp4gen.nn.Linear's eager steps through the C++ launcher run as one launch plan a direction: a training step
    as the launcher's LinearStep (its backward from autograd's C++ node), a forward without autograd as a
    ForwardStep (linear_steps.py, one call into the launcher); from Python they make the separate quantize and GEMM
    calls. Same bytes either way."""
    from fp4gen.cuda import linear_steps
    ran = []
    monkeypatch.setattr(linear_steps.ForwardStep, "run", lambda self, *args, _run=linear_steps.ForwardStep.run:
                        ran.append("forward step") or _run(self, *args))
    monkeypatch.setattr(linear_steps, "run_forward_step", lambda *args, _run=linear_steps.run_forward_step:
                        ran.append("forward step") or _run(*args))
    monkeypatch.setattr(linear_steps, "run_training_step", lambda *args, _run=linear_steps.run_training_step:
                        ran.append("training step") or _run(*args))
    launch_with("python")
    separate = linear_steps_outputs(case, "cuda", 3)
    assert ran == []
    launch_with("cpp")
    # the first step makes the separate calls (its GEMM choices are not final before it), the next ones the steps
    stepped = linear_steps_outputs(case, "cuda", 3)
    assert ("forward step" if case.get("inference") else "training step") in ran
    assert len(stepped) == len(separate)
    for ours, theirs in zip(stepped, separate):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_a_failing_launch_raises_the_kernels_error_through_the_cpp_launcher(launch_with):
    launch_with("cpp")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    plan = ops._plan_quantize(x, "row", (1, 16), True, False, DEFAULT_OPTIONS, None)
    kernel, template, slots = plan.launches[0]
    # the same kernel told the rows have 63 columns: it refuses the problem (not a multiple of 16) before launching
    assert template[3] == 64
    plan.launches[0] = (kernel, template[:3] + (63,) + template[4:], slots)
    with pytest.raises(fp4gen.KernelError, match=f"{kernel.name}: run refused the problem \\(status 1"):
        plan.run(ops._launch, [x, None], x.device)


def test_an_allocation_without_memory_raises_torchs_out_of_memory_error_through_the_cpp_launcher(launch_with):
    from fp4gen.cuda.launch_plan import LaunchPlan
    launch_with("cpp")
    plan = LaunchPlan(inputs=0)
    plan.buffer(1 << 50)  # a petabyte
    with pytest.raises(torch.OutOfMemoryError):
        plan.run(ops._launch, [], torch.device("cuda", torch.cuda.current_device()))
