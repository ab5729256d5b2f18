"""Dequantize bandwidth on the current GPU against a device-to-device copy of the same bytes.

Prints one table: shape, out dtype, fp4gen time, bytes moved (NVFP4 read + output written) over that
time, the copy's bandwidth measured in this run, and their ratio.
"""
import torch
import triton.testing

import fp4gen

SHAPES = [(8192, 8192), (16384, 4096), (32768, 8192)]


def _median_ms(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main():
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>14} {'out':>9} {'fp4gen us':>10} {'GB/s':>8} {'copy GB/s':>10} {'ratio':>6}")
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        op = fp4gen.quantize(x, scaling="row", columnwise=False, backend="reference").rowwise
        for dtype in (torch.bfloat16, torch.float32):
            out_bytes = rows * cols * torch.empty(0, dtype=dtype).element_size()
            moved = op.data.numel() + op.scale.numel() + op.amax.numel() * 4 + out_bytes
            ms = _median_ms(lambda: fp4gen.dequantize(op, dtype))
            src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = _median_ms(lambda: dst.copy_(src))  # same total bytes: half read, half written
            gbs, copy_gbs = moved / ms / 1e6, moved / copy_ms / 1e6
            print(f"{rows:>6}x{cols:<7} {str(dtype)[6:]:>9} {ms * 1e3:>10.1f} {gbs:>8.0f} {copy_gbs:>10.0f} "
                  f"{gbs / copy_gbs:>6.2f}")


if __name__ == "__main__":
    main()
