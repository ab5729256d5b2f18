// Grouped NVFP4 GEMM for mixture-of-experts layers, on Hopper, in one launch (after prepasses that write fp16
// copies of operands and the groups' tile counts), the group sizes read from device memory only:
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
// Groups along M: the CTA tile is gemm_fused_wgmma's (gemm_tile: packed B staged by cp.async and dequantized
// on chip, A read from an fp16 copy that a first kernel writes to the workspace, wgmma). The grid has a slot
// for every tile any routing could need (ceil(M / BM) + groups rows of tiles); a second prepass writes the
// cumulative tile count of the groups into the workspace, and each CTA finds its group and its rows by a
// binary search there (slots past the last tile exit). Groups along K: one grid layer per group, both
// operands read from fp16 copies (gemm_tile_halves).
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
  int64_t b_group_stride, b_scale_group_stride;  // bytes (groups along M: B stacked)
  int64_t c_group_stride, d_group_stride;        // elements (groups along K: one [M, N] output a group)
  int64_t row_amax_group_stride, col_amax_group_stride, bias_group_stride;  // elements
  int64_t* tile_ends;  // workspace [count]: cumulative row tiles of the groups (along M)
};

// Groups along K (wgrad) read both operands as fp16 copies that the prepass writes, because there B is a
// columnwise copy of tokens that every CTA of a column of tiles would dequantize again (N / BM times, against
// the few times a weight's tile is dequantized along M), and the groups' short k-ranges leave little to hide
// that work behind. Both operands' k-tiles are cp.async copies into slots; kStages k-tiles in flight.
template <int BM, int BN>
struct HalfTile {
  using T = fused_wgmma::Tile<BM, BN>;
  static constexpr int kThreads = T::kThreads;
  static constexpr int kStages = 2;
  static constexpr int kSlots = kStages + 1;  // the slot refilled in iteration kt is k-tile kt - 1's (finished)
  static constexpr int kASlotBytes = BM * fused_gemm::kHalfRowBytes, kBSlotBytes = BN * fused_gemm::kHalfRowBytes;
  static constexpr int kSmemBytes = fused_wgmma::kSwizzleBytes + kSlots * (kASlotBytes + kBSlotBytes);
};

// gemm_tile with B read from its fp16 copy too (rows n0 .. n0 + BN - 1 of b_half, p.n rows of p.k elements).
template <int BM, int BN, class OutT>
__device__ __forceinline__ void gemm_tile_halves(const Params& p, const uint8_t* a_half, const uint8_t* b_half,
                                                 int64_t m0, int64_t n0, int k_first, int k_tiles) {
  using H = HalfTile<BM, BN>;
  using fused_wgmma::kSwizzleBytes;
  constexpr int kThreads = H::kThreads, kStages = H::kStages, kSlots = H::kSlots;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t misalignment = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & (kSwizzleBytes - 1);
  uint8_t* const a_slots = smem_raw + ((kSwizzleBytes - misalignment) & (kSwizzleBytes - 1));
  uint8_t* const b_slots = a_slots + kSlots * H::kASlotBytes;
  const int tid = threadIdx.x, warp_group = tid >> 7;
  fused_wgmma::HalfTileLoader<BM, kThreads> a_loader(a_half, p.m, p.k, m0, k_first, tid);
  fused_wgmma::HalfTileLoader<BN, kThreads> b_loader(b_half, p.n, p.k, n0, k_first, tid);
  auto stage_k_tile = [&](int slot) {
    a_loader.load_next(a_slots + slot * H::kASlotBytes);
    b_loader.load_next(b_slots + slot * H::kBSlotBytes);
  };
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
  const uint64_t a_descriptor = fused_wgmma::sw128_descriptor(
      static_cast<uint32_t>(__cvta_generic_to_shared(a_slots)) + warp_group * 64 * fused_gemm::kHalfRowBytes);
  const uint64_t b_descriptor = fused_wgmma::sw128_descriptor(static_cast<uint32_t>(__cvta_generic_to_shared(b_slots)));
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < k_tiles) stage_k_tile(s);
    cp_async_commit();
  }
  // Iteration kt waits for k-tile kt's copies (every thread's: the barrier), issues its wgmma, refills the slot
  // that k-tile kt - 1's wgmma read with k-tile kt + kStages, and waits for its wgmma.
  int read = 0, write = kStages;
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 1>();
    fused_wgmma::fence_async_shared();
    __syncthreads();
    fused_wgmma::fence_registers(acc);
    const uint64_t a = a_descriptor + read * (H::kASlotBytes >> 4), b = b_descriptor + read * (H::kBSlotBytes >> 4);
    fused_wgmma::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < fused_gemm::kTileK / 16; ++kk)
      fused_wgmma::wgmma<fused_wgmma::Mma<BN>>(a + 2 * kk, b + 2 * kk, acc, std::make_index_sequence<BN / 2>{});
    fused_wgmma::wgmma_commit();
    if (kt + kStages < k_tiles) stage_k_tile(write);
    cp_async_commit();
    fused_wgmma::wgmma_wait<0>();
    fused_wgmma::fence_registers(acc);
    read = read + 1 == kSlots ? 0 : read + 1, write = write + 1 == kSlots ? 0 : write + 1;
  }
  fused_wgmma::store_accumulators<BN, OutT>(p, acc, m0, n0, nullptr);
}

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

