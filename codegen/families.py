"""Kernel families: what a spec of each `family` may vary, and the fixed facts of its kernels.

A family names its template, the axes a spec enumerates (with the table each value comes from), the
order of name tokens, the C ABI parameter list and the problem constraints that go into the manifest.
Adding a variant never touches this file; adding a new kind of kernel does.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import tables


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str

    @property
    def kind(self) -> str:
        return tables.C_PARAM_KINDS[self.ctype]


@dataclass(frozen=True)
class Family:
    name: str
    op: str  # the runtime operation the kernels implement
    description: str
    template: str  # file under templates/
    name_prefix: str  # first token of every kernel name of the family
    axes: dict  # axis -> {allowed value: name token}, in name-token order
    params: tuple  # C ABI parameters of <name>_can_implement / _workspace_size / _run (run adds the stream)
    constraints: dict  # problem rules the dispatcher checks and reports, e.g. {"cols_multiple_of": 16}
    alignment: dict  # pointer argument -> required byte alignment


def _tokens(table: dict, fmt: str = "{}") -> dict:
    return {key: fmt.format(key) for key in table}


FAMILIES = {
    "dequantize": Family(
        name="dequantize",
        op="dequantize",
        description="NVFP4 operand (E2M1 codes, E4M3 block scales, fp32 amax) -> 16- or 32-bit tensor",
        template="dequantize.cu.j2",
        name_prefix="dequantize_nvfp4",
        axes={"out_dtype": _tokens(tables.DTYPES, "to_{}"), "arch": _tokens(tables.ARCHS)},
        params=(
            Param("data", "const uint8_t*"),
            Param("scale", "const uint8_t*"),
            Param("amax", "const float*"),
            Param("out", "void*"),
            Param("rows", "int64_t"),
            Param("cols", "int64_t"),
            Param("data_row_stride", "int64_t"),  # bytes
            Param("scale_row_stride", "int64_t"),  # bytes
            Param("amax_stride", "int64_t"),  # elements: 1 per-row amax, 0 per-tensor
            Param("out_row_stride", "int64_t"),  # elements
        ),
        # each thread loads the codes of one 16-byte output vector (up to 4 bytes) and stores the vector
        constraints={"cols_multiple_of": 16},
        alignment={"data": 4, "out": 16},
    ),
}
