// Grouped NVFP4 GEMM for mixture-of-experts layers, on Hopper, in one launch (after two small prepasses), the
// group sizes read from device memory only:
//
//   groups along M (fprop, dgrad): D[rows of group g] = A[rows of group g] @ B_g.T, where A [M, K] is the
//     rowwise copy of tokens sorted by group (group g is rows offsets[g-1] .. offsets[g]-1) and B_g the
//     group's [N, K] matrix at b + g * b_group_stride (stacked weights);
//   groups along K (wgrad): D_g = A[:, k of group g] @ B[:, k of group g].T, where A [M, K] and B [N, K] are
//     columnwise copies whose groups sit side by side along K (group g is k offsets[g-1] .. offsets[g]-1,
//     whole 64-element k-tiles), and D_g (and C_g) the group's [M, N] matrix at d + g * d_group_stride.
//
// Each output element gets the bilateral epilogue of gemm_fused_dequant.cuh with its group's amaxes: row
// amaxes at row_amax + g * row_amax_group_stride (indexed by row when row_is_vector), column amaxes and bias
// likewise. A group with no k-tiles gets beta * C (+ 0): zero gradients for an expert without tokens.
//
// The CTA tile is gemm_fused_wgmma's (gemm_tile: packed B staged by cp.async and dequantized on chip, A read
// from a fp16 copy that a first kernel writes to the workspace, wgmma). Groups along M: the grid has a slot
// for every tile any routing could need (ceil(M / BM) + groups rows of tiles); a second prepass writes the
// cumulative tile count of the groups into the workspace, and each CTA finds its group and its rows by a
// binary search there (slots past the last tile exit). Groups along K: one grid layer per group.
//
// Offsets that break their contract (decreasing, past M or K, or k offsets off the 64 grid) cannot make the
// kernel read or write outside its operands: rows and k-tiles are clamped to the problem; the affected
// groups' results are undefined.
#pragma once

#include "fp4gen/gemm_fused_wgmma.cuh"

