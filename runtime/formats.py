"""The NVFP4 containers: one quantized direction (`NVFP4Data`) and a quantized tensor (`NVFP4Tensor`).

Layout (docs/numerics.md): an operand of logical shape [rows, cols] holds
  data   uint8 [rows, cols/2]          E2M1 codes, element 2j in the low nibble of byte j
  scale  float8_e4m3fn [rows, cols/16] one decode scale per 16 consecutive elements of a row (compact)
  amax   float32 [rows] or [1]         second-level amax: per row (row-scaled) or per tensor

Both containers pickle as a constructor call on their tensors, and fp4gen registers them with
torch.serialization, so `torch.load(path, weights_only=True)` loads them once fp4gen is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16  # elements per NVFP4 scale block along a row
# The largest E4M3 block scale a tensor's encode scale aims at: 448 for every standard tensor, 256 for
# 4over6 tensors (whose map-to-4 blocks need headroom). Decode and GEMM factors use 6 * e4m3_max.
E4M3_MAX_VALUES = (448.0, 256.0)


def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_dtype(name: str, t: torch.Tensor, dtype: torch.dtype, hint: str = "") -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}.dtype is {t.dtype}; it must be {dtype}{hint}")


def _require_inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name} has strides {tuple(t.stride())}; its last dimension must be contiguous (stride 1)")


@dataclass(frozen=True, eq=False)
class NVFP4Data:
    """One K-major NVFP4 operand: `data`, `scale` and `amax` of a [rows, cols] matrix, and the `e4m3_max`
    its scales were made for (448, or 256 for 4over6).

    Validated on construction, so a user can build one from their own tensors and get a clear error
    for a wrong dtype, shape, amax length or device.
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    e4m3_max: float = 448.0

    def __post_init__(self):
        data = _require_tensor("data", self.data)
        scale = _require_tensor("scale", self.scale)
        amax = _require_tensor("amax", self.amax)
        _require_dtype("data", data, torch.uint8, " (two E2M1 codes per byte)")
        _require_dtype("scale", scale, torch.float8_e4m3fn,
                       " (E4M3 block scales; a uint8 tensor of scale bytes can be passed as "
                       "scale.view(torch.float8_e4m3fn))")
        _require_dtype("amax", amax, torch.float32)
        if data.dim() != 2:
            raise ValueError(f"data must be 2-D [rows, cols/2], got shape {tuple(data.shape)}")
        rows, cols = data.shape[0], 2 * data.shape[1]
        if cols % BLOCK:
            raise ValueError(
                f"data has shape {tuple(data.shape)}, i.e. {cols} columns; the column count must be a "
                f"multiple of {BLOCK} (one E4M3 scale per {BLOCK} elements)")
        if tuple(scale.shape) != (rows, cols // BLOCK):
            raise ValueError(
                f"scale has shape {tuple(scale.shape)}; for data of shape {tuple(data.shape)} "
                f"([{rows}, {cols}] elements) it must be [{rows}, {cols // BLOCK}]")
        if amax.dim() != 1 or amax.shape[0] not in (1, rows):
            raise ValueError(
                f"amax has shape {tuple(amax.shape)}; it must be [1] (per-tensor) or [{rows}] "
                f"(one per row)")
        for name, t in (("scale", scale), ("amax", amax)):
            if t.device != data.device:
                raise ValueError(f"{name} is on {t.device} but data is on {data.device}; "
                                 f"all tensors of an operand must be on one device")
        _require_inner_contiguous("data", data)
        _require_inner_contiguous("scale", scale)
        if self.e4m3_max not in E4M3_MAX_VALUES:
            raise ValueError(f"e4m3_max={self.e4m3_max!r}; it must be 448 (standard) or 256 (4over6)")
        object.__setattr__(self, "e4m3_max", float(self.e4m3_max))

    @classmethod
    def _made_by_fp4gen(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                        e4m3_max: float) -> "NVFP4Data":
        """An operand that fp4gen's own kernels just produced (or that fp4gen.nn passes between its own calls):
        the checks above hold by construction, and skipping them takes several microseconds off each call."""
        operand = object.__new__(cls)
        for name, value in (("data", data), ("scale", scale), ("amax", amax), ("e4m3_max", e4m3_max)):
            object.__setattr__(operand, name, value)
        return operand

    @property
    def shape(self) -> tuple[int, int]:
        """Logical [rows, cols] shape in elements."""
        return (self.data.shape[0], 2 * self.data.shape[1])

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def row_scaled(self) -> bool:
        """True when amax holds one value per row (a one-row operand counts as per-tensor)."""
        return self.amax.shape[0] != 1

    def to(self, device, non_blocking: bool = False) -> "NVFP4Data":
        """The same operand with its three tensors on `device` (self when they are there already)."""
        device = torch.device(device)
        if self.data.device == device:
            return self
        return NVFP4Data(*(t.to(device, non_blocking=non_blocking) for t in (self.data, self.scale, self.amax)),
                         self.e4m3_max)

    def __reduce__(self):
        # a constructor call on tensors and a float: the weights_only unpickler accepts it for a registered class
        return (NVFP4Data, (self.data, self.scale, self.amax, self.e4m3_max))

    def __repr__(self) -> str:
        rows, cols = self.shape
        amax = f"per row [{rows}]" if self.row_scaled else "per tensor [1]"
        e4m3 = "" if self.e4m3_max == 448.0 else f", e4m3_max={self.e4m3_max:g}"
        return f"NVFP4Data(shape=[{rows}, {cols}], amax {amax}{e4m3}, device={self.device})"


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """The result of `fp4gen.quantize`: a rowwise copy of x [M, K] and/or a columnwise copy (of x.T)."""

    rowwise: NVFP4Data | None
    columnwise: NVFP4Data | None
    shape: tuple  # shape of the original (unflattened) input
    dtype: torch.dtype  # dtype of the original input
    scaling: str  # "row" or "tensor"
    block: tuple  # (1, 16) or (16, 16)

    def to(self, device, non_blocking: bool = False) -> "NVFP4Tensor":
        """The same tensor with both copies on `device`."""
        move = (lambda op: op.to(device, non_blocking) if op is not None else None)
        return NVFP4Tensor(move(self.rowwise), move(self.columnwise), self.shape, self.dtype, self.scaling,
                           self.block)

    def __reduce__(self):
        return (NVFP4Tensor, (self.rowwise, self.columnwise, self.shape, self.dtype, self.scaling, self.block))

    def __repr__(self) -> str:
        copies = [name for name in ("rowwise", "columnwise") if getattr(self, name) is not None]
        device = (self.rowwise or self.columnwise).device
        dtype = str(self.dtype).replace("torch.", "")
        return (f"NVFP4Tensor(shape={list(self.shape)}, from {dtype}, scaling={self.scaling!r}, "
                f"block={self.block}, copies={'+'.join(copies)}, device={device})")


torch.serialization.add_safe_globals([NVFP4Data, NVFP4Tensor])
