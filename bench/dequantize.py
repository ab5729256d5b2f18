"""Dequantize on the current GPU against a device-to-device copy (the memory roofline) and torch.compile.

For each shape and output dtype it prints: the fp4gen time, the bytes it must move (NVFP4 data, scales
and amax read, output written) over that time, a device-to-device copy of the same number of bytes
measured in this run, the ratio of the two bandwidths, and the speed-up over `torch.compile` of the
reference backend's dequantize.
"""
import torch

import fp4gen
from fp4gen import reference
from timing import copy_bandwidth_gbs, median_ms

SHAPES = [(8192, 8192), (16384, 4096), (32768, 8192)]


def main():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>14} {'out':>9} {'fp4gen us':>10} {'GB/s':>7} {'copy GB/s':>10} {'of copy':>8} "
          f"{'compiled us':>12} {'speed-up':>9}")
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        op = fp4gen.quantize(x, scaling="row", columnwise=False, backend="reference").rowwise
        for dtype in (torch.bfloat16, torch.float32):
            out_bytes = rows * cols * torch.empty(0, dtype=dtype).element_size()
            moved = op.data.numel() + op.scale.numel() + op.amax.numel() * 4 + out_bytes
            ms = median_ms(lambda: fp4gen.dequantize(op, dtype))
            copy_gbs = copy_bandwidth_gbs(moved)
            compiled = torch.compile(reference.dequantize, dynamic=False)  # specialised per shape
            compiled_ms = median_ms(lambda: compiled(op, dtype))
            gbs = moved / ms / 1e6
            print(f"{rows:>6}x{cols:<7} {str(dtype)[6:]:>9} {ms * 1e3:>10.1f} {gbs:>7.0f} {copy_gbs:>10.0f} "
                  f"{gbs / copy_gbs:>8.2f} {compiled_ms * 1e3:>12.1f} {compiled_ms / ms:>9.2f}")


if __name__ == "__main__":
    main()
