// The per-group arguments of the CUTLASS grouped GEMMs (gemm_grouped_tma.cuh, gemm_grouped_sm100.cuh), written on
// the device from the group offsets, and what those kernels leave to others: the outputs of groups along K
// without k-tiles. A family's G supplies Shape, ElementD, Arrays (with `shapes`) and write_group.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

namespace fp4gen {
namespace grouped_args {

// What the arguments kernel needs to know of the call.
struct Problem {
  const void* c;
  void* d;
  const float *row_amax, *col_amax, *bias;
  int64_t m, n, k, ldc, ldd, row_is_vector;
  const int64_t* offsets;
  int64_t groups;
  bool along_k;
  int64_t c_group_stride, d_group_stride, row_amax_group_stride, col_amax_group_stride, bias_group_stride;
};

// One warp, 32 groups at a time, writes every group's arguments (G::write_group(p, arrays, g, begin, end, extra...))
// given its span: the offsets clamped in order into [0, limit] (a running maximum, as
// grouped_wgmma::row_tiles_kernel clamps them: spans never overlap or leave the operand).
template <class G, class... Extra>
__global__ void __launch_bounds__(32) arguments_kernel(const Problem p, const typename G::Arrays arrays,
                                                       Extra... extra) {
  const int64_t limit = p.along_k ? p.k : p.m;
  int64_t carry_end = 0;
  for (int64_t base = 0; base < p.groups; base += 32) {
    const int64_t g = base + threadIdx.x;
    const bool in = g < p.groups;
    const int64_t offset = in ? p.offsets[g] : 0;
    int64_t end = offset > limit ? limit : offset;
#pragma unroll
    for (int shift = 1; shift < 32; shift *= 2) {
      const int64_t other = __shfl_up_sync(0xFFFFFFFFu, end, shift);
      if (static_cast<int>(threadIdx.x) >= shift && other > end) end = other;
    }
    if (end < carry_end) end = carry_end;
    int64_t begin = __shfl_up_sync(0xFFFFFFFFu, end, 1);
    if (threadIdx.x == 0) begin = carry_end;
    if (in) G::write_group(p, arrays, g, begin, end, extra...);
    carry_end = __shfl_sync(0xFFFFFFFFu, end, 31);
  }
}

// Along K: the [M, N] output of every group without k-tiles (no rows in its shape), beta * C, as the packed
// kernel leaves it.
template <class G>
__global__ void zero_empty_kernel(const Problem p, const typename G::Shape* shapes, float beta) {
  using ElementD = typename G::ElementD;
  const int64_t g = blockIdx.y;
  if (cute::get<0>(shapes[g]) != 0) return;
  const auto* c = static_cast<const ElementD*>(p.c);
  auto* d = static_cast<ElementD*>(p.d) + g * p.d_group_stride;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.m * p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / p.n, col = i - row * p.n;
    const float value = beta != 0.0f ? beta * static_cast<float>(c[g * p.c_group_stride + row * p.ldc + col]) : 0.0f;
    d[row * p.ldd + col] = static_cast<ElementD>(value);
  }
}

inline int current_device() {
  int device = 0;
  cudaGetDevice(&device);
  return device;
}

inline int multiprocessors(int device) {
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}

}  // namespace grouped_args
}  // namespace fp4gen