namespace fp4gen {
namespace grouped_wgmma {

using fused_gemm::kTileK;
using fused_gemm::Params;

struct Groups {
  const int64_t* offsets;  // [groups] cumulative ends: rows of A (along M) or elements of K (along K)
  int64_t count;
  bool along_k;
  int64_t b_group_stride, b_scale_group_stride;  // bytes (groups along M: B stacked)
  int64_t c_group_stride, d_group_stride;        // elements (groups along K: one [M, N] output a group)
  int64_t row_amax_group_stride, col_amax_group_stride, bias_group_stride;  // elements
  int64_t* tile_ends;  // workspace [count]: cumulative row tiles of the groups (along M)
};

// offsets[g] clamped into [lower, limit]: a broken offset cannot reach outside the operands.
__device__ __forceinline__ int64_t clamped_end(const Groups& g, int64_t index, int64_t lower, int64_t limit) {
  const int64_t end = g.offsets[index];
  return end < lower ? lower : end > limit ? limit : end;
}

// Groups along M: tile_ends[g] = the row tiles of groups 0 .. g, by one warp in chunks of 32 groups.
template <int BM>
__global__ void __launch_bounds__(32) row_tiles_kernel(const Groups groups, int64_t m) {
  int64_t carry_tiles = 0, carry_end = 0;
  for (int64_t base = 0; base < groups.count; base += 32) {
    const int64_t index = base + threadIdx.x;
    const bool in = index < groups.count;
    int64_t end = in ? groups.offsets[index] : 0;
    // a group starts where the one before ends; offsets are clamped to [the previous end, m] in order
    int64_t running_end = in ? (end > m ? m : end) : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {  // running maximum of the ends, so they never decrease
      const int64_t other = __shfl_up_sync(0xFFFFFFFFu, running_end, offset);
      if (static_cast<int>(threadIdx.x) >= offset && other > running_end) running_end = other;
    }
    if (running_end < carry_end) running_end = carry_end;
    int64_t start = __shfl_up_sync(0xFFFFFFFFu, running_end, 1);
    if (threadIdx.x == 0) start = carry_end;
    int64_t tiles = in ? (running_end - start + BM - 1) / BM : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int64_t other = __shfl_up_sync(0xFFFFFFFFu, tiles, offset);
      if (static_cast<int>(threadIdx.x) >= offset) tiles += other;
    }
    tiles += carry_tiles;
    if (in) groups.tile_ends[index] = tiles;
    carry_tiles = __shfl_sync(0xFFFFFFFFu, tiles, 31);
    carry_end = __shfl_sync(0xFFFFFFFFu, running_end, 31);
  }
}

// The group's view of the problem: its B, amaxes, bias, C and D, each offset by the group's stride.
template <class OutT>
__device__ __forceinline__ Params group_params(const Params& p, const Groups& groups, int64_t g) {
  Params q = p;
  q.b_codes += g * groups.b_group_stride;
  q.b_scale += g * groups.b_scale_group_stride;
  q.row_amax += g * groups.row_amax_group_stride;
  q.col_amax += g * groups.col_amax_group_stride;
  if (q.bias != nullptr) q.bias += g * groups.bias_group_stride;
  if (q.c != nullptr) q.c = static_cast<const OutT*>(q.c) + g * groups.c_group_stride;
  q.d = static_cast<OutT*>(q.d) + g * groups.d_group_stride;
  return q;
}

template <int BM, int BN, int kCtas, class OutT>
__global__ void __launch_bounds__(fused_wgmma::Tile<BM, BN>::kThreads, kCtas)
    grouped_gemm_kernel(const Params p, const Groups groups, const uint8_t* a_half) {
  static_assert(fused_wgmma::fits_multiprocessor<BM, BN, kCtas>(), "the tile's shared memory does not fit kCtas CTAs");
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int all_k_tiles = static_cast<int>(p.k / kTileK);
  if (groups.along_k) {
    const int64_t g = blockIdx.z;
    const int64_t k_begin = g > 0 ? clamped_end(groups, g - 1, 0, p.k) : 0;
    const int64_t k_end = clamped_end(groups, g, k_begin, p.k);
    const Params q = group_params<OutT>(p, groups, g);
    const int k_first = static_cast<int>(k_begin / kTileK);
    const int k_tiles = static_cast<int>((k_end + kTileK - 1) / kTileK) - k_first;
    fused_wgmma::gemm_tile<BM, BN, OutT>(q, a_half, static_cast<int64_t>(blockIdx.y) * BM, n0, k_first,
                                         k_tiles < 0 ? 0 : k_tiles, nullptr);
    return;
  }
  // the group whose tiles include this slot: the first with tile_ends[g] > slot
  const int64_t slot = blockIdx.y;
  int64_t lo = 0, hi = groups.count;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (groups.tile_ends[mid] > slot) hi = mid; else lo = mid + 1;
  }
  if (lo == groups.count) return;  // a slot past the last tile of this routing
  const int64_t g = lo;
  // the group's rows (clamped into [0, m]: for offsets that keep their contract, exactly theirs)
  const int64_t start = g > 0 ? clamped_end(groups, g - 1, 0, p.m) : 0;
  const int64_t end = clamped_end(groups, g, start, p.m);
  const int64_t first_slot = g > 0 ? groups.tile_ends[g - 1] : 0;
  Params q = group_params<OutT>(p, groups, g);
  q.m = end;  // rows past the group's end are zero-filled and not stored
  fused_wgmma::gemm_tile<BM, BN, OutT>(q, a_half, start + (slot - first_slot) * BM, n0, 0, all_k_tiles, nullptr);
}

}  // namespace grouped_wgmma

// The C ABI of the family (codegen/families.py).
#define FP4GEN_GROUPED_GEMM_PARAMS                                                                              \
  const uint8_t *a_codes, const uint8_t *a_scale, const uint8_t *b_codes, const uint8_t *b_scale, const void *c, \
      void *d, const float *row_amax, const float *col_amax, const float *bias, float alpha, float beta,        \
      int64_t m, int64_t n, int64_t k, int64_t lda, int64_t lda_scale, int64_t ldb, int64_t ldb_scale,          \
      int64_t ldc, int64_t ldd, int64_t row_is_vector, int64_t col_is_vector, const int64_t *offsets,           \
      int64_t groups, int64_t along_k, int64_t b_group_stride, int64_t b_scale_group_stride,                   \
      int64_t c_group_stride, int64_t d_group_stride, int64_t row_amax_group_stride,                           \
      int64_t col_amax_group_stride, int64_t bias_group_stride, void *workspace
#define FP4GEN_GROUPED_GEMM_ARGS                                                                                \
  a_codes, a_scale, b_codes, b_scale, c, d, row_amax, col_amax, bias, alpha, beta, m, n, k, lda, lda_scale, ldb,   \
      ldb_scale, ldc, ldd, row_is_vector, col_is_vector, offsets, groups, along_k, b_group_stride,                \
      b_scale_group_stride, c_group_stride, d_group_stride, row_amax_group_stride, col_amax_group_stride,        \
      bias_group_stride, workspace

namespace grouped_wgmma {

// The workspace: the groups' tile ends (along M), then A's fp16 copy at a 256-byte boundary.
inline size_t half_a_offset(int64_t groups) { return (static_cast<size_t>(groups) * 8 + 255) / 256 * 256; }

}  // namespace grouped_wgmma

