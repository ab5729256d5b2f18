"""Launch plans: which kernels a call launches, with which arguments, worked out once per kind of call and then
run for each call on its own tensors.

Working out a call (manifest lookups through the selection rule, row-pass limits, workspace queries, argument
lists) costs tens of microseconds of Python, several times what launching its kernels costs the host. A plan
keeps the result: the buffers a call allocates, and each launch's arguments with the per-call pointers (the
input, the random state, the buffers) left as slots. Running it allocates the buffers, fills the slots and
launches, in the order the plan was built.
"""
from __future__ import annotations

import torch


class Slot(int):
    """An argument of a launch template that each run fills in: the index of a per-call pointer (the input,
    the random state, or a buffer of the plan)."""


INPUT, RNG = Slot(0), Slot(1)  # the input's pointer; the random state's (None without one)
_FIRST_BUFFER = 2


class LaunchPlan:
    """Buffers to allocate and kernels to launch, in order. Built once with buffer(), launch() and zero(); then
    run() for each call. `result` is for the caller: what the buffers mean (run() does not read it)."""

    __slots__ = ("buffers", "launches", "zeroed", "result")

    def __init__(self):
        self.buffers = []  # (shape, dtype) of each buffer, allocated by every run
        self.launches = []  # (kernel, argument template, ((position, slot), ...))
        self.zeroed = []  # buffers that a run zeroes (an empty input's amaxes) instead of launching
        self.result = None

    def buffer(self, *shape: int, dtype: torch.dtype = torch.uint8) -> Slot:
        self.buffers.append((shape, dtype))
        return Slot(_FIRST_BUFFER + len(self.buffers) - 1)

    def launch(self, kernel, *args) -> None:
        """A launch of kernel with args, where Slot arguments stand for per-call pointers and None for a null one."""
        slots = tuple((position, arg) for position, arg in enumerate(args) if type(arg) is Slot)
        self.launches.append((kernel, args, slots))

    def zero(self, *slots) -> None:
        """Zero these buffers in each run (None and repeats are skipped)."""
        self.zeroed += [slot for slot in dict.fromkeys(slots) if slot is not None and slot not in self.zeroed]

    def run(self, launch, x: torch.Tensor, rng_state) -> list:
        """Allocate the buffers on x's device, then launch(kernel, device, *args) each launch with its slots
        filled in; returns the buffers (index slot - 2 holds that slot's buffer)."""
        device = x.device
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.buffers]
        for slot in self.zeroed:
            buffers[slot - _FIRST_BUFFER].zero_()
        if self.launches:
            pointers = [x.data_ptr(), rng_state.data_ptr() if rng_state is not None else None]
            pointers += [buffer.data_ptr() for buffer in buffers]
            for kernel, template, slots in self.launches:
                args = list(template)
                for position, slot in slots:
                    args[position] = pointers[slot]
                launch(kernel, device, *args)
        return buffers

    def tensor(self, buffers: list, slot):
        """The buffer of `slot` among run()'s buffers, or None for a None slot."""
        return buffers[slot - _FIRST_BUFFER] if slot is not None else None


def remember(plans: dict, key, plan, limit: int = 4096):
    """plans[key] = plan, emptying plans first when it holds `limit` entries: keys that change every call (a
    token count that never repeats) must not grow it forever."""
    if len(plans) >= limit:
        plans.clear()
    plans[key] = plan
    return plan