// Groups along M: B packed (stacked weights), A from its fp16 copy.
template <int BM, int BN, int kCtas, class OutT>
__global__ void __launch_bounds__(fused_wgmma::Tile<BM, BN>::kThreads, kCtas)
    grouped_rows_kernel(const Params p, const Groups groups, const uint8_t* a_half) {
  static_assert(fused_wgmma::fits_multiprocessor<BM, BN, kCtas>(), "the tile's shared memory does not fit kCtas CTAs");
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
  fused_wgmma::gemm_tile<BM, BN, OutT>(q, a_half, start + (slot - first_slot) * BM, static_cast<int64_t>(blockIdx.x) * BN,
                                       0, static_cast<int>(p.k / kTileK), nullptr);
}

// Groups along K: one grid layer a group, both operands from their fp16 copies.
template <int BM, int BN, int kCtas, class OutT>
__global__ void __launch_bounds__(HalfTile<BM, BN>::kThreads, kCtas)
    grouped_k_kernel(const Params p, const Groups groups, const uint8_t* a_half, const uint8_t* b_half) {
  static_assert(kCtas * (HalfTile<BM, BN>::kSmemBytes + 1024) <= 228 * 1024, "shared memory does not fit kCtas CTAs");
  const int64_t g = blockIdx.z;
  const int64_t k_begin = g > 0 ? clamped_end(groups, g - 1, 0, p.k) : 0;
  const int64_t k_end = clamped_end(groups, g, k_begin, p.k);
  const Params q = group_params<OutT>(p, groups, g);
  const int k_first = static_cast<int>(k_begin / kTileK);
  const int k_tiles = static_cast<int>((k_end + kTileK - 1) / kTileK) - k_first;
  gemm_tile_halves<BM, BN, OutT>(q, a_half, b_half, static_cast<int64_t>(blockIdx.y) * BM,
                                 static_cast<int64_t>(blockIdx.x) * BN, k_first, k_tiles < 0 ? 0 : k_tiles);
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

// The workspace: the groups' tile ends (along M), then A's fp16 copy at a 256-byte boundary, then (along K) B's.
inline size_t half_a_offset(int64_t groups) { return round_to_256(static_cast<size_t>(groups) * 8); }
inline size_t half_b_offset(int64_t groups, int64_t m, int64_t k) {
  return round_to_256(half_a_offset(groups) + static_cast<size_t>(m * k) * 2);
}

}  // namespace grouped_wgmma

inline size_t grouped_wgmma_workspace_size(FP4GEN_GROUPED_GEMM_PARAMS) {
  (void)a_codes, (void)a_scale, (void)b_codes, (void)b_scale, (void)c, (void)d, (void)row_amax, (void)col_amax;
  (void)bias, (void)alpha, (void)beta, (void)lda, (void)lda_scale, (void)ldb, (void)ldb_scale, (void)ldc, (void)ldd;
  (void)row_is_vector, (void)col_is_vector, (void)offsets, (void)b_group_stride;
  (void)b_scale_group_stride, (void)c_group_stride, (void)d_group_stride, (void)row_amax_group_stride;
  (void)col_amax_group_stride, (void)bias_group_stride, (void)workspace;
  if (m <= 0 || n <= 0 || groups <= 0) return 0;
  if (along_k) return grouped_wgmma::half_b_offset(groups, m, k) + static_cast<size_t>(n * k) * 2;
  return grouped_wgmma::half_a_offset(groups) + static_cast<size_t>(m * k) * 2;
}

