// What the CUTLASS grouped GEMM families (gemm_grouped_tma.cuh, gemm_grouped_sm100.cuh) share behind the grouped
// C ABI of gemm_grouped_wgmma.cuh: the per-group arguments written on the device from the group offsets, the
// outputs of groups along K without k-tiles (which CUTLASS would leave unset), the workspace, the rules and the
// launch sequence. A family's G supplies:
//   Gemm, Shape, ElementD, kAlignCD, Arrays (with `shapes`), arrays_at(base, groups, &bytes), arguments(...);
//   kAlphaUnscale, what alpha is multiplied by (its operands' own scaling);
//   operand_bytes(m, n, k, groups, along_k), the workspace its operands need (fp16 copies, swizzled scales);
//   prepare(problem, arrays, operands, stream), which fills that area and launches arguments_kernel;
//   write_group(problem, arrays, g, begin, end, extra...), which arguments_kernel calls for each group.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cute/tensor.hpp>

#include "fp4gen/abi.h"
#include "fp4gen/cutlass_run.hpp"
#include "fp4gen/gemm_grouped_wgmma.cuh"

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
  for (int64_t row = blockIdx.x; row < p.m; row += gridDim.x) {  // a CTA a row at a time, its threads along it
    for (int64_t col = threadIdx.x; col < p.n; col += blockDim.x) {
      const float value = beta != 0.0f ? beta * static_cast<float>(c[g * p.c_group_stride + row * p.ldc + col]) : 0.0f;
      d[row * p.ldd + col] = static_cast<ElementD>(value);
    }
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

// zero_empty_kernel's grid: y the groups, x a share of about 16 CTAs a multiprocessor in all. Nearly every group has
// rows and its CTAs return at once; 1024 CTAs a group cost 80 us of empty CTAs at 128 groups on the H200
// (bench/RESULTS.md, 2026-12-03).
inline dim3 zero_empty_grid(int64_t m, int64_t groups) {
  const int64_t share = std::max<int64_t>(1, int64_t{16} * multiprocessors(current_device()) / groups);
  return dim3(static_cast<unsigned>(std::min<int64_t>({m, share, 1024})), static_cast<unsigned>(groups));
}

// The operands as the C ABI passes them (bytes and byte strides), and the family's area of the workspace.
struct Operands {
  const uint8_t *a_codes, *a_scale, *b_codes, *b_scale;
  int64_t lda, lda_scale, ldb, ldb_scale, b_group_stride, b_scale_group_stride;
  uint8_t* area;
};

// Lays a family's per-group arrays out one after another from `base`, each at a 16-byte boundary: take(member)
// points the member at the next array of `groups` elements of its type; `used` is their extent so far. Integer
// arithmetic: the workspace layout is sized from a null base.
struct ArrayCarver {
  uintptr_t base;
  int64_t groups;
  size_t used = 0;
  template <class T>
  void take(T*& member) {
    member = reinterpret_cast<T*>(base + used);
    used += (sizeof(T) * static_cast<size_t>(groups) + 15) / 16 * 16;
  }
};

// rows_per_group: each group's rows of D (along K: all M), else the groups' mean, rounded up (groups >= 1: the
// callers check the problem first); the families may order their tiles by it.
template <class G>
typename G::Gemm::Arguments gemm_arguments(uint8_t* arrays_base, int64_t groups, const void* c, const float* bias,
                                           float alpha, float beta, int64_t row_is_vector, int64_t col_is_vector,
                                           int64_t rows_per_group, int64_t n) {
  const int device = current_device();
  return G::arguments(G::arrays_at(arrays_base, groups), groups, c != nullptr && beta != 0.0f, bias != nullptr,
                      alpha * G::kAlphaUnscale, beta, row_is_vector, col_is_vector, device, multiprocessors(device),
                      rows_per_group, n);
}

inline int64_t rows_per_group(int64_t m, int64_t groups, bool along_k) {
  return along_k ? m : (m + groups - 1) / groups;
}

// The workspace: the family's operand area, the per-group arrays, then CUTLASS's own (which depends on the group
// count and the device, not on the pointers), each at a 256-byte boundary.
struct WorkspaceLayout {
  size_t arrays, cutlass, total;
};

template <class G>
WorkspaceLayout workspace_layout(int64_t m, int64_t n, int64_t k, int64_t groups, bool along_k, const void* c,
                                 const float* bias, float alpha, float beta, int64_t row_is_vector,
                                 int64_t col_is_vector) {
  size_t arrays_bytes = 0;
  G::arrays_at(nullptr, groups, &arrays_bytes);
  WorkspaceLayout w;
  w.arrays = round_to_256(G::operand_bytes(m, n, k, groups, along_k));
  w.cutlass = w.arrays + round_to_256(arrays_bytes);
  w.total = w.cutlass + G::Gemm::get_workspace_size(gemm_arguments<G>(nullptr, groups, c, bias, alpha, beta,
                                                                      row_is_vector, col_is_vector,
                                                                      rows_per_group(m, groups, along_k), n));
  return w;
}

}  // namespace grouped_args

