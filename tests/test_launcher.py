"""The C++ launcher (fp4gen.cuda.launcher, launcher.cpp) on CPU: compiled against the installed PyTorch, it
runs launch plans whose "kernels" are Python functions with the packed entry's C signature, so the words each
launch receives can be checked one by one."""
import ctypes
import struct

import pytest
import torch

from fp4gen.cuda import launcher, library
from fp4gen.cuda.launch_plan import INPUT, RNG, LaunchPlan, Slot

RUN_PACKED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p)


class RecordingKernel:
    """Stands for a kernel library: its packed entry records (words, stream) and returns `status`."""

    pack = library.Kernel.pack  # the real packing of arguments into words (it reads name and _kinds)

    def __init__(self, name: str, kinds: list, status: int = 0):
        self.name, self._kinds, self.status, self.calls = name, kinds, status, []

        def run_packed(words, stream):
            self.calls.append(([words[i] for i in range(len(self._kinds))], stream or 0))
            return self.status
        self._entry = RUN_PACKED(run_packed)  # kept referenced: the launcher holds only its address
        self.run_packed_address = ctypes.cast(self._entry, ctypes.c_void_p).value

    def raise_for(self, status, call):
        raise RuntimeError(f"{self.name}: {call} status {status}")


@pytest.fixture(scope="module")
def native():
    return launcher.module()


def test_a_native_run_fills_each_launchs_words_with_the_inputs_and_its_own_buffers(native):
    first = RecordingKernel("first", ["pointer", "int64", "pointer", "pointer", "pointer", "float32"])
    second = RecordingKernel("second", ["pointer", "pointer", "int64"])
    plan = LaunchPlan()
    amax = plan.buffer(3, dtype=torch.float32)
    codes = plan.buffer(3, 8)
    plan.launch(first, INPUT, -7, amax, None, RNG, 0.1)
    plan.launch(second, codes, INPUT, 2)
    x, rng = torch.zeros(3, 16), torch.zeros(2, dtype=torch.int64)
    buffers, failed, status = plan._make_native().run([x, rng], -1, 1234)
    assert (failed, status) == (-1, 0)
    assert [tuple(b.shape) for b in buffers] == [(3,), (3, 8)]
    assert [b.dtype for b in buffers] == [torch.float32, torch.uint8]
    (words, stream), = first.calls
    assert stream == 1234
    assert words == [x.data_ptr(), 2**64 - 7, buffers[0].data_ptr(), 0, rng.data_ptr(),
                     struct.unpack("<I", struct.pack("<f", 0.1))[0]]
    assert second.calls[0][0] == [buffers[1].data_ptr(), x.data_ptr(), 2]
    # each run allocates its own buffers; a None input is a null pointer
    again, _, _ = plan._native.run([x, None], -1, 0)
    assert again[1].data_ptr() != buffers[1].data_ptr()  # the first run's buffers are still alive
    assert first.calls[1][0][4] == 0 and second.calls[1][0][0] == again[1].data_ptr()


def test_a_native_run_zeroes_the_buffers_the_plan_zeroes(native):
    plan = LaunchPlan()
    kept, zeroed = plan.buffer(64, dtype=torch.float32), plan.buffer(64, dtype=torch.float32)
    plan.zero(zeroed)
    buffers, _, _ = plan._make_native().run([torch.zeros(1), None], -1, 0)
    assert torch.equal(buffers[1], torch.zeros(64))


def test_a_native_run_stops_at_the_first_failing_launch_and_says_which(native):
    ok, failing, never = (RecordingKernel(n, ["int64"], s) for n, s in (("ok", 0), ("failing", 1002), ("never", 0)))
    plan = LaunchPlan(inputs=0)
    for kernel in (ok, failing, never):
        plan.launch(kernel, 1)
    _, failed, status = plan._make_native().run([], -1, 0)
    assert (failed, status) == (1, 1002) and never.calls == []
    # LaunchPlan.run raises through the failing launch's kernel (only on CUDA devices; here by hand)
    with pytest.raises(RuntimeError, match="failing: run status 1002"):
        plan.launches[failed][0].raise_for(status, "run")