// The rules of the family's C ABI that every grouped GEMM kernel shares (gemm_grouped_tma.cuh too): the
// operands' codes are read in 16-byte chunks and their scales in 4-byte words.
inline int grouped_gemm_status(FP4GEN_GROUPED_GEMM_PARAMS) {
  (void)alpha, (void)ldc, (void)c_group_stride, (void)d_group_stride, (void)bias_group_stride;
  (void)row_amax_group_stride, (void)col_amax_group_stride;
  if (m < 0 || n < 0 || k <= 0 || k % fused_gemm::kTileK != 0 || k / fused_gemm::kTileK > INT32_MAX)
    return kInvalidProblem;
  if (groups < 1 || groups > 65535 || offsets == nullptr || (along_k != 0 && along_k != 1)) return kInvalidProblem;
  if ((row_is_vector != 0 && row_is_vector != 1) || (col_is_vector != 0 && col_is_vector != 1)) return kInvalidProblem;
  if (beta != 0.0f && c == nullptr) return kInvalidProblem;
  if (along_k && bias != nullptr) return kInvalidProblem;  // wgrad has no bias
  if (ldd < n || (m > 1 && lda < k / 2) || (n > 1 && ldb < k / 2)) return kInvalidProblem;
  if (b_group_stride < 0 || b_scale_group_stride < 0) return kInvalidProblem;
  // cp.async moves 16-byte chunks of codes and 4-byte words of scales
  if (!aligned(a_codes, 16) || !aligned(b_codes, 16) || !aligned(a_scale, 4) || !aligned(b_scale, 4)) return kMisaligned;
  if (lda % 16 || ldb % 16 || lda_scale % 4 || ldb_scale % 4 || b_group_stride % 16 || b_scale_group_stride % 4)
    return kMisaligned;
  if (m > 0 && n > 0 && workspace == nullptr) return kInvalidProblem;
  return kOk;
}

template <int BM, int BN>
int grouped_wgmma_can_implement(FP4GEN_GROUPED_GEMM_PARAMS) {
  const int status = grouped_gemm_status(FP4GEN_GROUPED_GEMM_ARGS);
  if (status != kOk) return status;
  return (n + BN - 1) / BN > 0x7FFFFFFF || (m + BM - 1) / BM + groups > 65535 ? kInvalidProblem : kOk;  // the grid
}

template <int BM, int BN, int kCtas, class OutT>
int grouped_wgmma_run(FP4GEN_GROUPED_GEMM_PARAMS, cudaStream_t stream) {
  constexpr auto kRowsKernel = grouped_wgmma::grouped_rows_kernel<BM, BN, kCtas, OutT>;
  constexpr auto kKKernel = grouped_wgmma::grouped_k_kernel<BM, BN, kCtas, OutT>;
  const int status = grouped_wgmma_can_implement<BM, BN>(FP4GEN_GROUPED_GEMM_ARGS);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  const int smem = along_k ? grouped_wgmma::HalfTile<BM, BN>::kSmemBytes : fused_wgmma::Tile<BM, BN>::kSmemBytes;
  const int opted = along_k ? opt_in_shared_bytes_here<kKKernel>(smem) : opt_in_shared_bytes_here<kRowsKernel>(smem);
  if (opted != kOk) return opted;
  const fused_gemm::Params params{a_codes, a_scale, b_codes, b_scale, c, d, row_amax, col_amax, bias, alpha, beta,
                                  m, n, k, lda, lda_scale, ldb, ldb_scale, ldc, ldd, row_is_vector != 0,
                                  col_is_vector != 0, 1, nullptr};
  uint8_t* const base = static_cast<uint8_t*>(workspace);
  const grouped_wgmma::Groups group_args{offsets, groups, b_group_stride, b_scale_group_stride,
                                         c_group_stride, d_group_stride, row_amax_group_stride,
                                         col_amax_group_stride, bias_group_stride, reinterpret_cast<int64_t*>(base)};
  uint8_t* const a_half = base + grouped_wgmma::half_a_offset(groups);
  constexpr unsigned kThreads = fused_wgmma::Tile<BM, BN>::kThreads;
  if (along_k) {
    uint8_t* const b_half = base + grouped_wgmma::half_b_offset(groups, m, k);
    fused_wgmma::dequantize_two_operands({a_codes, a_scale, lda, lda_scale, m, a_half},
                                         {b_codes, b_scale, ldb, ldb_scale, n, b_half}, k, stream);
    const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN), static_cast<unsigned>((m + BM - 1) / BM),
                    static_cast<unsigned>(groups));
    kKKernel<<<grid, kThreads, smem, stream>>>(params, group_args, a_half, b_half);
  } else {
    fused_wgmma::dequantize_rows(a_codes, a_scale, lda, lda_scale, m, k, a_half, stream);
    grouped_wgmma::row_tiles_kernel<BM><<<1, 32, 0, stream>>>(group_args, m);
    const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN), static_cast<unsigned>((m + BM - 1) / BM + groups));
    kRowsKernel<<<grid, kThreads, smem, stream>>>(params, group_args, a_half);
  }
  return launch_status();
}

}  // namespace fp4gen