template <class G>
size_t grouped_cutlass_workspace_size(FP4GEN_GROUPED_GEMM_PARAMS) {
  (void)a_codes, (void)a_scale, (void)b_codes, (void)b_scale, (void)d, (void)row_amax, (void)col_amax;
  (void)lda, (void)lda_scale, (void)ldb, (void)ldb_scale, (void)ldc, (void)ldd, (void)offsets, (void)b_group_stride;
  (void)b_scale_group_stride, (void)c_group_stride, (void)d_group_stride, (void)row_amax_group_stride;
  (void)col_amax_group_stride, (void)bias_group_stride, (void)workspace;
  if (m <= 0 || n <= 0 || groups <= 0) return 0;
  return grouped_args::workspace_layout<G>(m, n, k, groups, along_k != 0, c, bias, alpha, beta, row_is_vector,
                                           col_is_vector)
      .total;
}

template <class G>
int grouped_cutlass_can_implement(FP4GEN_GROUPED_GEMM_PARAMS) {
  const int status = grouped_gemm_status(FP4GEN_GROUPED_GEMM_ARGS);
  if (status != kOk) return status;
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) return kInvalidProblem;  // CUTLASS's int shapes
  // TMA: 16-byte aligned rows of D and C at every group's first row, and of D's and C's bases
  if (!aligned(d, 16) || !aligned(c, 16) || !aligned(bias, 16)) return kMisaligned;
  for (const int64_t stride : {ldd, ldc, c_group_stride, d_group_stride})
    if (stride % G::kAlignCD != 0) return kMisaligned;
  // a thread's accumulator rows are not adjacent, so the row-amax node loads element by element: a group's amaxes
  // may start anywhere (the GPU tests' routings start groups at odd rows)
  return kOk;
}

// The family's operand preparation and per-group arguments, the outputs of empty groups along K, then CUTLASS.
template <class G>
int grouped_cutlass_run(FP4GEN_GROUPED_GEMM_PARAMS, cudaStream_t stream) {
  const int status = grouped_cutlass_can_implement<G>(FP4GEN_GROUPED_GEMM_ARGS);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  const grouped_args::WorkspaceLayout layout = grouped_args::workspace_layout<G>(
      m, n, k, groups, along_k != 0, c, bias, alpha, beta, row_is_vector, col_is_vector);
  uint8_t* const base = static_cast<uint8_t*>(workspace);
  const grouped_args::Problem problem{c, d, row_amax, col_amax, bias, m, n, k, ldc, ldd, row_is_vector, offsets,
                                      groups, along_k != 0, c_group_stride, d_group_stride, row_amax_group_stride,
                                      col_amax_group_stride, bias_group_stride};
  const grouped_args::Operands operands{a_codes, a_scale, b_codes, b_scale, lda, lda_scale, ldb, ldb_scale,
                                        b_group_stride, b_scale_group_stride, base};
  const typename G::Arrays arrays = G::arrays_at(base + layout.arrays, groups);
  if (const int prepared = G::prepare(problem, arrays, operands, stream); prepared != kOk) return prepared;
  if (along_k) {
    grouped_args::zero_empty_kernel<G><<<grouped_args::zero_empty_grid(m, groups), 256, 0, stream>>>(problem, arrays.shapes,
                                                                                                 beta);
  }
  if (const int launched = launch_status(); launched != kOk) return launched;
  return cutlass_run<typename G::Gemm>(
      grouped_args::gemm_arguments<G>(base + layout.arrays, groups, c, bias, alpha, beta, row_is_vector,
                                      col_is_vector, grouped_args::rows_per_group(m, groups, along_k != 0), n),
      base + layout.cutlass, stream);
}

}  // namespace fp4gen
