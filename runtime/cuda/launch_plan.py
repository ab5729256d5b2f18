"""Launch plans: which kernels a call launches, with which arguments, worked out once per kind of call and then
run for each call on its own tensors.

Working out a call (manifest lookups through the selection rule, row-pass limits, workspace queries, argument
lists) costs tens of microseconds of Python, several times what launching its kernels costs the host. A plan
keeps the result: the buffers a call allocates, and each launch's arguments with the per-call pointers (the
inputs, the buffers) left as slots. Running it allocates the buffers, fills the slots and launches, in the
order the plan was built: in one call into the C++ launcher (launcher.cpp), which makes the allocations and
launches without a Python step between them.
"""
from __future__ import annotations

import torch

from . import launcher


class Slot(int):
    """An argument of a launch template that each run fills in: the index of a per-call pointer (one of the
    plan's inputs, or one of its buffers)."""


INPUT, RNG = Slot(0), Slot(1)  # a quantize plan's inputs: x's pointer; the random state's (None without one)


class LaunchPlan:
    """Buffers to allocate and kernels to launch, in order. Built once with buffer(), launch() and zero(); then
    run() for each call. Slots 0 .. inputs-1 are the run's input tensors, the buffers' slots follow. `result` is
    for the caller: what the buffers mean (run() does not read it)."""

    __slots__ = ("inputs", "buffers", "launches", "zeroed", "shared", "result", "_native")

    def __init__(self, inputs: int = 2):
        self.inputs = inputs
        self.buffers = []  # (shape, dtype) of each buffer, allocated by every run
        self.launches = []  # (kernel, argument template, ((position, slot), ...))
        self.zeroed = []  # buffers that a run zeroes (an empty input's amaxes) instead of launching
        self.shared = []  # groups of buffer slots that the C++ launcher allocates together (share())
        self.result = None
        self._native = None  # the C++ launcher's copy of the plan, made at its first run there

    def buffer(self, *shape: int, dtype: torch.dtype = torch.uint8) -> Slot:
        self.buffers.append((shape, dtype))
        return Slot(self.inputs + len(self.buffers) - 1)

    def launch(self, kernel, *args) -> None:
        """A launch of kernel with args, where Slot arguments stand for per-call pointers and None for a null one."""
        slots = tuple((position, arg) for position, arg in enumerate(args) if type(arg) is Slot)
        self.launches.append((kernel, args, slots))

    def zero(self, *slots) -> None:
        """Zero these buffers in each run (None and repeats are skipped)."""
        self.zeroed += [slot for slot in dict.fromkeys(slots) if slot is not None and slot not in self.zeroed]

    def share(self, *slots) -> None:
        """Allocate these buffers (None is skipped) as one allocation in each run through the C++ launcher, each at a
        multiple of 256 bytes in it: one allocator call instead of one each. For buffers whose lifetimes end
        together (a run's scratch, or the parts of one operand): memory is freed when the last of them is."""
        group = [slot for slot in slots if slot is not None]
        taken = {slot for other in self.shared for slot in other}
        if len(set(group)) != len(group) or any(not self.inputs <= slot < self.inputs + len(self.buffers)
                                                or slot in taken for slot in group):
            raise ValueError(f"slots {group}: share() takes distinct buffers that no other group shares")
        self.shared.append(group)

    def include(self, other: "LaunchPlan", inputs: list) -> dict:
        """Append other's buffers, zeroing and launches to this plan, with other's input i standing for
        inputs[i] (a slot of this plan, or None for a null pointer); returns other's slots -> this plan's."""
        if len(inputs) != other.inputs:
            raise ValueError(f"the included plan takes {other.inputs} inputs, got {len(inputs)}")
        if other.shared:  # the including plan decides what its buffers share
            raise ValueError("an included plan's buffers cannot be shared: share() them in the including plan")
        mapping = dict(enumerate(inputs))
        for index, (shape, dtype) in enumerate(other.buffers):
            mapping[other.inputs + index] = self.buffer(*shape, dtype=dtype)
        self.zero(*(mapping[slot] for slot in other.zeroed))
        for kernel, template, slots in other.launches:
            args = list(template)
            for position, slot in slots:
                args[position] = mapping[slot]
            self.launch(kernel, *args)
        return mapping

    def run(self, launch, inputs: list, device: torch.device) -> list:
        """Allocate the buffers on `device`, then launch each kernel with its slots filled from `inputs` (tensors
        or None, one per input slot) and the buffers; returns the buffers (see tensor()). Through the C++
        launcher (launcher.py) on a CUDA device, unless FP4GEN_LAUNCHER=python; else from Python, through
        launch(kernel, device, *args)."""
        if device.type == "cuda" and launcher.enabled():
            buffers, failed, status = self.native().run(inputs, device.index, raw_stream(device.index))
            if status:
                self.launches[failed][0].raise_for(status, "run")
            return buffers
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.buffers]
        for slot in self.zeroed:
            buffers[slot - self.inputs].zero_()
        if self.launches:
            pointers = [t.data_ptr() if t is not None else None for t in inputs]
            pointers += [buffer.data_ptr() for buffer in buffers]
            for kernel, template, slots in self.launches:
                args = list(template)
                for position, slot in slots:
                    args[position] = pointers[slot]
                launch(kernel, device, *args)
        return buffers

    def native(self):
        """The plan in the C++ launcher, made at the first call (the plan must be complete by then)."""
        return self._native if self._native is not None else self._make_native()

    def _make_native(self):
        shared = [-1] * len(self.buffers)
        for group, slots in enumerate(self.shared):
            for slot in slots:
                shared[slot - self.inputs] = group
        self._native = launcher.module().Plan(
            self.inputs, [(list(shape), str(dtype).replace("torch.", "")) for shape, dtype in self.buffers],
            list(self.zeroed),
            [(kernel.run_packed_address, kernel.pack(template), list(slots))
             for kernel, template, slots in self.launches], shared)
        return self._native

    def tensor(self, buffers: list, slot):
        """The buffer of `slot` among run()'s buffers, or None for a None slot."""
        return buffers[slot - self.inputs] if slot is not None else None


# The current stream's handle, straight from PyTorch's C++ state: the public torch.cuda.current_stream(device)
# .cuda_stream builds a Stream object on every call. (A CPU-only build of PyTorch has none; nothing launches there.)
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def remember(plans: dict, key, plan, limit: int = 4096):
    """plans[key] = plan, emptying plans first when it holds `limit` entries: keys that change every call (a
    token count that never repeats) must not grow it forever."""
    if len(plans) >= limit:
        plans.clear()
    plans[key] = plan
    return plan
