"""fp4gen.RNGState: where stochastic rounding's random bits come from.

A state is a (seed, offset) pair held in an int64 tensor on the device it serves. A quantize call with
rounding="stochastic" keys its random bits by (seed, offset, element index) and then advances the offset
by OFFSETS_PER_CALL on the device, without reading it on the host: calls never synchronize, and a CUDA-graph
replay of a captured call draws fresh bits, because the replayed increment moves the offset it reads next.
"""
from __future__ import annotations

import torch

from .lasting import made_to_last

# One offset for each copy a call can write: the rowwise copy draws with the offset, the columnwise copy with
# the offset + 1, so the two copies of one call never share bits.
OFFSETS_PER_CALL = 2


def _wrap_int64(value: int) -> int:
    """An unsigned 64-bit seed as the int64 with the same bits (torch.initial_seed() can exceed 2^63 - 1)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class RNGState:
    """(seed, offset) for stochastic rounding on one device.

    RNGState(seed=None, device=None): seed None takes torch.initial_seed(); device None is the CPU. Pass it
    as fp4gen.quantize(..., rounding="stochastic", rng=state). Without rng, quantize uses the default state
    of the input's device (RNGState.default), which follows torch.manual_seed.
    """

    def __init__(self, seed: int | None = None, device=None):
        if seed is None:
            seed = torch.initial_seed()
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        # a normal tensor even when made under torch.inference_mode, so that calls outside it can advance it
        self.tensor = made_to_last(torch.tensor, [_wrap_int64(seed), 0], dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "RNGState":
        """A state over an existing int64 [seed, offset] tensor (shared, not copied: advancing the state
        advances the tensor), as the fp4gen custom ops receive it."""
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tuple(tensor.shape) != (2,):
            raise ValueError(f"an RNGState tensor is int64 [seed, offset]; got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)} {tuple(getattr(tensor, 'shape', ()))}")
        state = cls.__new__(cls)
        state.tensor = tensor
        return state

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def seed(self) -> torch.Tensor:
        """0-d int64 tensor on the device (a view: reading it does not synchronize)."""
        return self.tensor[0]

    @property
    def offset(self) -> torch.Tensor:
        """0-d int64 tensor on the device: where the next call draws from."""
        return self.tensor[1]

    def advance(self) -> None:
        """Move past one call's draws, on the device (captured into CUDA graphs like any kernel)."""
        self.tensor[1:].add_(OFFSETS_PER_CALL)

    def reset(self, seed: int | None = None) -> None:
        """Start the stream afresh, in place: seed (None: torch.initial_seed()) and offset 0. Use it to
        repeat a run's random bits, since torch.manual_seed with the seed the default state already has
        does not restart that state (see default)."""
        if seed is None:
            seed = torch.initial_seed()
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.tensor.copy_(torch.tensor([_wrap_int64(seed), 0], dtype=torch.int64))

    def __repr__(self) -> str:
        return f"RNGState(device={self.device})"  # reading seed and offset would synchronize

    _defaults: dict = {}

    @classmethod
    def default(cls, device) -> "RNGState":
        """The state quantize uses without rng=: one per device, seeded from torch.initial_seed(), and
        started afresh (offset 0, in place) whenever torch.initial_seed() has changed since (torch.manual_seed
        with another seed). Seeding twice with the same value does not restart it: call reset() for that."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        seed = torch.initial_seed()
        entry = cls._defaults.get(device)
        if entry is None:
            entry = cls._defaults[device] = (seed, cls(seed, device))
        elif entry[0] != seed:  # the same tensor restarted, so that a compiled step holding it follows
            entry[1].reset(seed)
            entry = cls._defaults[device] = (seed, entry[1])
        return entry[1]


@torch.compiler.assume_constant_result
def default_state_tensor(device: torch.device) -> torch.Tensor:
    """RNGState.default(device).tensor, as the layers' training steps take it. Under torch.compile this runs once,
    when the step is traced, and the compiled step keeps the tensor (its offset still advances on the device each
    step): torch.initial_seed(), which RNGState.default reads, returns no tensor and would stop a fullgraph
    compile. A torch.manual_seed with a new seed reaches the compiled step when the next eager call looks the default
    state up (it restarts the same tensor), or at once with RNGState.default(device).reset()."""
    return RNGState.default(device).tensor
