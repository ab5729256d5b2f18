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


GROUPED_LAYOUTS = ("rows", "columns", "stacked")


@dataclass(frozen=True, eq=False)
class GroupedNVFP4Data:
    """One copy of a grouped NVFP4 tensor (`fp4gen.quantize_grouped`), in one of three layouts:

    "rows"     groups are ranges of rows of one operand (the rowwise copy of tokens sorted by group):
               data [T, K/2], scale [T, K/16]; amax [T] (row_scaled) or [E] (one per group); group g is
               rows offsets[g-1] .. offsets[g]-1.
    "columns"  each group's transpose, its tokens padded with zeros to a multiple of 64, side by side along
               the columns of one operand: data [K, C/2], scale [K, C/16]; amax [E, K] (row_scaled: per
               column of each group) or [E]; group g is columns padded_offsets[g-1] .. padded_offsets[g]-1.
               C, the capacity, bounds the padded sizes for any routing (64 * floor((T + 63 E) / 64));
               columns past padded_offsets[-1] hold zero codes and scales.
    "stacked"  one matrix per group: data [E, R, S/2], scale [E, R, S/16]; amax [E, R] (row_scaled) or [E].

    offsets / padded_offsets: int64 [E] cumulative group ends on the data's device ("rows" needs offsets,
    "columns" both, "stacked" neither). e4m3_max: 448, or 256 after 4over6.
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    layout: str
    row_scaled: bool
    offsets: torch.Tensor | None = None
    padded_offsets: torch.Tensor | None = None
    e4m3_max: float = 448.0

    def __post_init__(self):
        data, scale, amax = (_require_tensor(n, getattr(self, n)) for n in ("data", "scale", "amax"))
        _require_dtype("data", data, torch.uint8, " (two E2M1 codes per byte)")
        _require_dtype("scale", scale, torch.float8_e4m3fn)
        _require_dtype("amax", amax, torch.float32)
        if self.layout not in GROUPED_LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; it must be one of {', '.join(map(repr, GROUPED_LAYOUTS))}")
        if not isinstance(self.row_scaled, bool):
            raise TypeError(f"row_scaled must be True or False, got {self.row_scaled!r}")
        dims = 3 if self.layout == "stacked" else 2
        if data.dim() != dims or scale.dim() != dims:
            raise ValueError(f"a {self.layout!r} copy has {dims}-D data and scale, got {tuple(data.shape)} and "
                             f"{tuple(scale.shape)}")
        if tuple(scale.shape) != (*data.shape[:-1], data.shape[-1] // 8):
            raise ValueError(f"scale has shape {tuple(scale.shape)}; for data {tuple(data.shape)} it must be "
                             f"{(*data.shape[:-1], data.shape[-1] // 8)}")
        needs = {"rows": ("offsets",), "columns": ("offsets", "padded_offsets"), "stacked": ()}[self.layout]
        for name in ("offsets", "padded_offsets"):
            t = getattr(self, name)
            if name in needs:
                _require_tensor(name, t)
                _require_dtype(name, t, torch.int64)
                if t.dim() != 1 or t.shape[0] < 1 or t.device != data.device:
                    raise ValueError(f"{name} must be a non-empty 1-D tensor on {data.device}, got "
                                     f"{tuple(t.shape)} on {t.device}")
            elif t is not None:
                raise ValueError(f"a {self.layout!r} copy has no {name}")
        if self.padded_offsets is not None and self.padded_offsets.shape != self.offsets.shape:
            raise ValueError("offsets and padded_offsets must have one entry per group each")
        if tuple(amax.shape) != self._amax_shape():
            raise ValueError(f"amax has shape {tuple(amax.shape)}; this {self.layout!r} copy with "
                             f"row_scaled={self.row_scaled} needs {self._amax_shape()}")
        for name in ("scale", "amax"):
            if getattr(self, name).device != data.device:
                raise ValueError(f"{name} is on {getattr(self, name).device} but data is on {data.device}")
        for name, t in (("data", data), ("scale", scale)):
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{name} has strides {tuple(t.stride())}; its last dimension must be contiguous")
        if self.layout == "stacked" and not (data.is_contiguous() and scale.is_contiguous()):
            raise ValueError("a 'stacked' copy's data and scale must be contiguous (one group's matrix after another)")
        if self.e4m3_max not in E4M3_MAX_VALUES:
            raise ValueError(f"e4m3_max={self.e4m3_max!r}; it must be 448 (standard) or 256 (4over6)")
        object.__setattr__(self, "e4m3_max", float(self.e4m3_max))

    def _amax_shape(self) -> tuple:
        if not self.row_scaled:
            return (self.groups,)
        return {"rows": (self.data.shape[0],), "columns": (self.groups, self.data.shape[0]),
                "stacked": tuple(self.data.shape[:2])}[self.layout]

    @classmethod
    def _made_by_fp4gen(cls, data, scale, amax, layout, row_scaled, offsets, padded_offsets,
                        e4m3_max) -> "GroupedNVFP4Data":
        """A copy fp4gen's own kernels just produced: the checks above hold by construction."""
        copy = object.__new__(cls)
        for name, value in (("data", data), ("scale", scale), ("amax", amax), ("layout", layout),
                            ("row_scaled", row_scaled), ("offsets", offsets), ("padded_offsets", padded_offsets),
                            ("e4m3_max", e4m3_max)):
            object.__setattr__(copy, name, value)
        return copy

    @property
    def groups(self) -> int:
        return self.data.shape[0] if self.layout == "stacked" else self.offsets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def group(self, g: int) -> NVFP4Data:
        """Group g as a dense NVFP4Data (views, no copy); a "columns" group includes its padding tokens. Reads
        the offsets on the host, a synchronization: for inspection and tests, not for a training step."""
        if not 0 <= g < self.groups:
            raise IndexError(f"group {g} of {self.groups}")
        tensor_amax = None if self.row_scaled else self.amax[g:g + 1]
        if self.layout == "stacked":
            return NVFP4Data(self.data[g], self.scale[g], self.amax[g] if self.row_scaled else tensor_amax,
                             self.e4m3_max)
        ends = (self.offsets if self.layout == "rows" else self.padded_offsets).tolist()
        start, end = (ends[g - 1] if g else 0), ends[g]
        if self.layout == "rows":
            return NVFP4Data(self.data[start:end], self.scale[start:end],
                             self.amax[start:end] if self.row_scaled else tensor_amax, self.e4m3_max)
        return NVFP4Data(self.data[:, start // 2:end // 2], self.scale[:, start // BLOCK:end // BLOCK],
                         self.amax[g] if self.row_scaled else tensor_amax, self.e4m3_max)

    def __reduce__(self):
        return (GroupedNVFP4Data, (self.data, self.scale, self.amax, self.layout, self.row_scaled, self.offsets,
                                   self.padded_offsets, self.e4m3_max))

    def __repr__(self) -> str:
        amax = "per row" if self.row_scaled else "per group"
        return (f"GroupedNVFP4Data(layout={self.layout!r}, groups={self.groups}, data {list(self.data.shape)}, "
                f"amax {amax}, device={self.device})")


@dataclass(frozen=True, eq=False)
class GroupedNVFP4Tensor:
    """The result of `fp4gen.quantize_grouped`: a rowwise copy ("rows" or "stacked") and/or a columnwise copy
    ("columns" or "stacked") of a grouped input."""

    rowwise: GroupedNVFP4Data | None
    columnwise: GroupedNVFP4Data | None
    shape: tuple  # the input's shape
    dtype: torch.dtype
    scaling: str
    block: tuple

    def __reduce__(self):
        return (GroupedNVFP4Tensor, (self.rowwise, self.columnwise, self.shape, self.dtype, self.scaling, self.block))

    def __repr__(self) -> str:
        copies = [name for name in ("rowwise", "columnwise") if getattr(self, name) is not None]
        some = self.rowwise or self.columnwise
        dtype = str(self.dtype).replace("torch.", "")
        return (f"GroupedNVFP4Tensor(shape={list(self.shape)}, groups={some.groups}, from {dtype}, "
                f"scaling={self.scaling!r}, block={self.block}, copies={'+'.join(copies)}, device={some.device})")


torch.serialization.add_safe_globals([NVFP4Data, NVFP4Tensor, GroupedNVFP4Data, GroupedNVFP4Tensor])