inline size_t grouped_wgmma_workspace_size(FP4GEN_GROUPED_GEMM_PARAMS) {
  (void)a_codes, (void)a_scale, (void)b_codes, (void)b_scale, (void)c, (void)d, (void)row_amax, (void)col_amax;
  (void)bias, (void)alpha, (void)beta, (void)lda, (void)lda_scale, (void)ldb, (void)ldb_scale, (void)ldc, (void)ldd;
  (void)row_is_vector, (void)col_is_vector, (void)offsets, (void)along_k, (void)b_group_stride;
  (void)b_scale_group_stride, (void)c_group_stride, (void)d_group_stride, (void)row_amax_group_stride;
  (void)col_amax_group_stride, (void)bias_group_stride, (void)workspace;
  if (m <= 0 || n <= 0 || groups <= 0) return 0;
  return grouped_wgmma::half_a_offset(groups) + static_cast<size_t>(m * k) * 2;
}

template <int BM, int BN>
int grouped_wgmma_can_implement(FP4GEN_GROUPED_GEMM_PARAMS) {
  (void)alpha, (void)ldc, (void)c_group_stride, (void)d_group_stride, (void)bias_group_stride;
  (void)row_amax_group_stride, (void)col_amax_group_stride;
  if (m < 0 || n < 0 || k <= 0 || k % fused_gemm::kTileK != 0 || k / fused_gemm::kTileK > INT32_MAX)
    return kInvalidProblem;
  if (groups < 1 || groups > 65535 || offsets == nullptr || (along_k != 0 && along_k != 1)) return kInvalidProblem;
  if ((row_is_vector != 0 && row_is_vector != 1) || (col_is_vector != 0 && col_is_vector != 1)) return kInvalidProblem;
  if (beta != 0.0f && c == nullptr) return kInvalidProblem;
  if (along_k && bias != nullptr) return kInvalidProblem;  // wgrad has no bias
  if ((n + BN - 1) / BN > 0x7FFFFFFF || (m + BM - 1) / BM + groups > 65535) return kInvalidProblem;
  if (ldd < n || (m > 1 && lda < k / 2) || (n > 1 && ldb < k / 2)) return kInvalidProblem;
  if (b_group_stride < 0 || b_scale_group_stride < 0) return kInvalidProblem;
  // cp.async moves 16-byte chunks of codes and 4-byte words of scales
  if (!aligned(a_codes, 16) || !aligned(b_codes, 16) || !aligned(a_scale, 4) || !aligned(b_scale, 4)) return kMisaligned;
  if (lda % 16 || ldb % 16 || lda_scale % 4 || ldb_scale % 4 || b_group_stride % 16 || b_scale_group_stride % 4)
    return kMisaligned;
  if (m > 0 && n > 0 && workspace == nullptr) return kInvalidProblem;
  return kOk;
}

template <int BM, int BN, int kCtas, class OutT>
int grouped_wgmma_run(FP4GEN_GROUPED_GEMM_PARAMS, cudaStream_t stream) {
  using T = fused_wgmma::Tile<BM, BN>;
  constexpr auto kKernel = grouped_wgmma::grouped_gemm_kernel<BM, BN, kCtas, OutT>;
  const int status = grouped_wgmma_can_implement<BM, BN>(FP4GEN_GROUPED_GEMM_ARGS);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  if (const int opted = opt_in_shared_bytes_here<kKernel>(T::kSmemBytes); opted != kOk) return opted;
  const fused_gemm::Params params{a_codes, a_scale, b_codes, b_scale, c, d, row_amax, col_amax, bias, alpha, beta,
                                  m, n, k, lda, lda_scale, ldb, ldb_scale, ldc, ldd, row_is_vector != 0,
                                  col_is_vector != 0, 1, nullptr};
  int64_t* const tile_ends = static_cast<int64_t*>(workspace);
  const grouped_wgmma::Groups group_args{offsets, groups, along_k != 0, b_group_stride, b_scale_group_stride,
                                         c_group_stride, d_group_stride, row_amax_group_stride,
                                         col_amax_group_stride, bias_group_stride, tile_ends};
  uint8_t* const a_half = static_cast<uint8_t*>(workspace) + grouped_wgmma::half_a_offset(groups);
  const int64_t a_blocks = m * (k / 16);
  fused_wgmma::dequantize_a_kernel<<<static_cast<unsigned>(std::min<int64_t>((a_blocks + 255) / 256, 8192)), 256, 0,
                                     stream>>>(params, a_half);
  if (!along_k) grouped_wgmma::row_tiles_kernel<BM><<<1, 32, 0, stream>>>(group_args, m);
  const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN),
                  static_cast<unsigned>(along_k ? (m + BM - 1) / BM : (m + BM - 1) / BM + groups),
                  static_cast<unsigned>(along_k ? groups : 1));
  kKernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(params, group_args, a_half);
  return launch_status();
}

}  // namespace fp4gen
