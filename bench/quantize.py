"""fp4gen.quantize on the current GPU against a device-to-device copy (the memory roofline) and torch.compile.

For each shape and mode it prints: the time of the whole call (row scaling with a rowwise copy: the row pass,
then the columnwise-only quantize kernel; otherwise the amax pass, then the quantize kernel) called eagerly
and replayed from a CUDA graph (device time, no Python launch overhead), the traffic bandwidth of the
graph time (input bytes read twice, plus every output byte written), a device-to-device copy of the same
number of bytes measured in the same run, the ratio of the two, and the speed-up of the eager call over
`torch.compile` of the reference backend's quantize. Rows marked "(amax + quantize)" time the same call with
the row pass turned off (fp4gen.cuda.ops.row_pass_limits(0)): the path it replaced.

`python quantize.py --options` times the training-quality options (stochastic rounding, the Hadamard
transform, 4over6) the same way, beside the plain call, on the path each takes (docs/kernel-selection.md:
the plain kernels' variants for stochastic rounding of bf16 and the transform, quantize_options for 4over6).

`python quantize.py --paths` compares the two paths (graph time) over more shapes and dtypes, the row pass
allowed for any row width.
"""
import contextlib

import torch

import fp4gen
from fp4gen import reference
from fp4gen.cuda import ops
from timing import copy_bandwidth_gbs, graph_median_ms, median_ms

SHAPES = [(8192, 8192), (16384, 4096)]
MODES = [  # (label, scaling, block, rowwise, columnwise, row pass allowed)
    ("row-scaled, both", "row", (1, 16), True, True, True),
    ("  (amax + quantize)", "row", (1, 16), True, True, False),
    ("per-tensor, both", "tensor", (1, 16), True, True, True),
    ("row-scaled, rowwise", "row", (1, 16), True, False, True),
    ("  (amax + quantize)", "row", (1, 16), True, False, False),
    ("16x16 weights, both", "tensor", (16, 16), True, True, True),
]


def _traffic_bytes(rows, cols, elem, rowwise, columnwise, row_scaled):
    total = 2 * rows * cols * elem  # x counted as read twice on either path, so that the ratios compare
    if rowwise:
        total += rows * cols // 2 + rows * cols // 16 + (rows if row_scaled else 1) * 4
    if columnwise:
        total += rows * cols // 2 + rows * cols // 16 + (cols if row_scaled else 1) * 4
    return total


def _measure(x, rowwise, columnwise, scaling, **kw):
    """(eager ms, graph ms, traffic GB/s of the graph time, copy GB/s of the same bytes) of one quantize call."""
    rows, cols = x.shape
    call = lambda: fp4gen.quantize(x, rowwise=rowwise, columnwise=columnwise, scaling=scaling, **kw)  # noqa: E731
    ms, graph_ms = median_ms(call), graph_median_ms(call)
    moved = _traffic_bytes(rows, cols, x.element_size(), rowwise, columnwise, scaling == "row")
    return ms, graph_ms, moved / graph_ms / 1e6, copy_bandwidth_gbs(moved)


def _row(rows, cols, label, ms, graph_ms, gbs, copy_gbs):
    return (f"{rows:>5}x{cols:<6} {label:<21} {ms * 1e3:>8.1f} {graph_ms * 1e3:>8.1f} {gbs:>6.0f} {copy_gbs:>9.0f} "
            f"{gbs / copy_gbs:>7.2f}")


def main():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>12} {'mode':<21} {'eager us':>8} {'graph us':>8} {'GB/s':>6} {'copy GB/s':>9} "
          f"{'of copy':>7} {'compiled us':>11} {'speed-up':>8}")
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        for label, scaling, block, rowwise, columnwise, row_pass in MODES:
            with contextlib.nullcontext() if row_pass else ops.row_pass_limits(0):
                ms, graph_ms, gbs, copy_gbs = _measure(x, rowwise, columnwise, scaling, block=block)
            compiled = torch.compile(reference.quantize, dynamic=False)
            compiled_ms = median_ms(lambda: compiled(x, scaling, block, rowwise, columnwise))
            print(f"{_row(rows, cols, label, ms, graph_ms, gbs, copy_gbs)} {compiled_ms * 1e3:>11.1f} "
                  f"{compiled_ms / ms:>8.2f}", flush=True)


OPTION_MODES = [  # (label, scaling, block, options)
    ("row-scaled, both", "row", (1, 16), {}),
    ("  + RHT", "row", (1, 16), dict(hadamard=True)),
    ("  + 4over6", "row", (1, 16), dict(four_over_six="mae")),
    ("  + RHT + 4over6", "row", (1, 16), dict(hadamard=True, four_over_six="mae")),
    ("per-tensor, both", "tensor", (1, 16), {}),
    ("  + SR", "tensor", (1, 16), dict(rounding="stochastic")),
    ("  + SR + RHT", "tensor", (1, 16), dict(rounding="stochastic", hadamard=True)),
    ("  + RHT", "tensor", (1, 16), dict(hadamard=True)),
    ("row-scaled, both, SR", "row", (1, 16), dict(rounding="stochastic")),
    ("  + RHT", "row", (1, 16), dict(rounding="stochastic", hadamard=True)),
    ("16x16 weights, both", "tensor", (16, 16), {}),
    ("  + 4over6", "tensor", (16, 16), dict(four_over_six="mae")),
]


def compare_options():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>12} {'mode (both copies)':<21} {'eager us':>8} {'graph us':>8} {'GB/s':>6} {'copy GB/s':>9} "
          f"{'of copy':>7}")
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        for label, scaling, block, options in OPTION_MODES:
            print(_row(rows, cols, label, *_measure(x, True, True, scaling, block=block, **options)), flush=True)


# --paths: the row pass against the path it replaced, over more shapes (row scaling, bf16 and fp32): where
# the limits of fp4gen.cuda.ops.uses_row_pass should lie
PATH_SHAPES = [(256, 8192), (1024, 4096), (4096, 4096), (2048, 16384), (8192, 16384), (32768, 2048), (2048, 32768)]


def compare_paths():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>12} {'dtype':>8} {'copy':<8} {'row pass us':>11} {'amax + quantize us':>18} {'ratio':>6}")
    for rows, cols in PATH_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, cols, device="cuda", dtype=dtype)
            for label, columnwise in (("both", True), ("rowwise", False)):
                times = []
                for allowed in (1 << 30, 0):
                    with ops.row_pass_limits(allowed):
                        times.append(graph_median_ms(lambda: fp4gen.quantize(x, columnwise=columnwise)))
                print(f"{rows:>5}x{cols:<6} {str(dtype).replace('torch.', ''):>8} {label:<8} {times[0] * 1e3:>11.1f} "
                      f"{times[1] * 1e3:>18.1f} {times[1] / times[0]:>6.2f}", flush=True)


if __name__ == "__main__":
    import sys

    if "--paths" in sys.argv:
        compare_paths()
    elif "--options" in sys.argv:
        compare_options()
    else:
        main()