def test_shared_buffers_lie_apart_in_one_allocation_at_multiples_of_256_bytes(native):
    kernel = RecordingKernel("k", ["pointer"] * 5)
    plan = LaunchPlan(inputs=1)
    codes, scales, amax = plan.buffer(3, 40), plan.buffer(3, 5, dtype=torch.float8_e4m3fn), plan.buffer(3, 7)
    own, empty = plan.buffer(2, dtype=torch.bfloat16), plan.buffer(0, dtype=torch.float32)
    plan.share(codes, None, scales, empty)
    plan.share(amax)
    plan.launch(kernel, codes, scales, amax, own, empty)
    plan.zero(scales)
    buffers, _, _ = plan._make_native().run([None], -1, 0)
    assert [(tuple(b.shape), b.dtype) for b in buffers] == [
        ((3, 40), torch.uint8), ((3, 5), torch.float8_e4m3fn), ((3, 7), torch.uint8), ((2,), torch.bfloat16),
        ((0,), torch.float32)]
    block = buffers[0].untyped_storage()
    assert buffers[1].untyped_storage().data_ptr() == block.data_ptr()  # one allocation
    assert buffers[2].untyped_storage().data_ptr() != block.data_ptr()  # another group
    assert buffers[3].untyped_storage().data_ptr() not in (block.data_ptr(), buffers[2].untyped_storage().data_ptr())
    (words, _), = kernel.calls
    assert words == [b.data_ptr() for b in buffers]
    assert words[1] - words[0] == 256 and block.nbytes() == 512  # 120 bytes, then 15, each rounded up; then none
    assert torch.equal(buffers[1].view(torch.uint8), torch.zeros(3, 5, dtype=torch.uint8))  # zeroed in place
    buffers[0].fill_(7)  # ordinary tensors to PyTorch's operators, each over its own bytes
    assert torch.equal(buffers[0] + 1, torch.full((3, 40), 8, dtype=torch.uint8))
    assert torch.equal(buffers[1].view(torch.uint8), torch.zeros(3, 5, dtype=torch.uint8))


def test_share_takes_distinct_buffers_of_the_plan_once():
    plan = LaunchPlan(inputs=2)
    a, b = plan.buffer(4), plan.buffer(4)
    with pytest.raises(ValueError, match="distinct buffers"):
        plan.share(a, a)
    with pytest.raises(ValueError, match="distinct buffers"):
        plan.share(Slot(1), a)  # an input
    plan.share(a)
    with pytest.raises(ValueError, match="distinct buffers"):
        plan.share(a, b)  # already shared
    with pytest.raises(ValueError, match="cannot be shared"):
        LaunchPlan(inputs=2).include(plan, [Slot(0), Slot(1)])


def test_the_launcher_refuses_a_plan_that_names_a_slot_it_does_not_have(native):
    kernel = RecordingKernel("k", ["pointer"])
    with pytest.raises(RuntimeError, match="names slot 3"):
        native.Plan(2, [([4], "uint8")], [], [(kernel.run_packed_address, [0], [(0, 3)])])
    with pytest.raises(RuntimeError, match="takes 2 inputs"):
        native.Plan(2, [], [], []).run([None], -1, 0)
    with pytest.raises(ValueError, match="no buffer dtype named"):
        native.Plan(0, [([4], "complex64")], [], [])


def test_the_launcher_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.setattr(launcher, "_ENABLED", None)
    monkeypatch.setenv("FP4GEN_LAUNCHER", "python")
    assert launcher.enabled() is False
    monkeypatch.setattr(launcher, "_ENABLED", None)
    monkeypatch.setenv("FP4GEN_LAUNCHER", "cuda")
    with pytest.raises(ValueError, match="FP4GEN_LAUNCHER='cuda': expected one of cpp, python"):
        launcher.enabled()


def test_use_overrides_the_environment_for_the_process(monkeypatch):
    monkeypatch.setattr(launcher, "_ENABLED", None)
    monkeypatch.setenv("FP4GEN_LAUNCHER", "python")
    launcher.use("cpp")
    assert launcher.enabled() is True
    launcher.use("python")
    assert launcher.enabled() is False
    with pytest.raises(ValueError, match="launcher 'ctypes': expected one of cpp, python"):
        launcher.use("ctypes")


def test_packing_refuses_a_wrong_argument_count():
    with pytest.raises(TypeError, match="k takes 2 arguments, got 1"):
        RecordingKernel("k", ["int64", "float32"]).pack([1])
