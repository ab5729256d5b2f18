"""Timing helpers shared by the bench scripts: CUDA-event medians (triton.testing.do_bench) of an eager
call, and of the same call captured in a CUDA graph (device time without Python launch overhead)."""
import torch
import triton.testing


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def graph_median_ms(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def copy_bandwidth_gbs(total_bytes: int) -> float:
    """A device-to-device copy moving total_bytes (half read, half written), in GB/s."""
    src = torch.empty(total_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return total_bytes / median_ms(lambda: dst.copy_(src)) / 1e6
