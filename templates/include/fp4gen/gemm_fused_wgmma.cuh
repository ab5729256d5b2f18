// Hopper NVFP4 GEMM that reads the packed operands and multiplies with wgmma:
//     D[i, j] = beta * C[i, j] + (alpha * (row_amax[i or 0] * (col_amax[j or 0] * sum_k A[i, k] B[j, k]))
//               + bias[j])
// the same problem, parameters and epilogue as gemm_fused_dequant.cuh, whose staging and on-chip
// dequantization it shares; what differs is the multiply, and A.
//
// Why: the mma.sync kernel issues its MMAs from the same warps that dequantize, and mma.sync reaches only
// part of Hopper's tensor-core rate; the wgmma family reads 16-bit scratch that a separate pass wrote. Here
// one warp group per 64 rows of the tile issues asynchronous wgmma (fp16 in, fp32 accumulate, both operands
// from shared memory) for k-tile kt and, while the tensor cores run it, stages k-tile kt + kStages and
// dequantizes B's k-tile kt + 1 into the other fp16 buffer.
//
// A is dequantized once per GEMM, by a first kernel, into fp16 rows in the workspace (M x K x 2 bytes), and
// each CTA copies its k-tiles of them as they are. Dequantizing A on chip instead cost every CTA of a tile
// row the same work again (N / BN times), and at small M, where this kernel is used, A's copy is small; on
// the H200 it made M = 128, N = K = 8192 8% faster (bench/RESULTS.md). B, the large operand, never passes
// through global memory as fp16.
//
// The fp16 tile is the 128-byte-swizzled K-major layout wgmma reads: rows of 64 elements (128 bytes), chunk
// c of row r at chunk c ^ (r % 8), eight-row groups 1024 bytes apart, the buffer 1024-byte aligned;
// half_tile_offset computes exactly this.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90.hpp>

#include "fp4gen/gemm_fused_dequant.cuh"

namespace fp4gen {
namespace fused_wgmma {

using fused_gemm::kCodeBytes;
using fused_gemm::kHalfRowBytes;
using fused_gemm::kScaleBytes;
using fused_gemm::kTileK;
using fused_gemm::Params;

constexpr int kSwizzleBytes = 1024;  // one 8-row group of the 128-byte swizzle; its base must be aligned to it

template <int BM, int BN>
struct Tile {
  static_assert(BM % 64 == 0 && BM <= 128, "one warp group per 64 rows of the tile, at most two");
  static_assert(BN % 64 == 0 && BN <= 256, "wgmma N up to 256; whole eight-row swizzle groups");
  static constexpr int kWarpGroups = BM / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  // k-tiles in flight, of B's codes and scales and of A's fp16 rows; three keep tiles of N <= 128 within
  // half a multiprocessor's shared memory, so two CTAs share one (four warps per scheduler)
  static constexpr int kStages = 3;
  static constexpr int kStageBytes = BN * (kCodeBytes + kScaleBytes);
  // A's fp16 k-tiles, copied as they are: one slot more than the stages, because the slot refilled in
  // iteration kt is the one k-tile kt - 1's wgmma read (finished), not kt's (still running)
  static constexpr int kASlots = kStages + 1;
  static constexpr int kASlotBytes = BM * kHalfRowBytes;
  // B's fp16 tiles: the one the tensor cores read, the one being written. (A third, so that the tensor cores
  // keep a k-tile queued across the barrier, measured slower on the H200 in the kernel that also dequantized A.)
  static constexpr int kBuffers = 2;
  static constexpr int kHalfBytes = BN * kHalfRowBytes;  // whole 1024-byte groups: BN is a multiple of 64
  // the swizzled tiles first, at the aligned base; the stages after them; slack to align the base
  static constexpr int kSmemBytes =
      kSwizzleBytes + kASlots * kASlotBytes + kBuffers * kHalfBytes + kStages * kStageBytes;
};

// kCtas CTAs a multiprocessor: the tile fact split_ctas_per_multiprocessor (codegen/tables.py), which split K
// aims at too, passed in by the generated source. The launch bound makes the registers fit that many (for
// 256 threads and two CTAs, 128 a thread: enough for a 64 x 128 accumulator); shared memory must fit too
// (228 KB a multiprocessor, 1 KB of each CTA's the system's).
constexpr bool ctas_fit_multiprocessor(int ctas, int smem_bytes) {
  return ctas >= 1 && ctas * (smem_bytes + 1024) <= 228 * 1024;
}
template <int BM, int BN, int kCtas>
constexpr bool fits_multiprocessor() {
  return ctas_fit_multiprocessor(kCtas, Tile<BM, BN>::kSmemBytes);
}

// The wgmma operation m64 x BN x k16, fp16 operands K-major in shared memory, fp32 accumulators.
template <int BN>
using Mma = decltype(cute::SM90::GMMA::ss_op_selector<cute::half_t, cute::half_t, float,
                                                      cute::Shape<cute::_64, cute::Int<BN>, cute::_16>,
                                                      cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>());

// Shared-memory matrix descriptor of a 128-byte-swizzled K-major tile starting at `address`: the leading
// byte offset is unused for this layout (1 by convention), the stride between eight-row groups is 1024
// bytes, layout type 1 = 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(kSwizzleBytes >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

template <class Op, size_t... I>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float* acc, std::index_sequence<I...>) {
  Op::fma(a, b, acc[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// Keeps the compiler from moving accesses to the accumulators across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_registers(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most kPending committed wgmma groups of this warp group are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Orders this thread's ordinary shared-memory stores before later reads by the async proxy (wgmma).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Two adjacent outputs of one row; a bf16 pair is one 4-byte store when the address allows it.
template <class OutT>
__device__ __forceinline__ void store_pair(const Params& p, int64_t row, int64_t col, float acc0, float acc1) {
  if constexpr (!std::is_same_v<OutT, float>) {
    __nv_bfloat16* const out = static_cast<__nv_bfloat16*>(p.d) + row * p.ldd + col;
    if (col + 1 < p.n && aligned(out, 4)) {
      *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(
          fused_gemm::epilogue_value<OutT>(p, row, col, acc0), fused_gemm::epilogue_value<OutT>(p, row, col + 1, acc1));
      return;
    }
  }
  fused_gemm::store_epilogue<OutT>(p, row, col, acc0);
  if (col + 1 < p.n) fused_gemm::store_epilogue<OutT>(p, row, col + 1, acc1);
}

// An operand's block-scaled values as fp16 (each times 2^-14, each k-tile's elements in a HalfOrder below:
// decode8's order within 16-byte chunks, or gemm_packed_rs's step order for its A), row-major, k * 2 bytes a
// row: A's for every GEMM of the family (every CTA of a tile row would otherwise dequantize the same A tile again,
// N / BN times), and both where a CUTLASS GEMM multiplies fp16 copies (the dense scratch path, gemm_sm90.cuh, and
// the grouped ones). Two operands of the same k go in one launch (one kernel boundary fewer before the GEMM).
// kStacked: the rows come in groups of rows_per_group (stacked expert weights), group g's codes and scales
// group_stride and scale_group_stride bytes after group g - 1's; the fp16 rows follow one another regardless.
//
// Threads: x along a row's 16-byte output chunks (half a 16-element block each: its 4 code bytes and the block's
// scale), so that each store instruction of a warp writes 512 contiguous bytes, y along rows; each thread loads
// kDequantRowsPerIter rows' codes and scales before it decodes any (bytes in flight to cover DRAM latency), and
// the grid (rows, chunks, groups) needs no division by an index. On the H200 this took the stacked weights' copy
// of Qwen3-30B-A3B's FC1 experts from 443 to 290 us against the first version, a thread a block over a flat index
// with two 64-bit divisions and two 16-byte stores 32 bytes apart (2.3-2.5 TB/s); this grid with a thread a block
// (two stores a thread) was slower still (bench/RESULTS.md, 2026-12-03).
constexpr int kDequantRowsPerIter = 4, kDequantThreads = 256;

// The element orders of A's fp16 copy within each 64-element k-tile (eight code words, word i holding elements
// 8i .. 8i + 7; "pair s of word i" is elements 8i + s and 8i + s + 4 as one fp16x2, decode8's word s):
//  - kChunks: word i's four pairs in order, as one 16-byte chunk at byte 16i (decode8's order; the layout of
//    every fp16 operand but gemm_packed_rs's A);
//  - kSteps: wgmma k16 step s's 32 bytes at byte 32s hold pair s of words 0, 2, 4, 6, 1, 3, 5, 7, so that the
//    thread of gemm_packed_rs whose fragment takes positions 2q, 2q + 1 and 2q + 8, 2q + 9 of every step finds
//    there pair s of words 2q and 2q + 1: the two whole words of one block of its row (gemm_packed_rs.cuh).
enum class HalfOrder { kChunks, kSteps };

// One operand's rows for dequantize_rows_kernel: `rows` rows of codes (ld bytes apart) and scales (ld_scale
// apart), into fp16 rows at `half`.
struct HalfRows {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t ld, ld_scale, rows;
  uint8_t* half;
};

// kStacked: grid.z walks groups of first.rows rows of `first` (group g's codes and scales group_stride and
// scale_group_stride bytes after group g - 1's); else grid.z picks the operand, `first` or `second` (two
// operands of the same k in one launch). kOrder: the fp16 elements' order within each k-tile (HalfOrder).
template <bool kStacked, HalfOrder kOrder = HalfOrder::kChunks>
__global__ void __launch_bounds__(kDequantThreads) dequantize_rows_kernel(HalfRows first, HalfRows second, int64_t k,
                                                                         int64_t group_stride,
                                                                         int64_t scale_group_stride) {
  // The dense GEMMs launch as its programmatic dependents (launch_half_a_gemm, gemm_sm90.cuh): let them launch
  // now; they wait for this kernel's end before they read `half`. Launched plainly itself, it follows what
  // wrote its input.
  asm volatile("griddepcontrol.launch_dependents;");
  const int64_t chunk = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (chunk >= k / 8) return;
  HalfRows op = first;
  if constexpr (kStacked) {  // grid.z walks the groups of `rows` rows
    const int64_t group = blockIdx.z;
    op.codes += group * group_stride, op.scales += group * scale_group_stride, op.half += group * op.rows * k * 2;
  } else if (blockIdx.z == 1) {
    op = second;
  }
  const uint8_t* const codes = op.codes + chunk * 4;
  const uint8_t* const scales = op.scales + chunk / 2;
  // where the chunk's first pair goes: its own 16 bytes (kChunks), or, for word i = chunk % 8 of a k-tile, byte
  // 4 (i / 2 + 4 (i % 2)) of the k-tile's first step, pair s 32s bytes on (kSteps)
  const int word = static_cast<int>(chunk % 8);
  uint8_t* const half =
      op.half + (kOrder == HalfOrder::kChunks ? chunk * 16 : (chunk - word) * 16 + 4 * (word / 2 + 4 * (word % 2)));
  const int64_t rows = op.rows, ld = op.ld, ld_scale = op.ld_scale;
  const int64_t row_step = blockDim.y, iter_step = static_cast<int64_t>(gridDim.x) * blockDim.y * kDequantRowsPerIter;
  for (int64_t first_row = static_cast<int64_t>(blockIdx.x) * blockDim.y * kDequantRowsPerIter + threadIdx.y;
       first_row < rows; first_row += iter_step) {
    uint32_t packed[kDequantRowsPerIter], scale[kDequantRowsPerIter];
#pragma unroll
    for (int r = 0; r < kDequantRowsPerIter; ++r) {
      const int64_t row = first_row + r * row_step;
      if (row < rows) packed[r] = *reinterpret_cast<const uint32_t*>(codes + row * ld), scale[r] = scales[row * ld_scale];
    }
#pragma unroll
    for (int r = 0; r < kDequantRowsPerIter; ++r) {
      const int64_t row = first_row + r * row_step;
      if (row >= rows) break;
      const uint4 pairs = fused_gemm::dequantize_half_block(packed[r], scale[r]);
      if constexpr (kOrder == HalfOrder::kChunks) {
        *reinterpret_cast<uint4*>(half + row * k * 2) = pairs;
      } else {  // the eight threads of a k-tile fill each step's 32 bytes: a warp's stores write whole sectors
        uint32_t* const steps = reinterpret_cast<uint32_t*>(half + row * k * 2);
        steps[0] = pairs.x, steps[8] = pairs.y, steps[16] = pairs.z, steps[24] = pairs.w;
      }
    }
  }
}

// Launches dequantize_rows_kernel on `stream` over `groups` groups of first.rows x k (kStacked), or over
// `first` and `second` (second.rows may be 0: one operand): 256 threads or a little fewer, as many along a row
// as it has chunks (a row wider than 256 chunks split evenly between CTAs, in whole warps), and about two waves
// of CTAs of the current device.
template <bool kStacked, HalfOrder kOrder = HalfOrder::kChunks>
inline void launch_dequantize_rows(const HalfRows& first, const HalfRows& second, int64_t groups, int64_t k,
                                   int64_t group_stride, int64_t scale_group_stride, cudaStream_t stream) {
  const int64_t chunks_per_row = k / 8;
  const int64_t rows = kStacked ? first.rows : std::max(first.rows, second.rows);
  if (groups <= 0 || rows <= 0 || chunks_per_row <= 0) return;
  const int64_t col_ctas = (chunks_per_row + kDequantThreads - 1) / kDequantThreads;
  const int64_t per_cta = (chunks_per_row + col_ctas - 1) / col_ctas;
  const int64_t threads_x = col_ctas > 1 ? (per_cta + 31) / 32 * 32 : per_cta;
  const int64_t threads_y = kDequantThreads / threads_x;
  int device = 0, sms = 0;
  if (!current_device_multiprocessors(&device, &sms)) return;  // the caller's launch_status() reports it
  constexpr int64_t kCtasPerSm = 8, kWaves = 2, kMaxGridZ = 65535;
  const int64_t row_ctas_needed = (rows + threads_y * kDequantRowsPerIter - 1) / (threads_y * kDequantRowsPerIter);
  const dim3 block(static_cast<unsigned>(threads_x), static_cast<unsigned>(threads_y));
  if constexpr (!kStacked) {
    const int64_t operands = second.rows > 0 ? 2 : 1;
    const int64_t row_ctas_wanted = std::max<int64_t>(1, sms * kCtasPerSm * kWaves / (col_ctas * operands));
    const dim3 grid(static_cast<unsigned>(std::min(row_ctas_needed, row_ctas_wanted)),
                    static_cast<unsigned>(col_ctas), static_cast<unsigned>(operands));
    dequantize_rows_kernel<false, kOrder><<<grid, block, 0, stream>>>(first, second, k, 0, 0);
  } else {
    for (int64_t g0 = 0; g0 < groups; g0 += kMaxGridZ) {  // grid.z walks the groups, 65535 at most a launch
      const int64_t launch_groups = std::min(groups - g0, kMaxGridZ);
      const int64_t row_ctas_wanted = std::max<int64_t>(1, sms * kCtasPerSm * kWaves / (col_ctas * launch_groups));
      const dim3 grid(static_cast<unsigned>(std::min(row_ctas_needed, row_ctas_wanted)),
                      static_cast<unsigned>(col_ctas), static_cast<unsigned>(launch_groups));
      const HalfRows from{first.codes + g0 * group_stride, first.scales + g0 * scale_group_stride, first.ld,
                          first.ld_scale, first.rows, first.half + g0 * first.rows * k * 2};
      dequantize_rows_kernel<true, kOrder><<<grid, block, 0, stream>>>(from, HalfRows{}, k, group_stride,
                                                                      scale_group_stride);
    }
  }
}

// Launches dequantize_rows_kernel over rows x k on `stream`.
template <HalfOrder kOrder = HalfOrder::kChunks>
inline void dequantize_rows(const uint8_t* codes, const uint8_t* scales, int64_t ld, int64_t ld_scale, int64_t rows,
                            int64_t k, uint8_t* half, cudaStream_t stream) {
  launch_dequantize_rows<false, kOrder>(HalfRows{codes, scales, ld, ld_scale, rows, half}, HalfRows{}, 1, k, 0, 0,
                                        stream);
}

// Two operands of the same k in one launch (either may have no rows).
inline void dequantize_two_operands(const HalfRows& a, const HalfRows& b, int64_t k, cudaStream_t stream) {
  if (a.rows <= 0) return launch_dequantize_rows<false>(b, HalfRows{}, 1, k, 0, 0, stream);
  launch_dequantize_rows<false>(a, b, 1, k, 0, 0, stream);
}

// The same over `groups` stacked groups of rows_per_group rows each (rows_per_group > 0).
inline void dequantize_stacked_rows(const uint8_t* codes, const uint8_t* scales, int64_t ld, int64_t ld_scale,
                                    int64_t groups, int64_t rows_per_group, int64_t group_stride,
                                    int64_t scale_group_stride, int64_t k, uint8_t* half, cudaStream_t stream) {
  launch_dequantize_rows<true>(HalfRows{codes, scales, ld, ld_scale, rows_per_group, half}, HalfRows{}, groups, k,
                               group_stride, scale_group_stride, stream);
}

// Copies k-tiles of an fp16 operand's rows r0 .. r0 + kRows - 1 (of `rows`, each k elements) into a slot in the
// swizzled layout wgmma reads; rows past `rows` are zero-filled. A thread copies the same rows and 16-byte chunk
// in every k-tile, and the k-tiles go in order: load_next moves the addresses one k-tile on.
template <int kRows, int kThreads>
struct HalfTileLoader {
  static_assert(kThreads % 64 == 0, "a thread's rows keep their residue modulo 8, hence their swizzle");
  // 16-byte chunks a thread copies; with fewer chunks than threads (tiles of 16 or 24 rows) the last copy of
  // the threads past them is skipped
  static constexpr int kCopies = (kRows * 8 + kThreads - 1) / kThreads;
  static constexpr bool kEveryThreadCopies = kRows * 8 % kThreads == 0;
  const uint8_t* src[kCopies];
  bool valid[kCopies];
  uint32_t dst[kCopies];

  __device__ __forceinline__ HalfTileLoader(const uint8_t* half, int64_t rows, int64_t k, int64_t r0, int k_first,
                                            int tid) {
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const int row = (tid + j * kThreads) >> 3, chunk = tid & 7;
      valid[j] = (kEveryThreadCopies || row < kRows) && r0 + row < rows;
      src[j] = (valid[j] ? half + (r0 + row) * k * 2 : half) + static_cast<int64_t>(k_first) * kHalfRowBytes +
               chunk * 16;  // a zero-filled copy's address stays inside row 0: it is never read
      dst[j] = fused_gemm::half_tile_offset(row, chunk);
    }
  }

  __device__ __forceinline__ void load_next(uint8_t* slot) {
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      if (!kEveryThreadCopies && static_cast<int>(threadIdx.x) + j * kThreads >= kRows * 8) break;
      cp_async_16(slot + dst[j], src[j], valid[j]);
      src[j] += kHalfRowBytes;
    }
  }
};

// The accumulator of m64nBNk16 to D through the epilogue (or to `partials` with split K): for value i of a
// thread, row 16 * warp + lane / 4 + 8 * (i / 2 % 2) of its warp group's 64 and column 8 * (i / 4) +
// 2 * (lane % 4) + i % 2 (pairs of adjacent columns).
template <int BN, class OutT>
__device__ __forceinline__ void store_accumulators(const Params& p, const float (&acc)[BN / 2], int64_t m0, int64_t n0,
                                                   float* partials) {
  const int lane = threadIdx.x & 31, warp_group = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = m0 + warp_group * 64 + warp * 16 + (lane >> 2) + half * 8;
    if (row >= p.m) continue;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int64_t col = n0 + j * 8 + (lane & 3) * 2;
      if (col >= p.n) continue;
      // the fp16 operands each carry 2^-14 (fused_gemm::decode8): exact power-of-two unscaling
      const float v0 = acc[4 * j + 2 * half] * fused_gemm::kAccumulatorUnscale;
      const float v1 = acc[4 * j + 2 * half + 1] * fused_gemm::kAccumulatorUnscale;
      if (p.split_k == 1) {
        store_pair<OutT>(p, row, col, v0, v1);
      } else {
        partials[row * p.n + col] = v0;
        if (col + 1 < p.n) partials[row * p.n + col + 1] = v1;
      }
    }
  }
}

// One CTA's output tile: rows m0 .. m0 + BM - 1 (those below p.m) and columns n0 .. n0 + BN - 1 of D, over
// k-tiles k_first .. k_first + k_tiles - 1; with p.split_k > 1 the sums go to `partials` ([m, n]) instead
// of through the epilogue. Shared memory: Tile<BM, BN>::kSmemBytes of dynamic shared memory.
template <int BM, int BN, class OutT>
__device__ __forceinline__ void gemm_tile(const Params& p, const uint8_t* a_half, int64_t m0, int64_t n0, int k_first,
                                          int k_tiles, float* partials) {
  using T = Tile<BM, BN>;
  constexpr int kThreads = T::kThreads, kStages = T::kStages;
  extern __shared__ uint8_t smem_raw[];
  // aligned by an offset from smem_raw, not through an integer cast, so the compiler still knows these
  // are shared-memory addresses (LDS/STS rather than generic loads and stores)
  const uint32_t misalignment = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & (kSwizzleBytes - 1);
  uint8_t* const a_slots = smem_raw + ((kSwizzleBytes - misalignment) & (kSwizzleBytes - 1));
  uint8_t* const halves = a_slots + T::kASlots * T::kASlotBytes;  // B's fp16 tiles
  uint8_t* const stages = halves + T::kBuffers * T::kHalfBytes;   // kStages x [codes BN x 32 | scales BN x 4]

  const int tid = threadIdx.x, warp_group = tid >> 7;

  // B's rows only (a loader over zero rows of A)
  fused_gemm::PackedTileLoader<0, BN, kThreads> b_loader(p, m0, n0, k_first, tid);
  HalfTileLoader<BM, kThreads> a_loader(a_half, p.m, p.k, m0, k_first, tid);
  // k-tiles are staged in order, each once: B's codes and scales into a stage, A's rows into an A slot
  auto stage_k_tile = [&](int stage, int a_slot) {
    b_loader.load_next(stages + stage * T::kStageBytes, tid);
    a_loader.load_next(a_slots + a_slot * T::kASlotBytes);
  };
  auto dequantize_k_tile = [&](int stage, int buffer) {
    fused_gemm::dequantize_packed_k_tile<BN, kThreads>(stages + stage * T::kStageBytes,
                                                       halves + buffer * T::kHalfBytes, tid);
  };
  auto next = [](int index, int count) { return index + 1 == count ? 0 : index + 1; };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

  // Descriptors of this warp group's 64 rows of A in slot 0 and of B's buffer 0; a slot, a buffer or a k16
  // step (32 bytes along the rows) further is that many 16-byte units added to the address field, which
  // cannot carry out of it (shared addresses stay below 2^18).
  const uint64_t a_descriptor = sw128_descriptor(static_cast<uint32_t>(__cvta_generic_to_shared(a_slots)) +
                                                 warp_group * 64 * kHalfRowBytes);
  const uint64_t b_descriptor = sw128_descriptor(static_cast<uint32_t>(__cvta_generic_to_shared(halves)));
  auto multiply_k_tile = [&](int a_slot, int buffer) {
    const uint64_t a = a_descriptor + a_slot * (T::kASlotBytes >> 4);
    const uint64_t b = b_descriptor + buffer * (T::kHalfBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk)
      wgmma<Mma<BN>>(a + 2 * kk, b + 2 * kk, acc, std::make_index_sequence<BN / 2>{});
    wgmma_commit();
  };

  // One barrier per k-tile. At its top, iteration kt finds k-tile kt's A slot and B fp16 tile written and
  // fenced by every thread, and k-tile kt + 1 staged. It issues kt's wgmma, stages k-tile kt + kStages (B's
  // codes where kt's were, A into the slot kt - 1's wgmma read), dequantizes B's kt + 1 into the other
  // buffer while the tensor cores work, and waits for its wgmma and for k-tile kt + 2's copies before the
  // barrier. The fence after the wait makes both the copied A rows and the dequantized B rows visible to
  // wgmma (the async proxy). Slots and stages advance as running indices (no division in the loop).
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < k_tiles) stage_k_tile(s, s);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();  // k-tile 0
  __syncthreads();
  dequantize_k_tile(0, 0);
  cp_async_wait<kStages - 2>();  // k-tile 1
  fence_async_shared();
  __syncthreads();
  int a_read = 0, stage_write = 0, a_write = kStages % T::kASlots, stage_dequantize = 1 % kStages;
  for (int kt = 0; kt < k_tiles; ++kt) {
    fence_registers(acc);
    multiply_k_tile(a_read, kt & 1);
    if (kt + kStages < k_tiles) stage_k_tile(stage_write, a_write);
    cp_async_commit();
    if (kt + 1 < k_tiles) dequantize_k_tile(stage_dequantize, (kt + 1) & 1);
    cp_async_wait<kStages - 2>();
    fence_async_shared();
    wgmma_wait<0>();
    fence_registers(acc);
    __syncthreads();
    a_read = next(a_read, T::kASlots), a_write = next(a_write, T::kASlots);
    stage_write = next(stage_write, kStages), stage_dequantize = next(stage_dequantize, kStages);
  }

  store_accumulators<BN, OutT>(p, acc, m0, n0, partials);
}

template <int BM, int BN, int kCtas, class OutT>
__global__ void __launch_bounds__(Tile<BM, BN>::kThreads, kCtas) gemm_kernel(const Params p, const uint8_t* a_half) {
  static_assert(fits_multiprocessor<BM, BN, kCtas>(), "the tile's shared memory does not fit kCtas CTAs");
  fused_gemm::wait_for_prerequisites_release_dependents();  // dequantize_rows' programmatic dependent
  const int all_k_tiles = static_cast<int>(p.k / kTileK);
  const int k_first = static_cast<int>(static_cast<int64_t>(all_k_tiles) * blockIdx.z / p.split_k);
  const int k_tiles = static_cast<int>(static_cast<int64_t>(all_k_tiles) * (blockIdx.z + 1) / p.split_k) - k_first;
  gemm_tile<BM, BN, OutT>(p, a_half, static_cast<int64_t>(blockIdx.y) * BM, static_cast<int64_t>(blockIdx.x) * BN,
                          k_first, k_tiles, p.partials + static_cast<int64_t>(blockIdx.z) * p.m * p.n);
}

// The workspace: split K's partial sums (fused_gemm_workspace_size), then A's fp16 copy at a 256-byte
// boundary.
inline size_t half_a_offset(FP4GEN_FUSED_GEMM_PARAMS) {
  return round_to_256(fused_gemm_workspace_size(FP4GEN_FUSED_GEMM_ARGS));
}

}  // namespace fused_wgmma

inline size_t fused_wgmma_workspace_size(FP4GEN_FUSED_GEMM_PARAMS) {
  if (m <= 0 || n <= 0) return 0;
  return fused_wgmma::half_a_offset(FP4GEN_FUSED_GEMM_ARGS) + static_cast<size_t>(m * k) * 2;
}

// The packed kernels' rules, and a workspace for A's fp16 copy whenever there is work.
template <int BM, int BN>
int fused_wgmma_can_implement(FP4GEN_FUSED_GEMM_PARAMS) {
  const int status = fused_gemm_can_implement<BM, BN>(FP4GEN_FUSED_GEMM_ARGS);
  if (status != kOk) return status;
  return m > 0 && n > 0 && workspace == nullptr ? kInvalidProblem : kOk;
}

// Checks the problem and launches a GEMM that reads A's fp16 copy: A dequantized into the workspace, then
// kKernel (params, A's fp16 rows) over BM x BN tiles with kThreads threads and kSmemBytes of dynamic shared
// memory, then with split K the kernel that adds the partial sums. With split_in_cluster the split_k CTAs of a
// tile run as one cluster and kKernel adds their partial sums itself (gemm_packed_rs.cuh): no second kernel.
// kOrder: the order of A's fp16 copy that kKernel reads (HalfOrder).
template <int BM, int BN, class OutT, auto kKernel, int kThreads, int kSmemBytes,
          fused_wgmma::HalfOrder kOrder = fused_wgmma::HalfOrder::kChunks>
int launch_half_a_gemm(FP4GEN_FUSED_GEMM_PARAMS, cudaStream_t stream, bool split_in_cluster = false) {
  const int status = fused_wgmma_can_implement<BM, BN>(FP4GEN_FUSED_GEMM_ARGS);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  if (const int opted = opt_in_shared_bytes_here<kKernel>(kSmemBytes); opted != kOk) return opted;
  const fused_gemm::Params params = fused_gemm::make_params(FP4GEN_FUSED_GEMM_ARGS);
  uint8_t* const a_half = static_cast<uint8_t*>(workspace) + fused_wgmma::half_a_offset(FP4GEN_FUSED_GEMM_ARGS);
  fused_wgmma::dequantize_rows<kOrder>(a_codes, a_scale, lda, lda_scale, m, k, a_half, stream);
  const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN), static_cast<unsigned>((m + BM - 1) / BM),
                  static_cast<unsigned>(split_k));
  // The GEMM and the split-K reduction launch as programmatic dependents, each while the kernel before it runs
  // (both wait for it before they read what it writes): the launch gaps between them overlap work.
  if (!split_in_cluster || split_k == 1) {
    const int launched = launch_programmatic_dependent(kKernel, grid, dim3(kThreads), kSmemBytes, stream, params,
                                                       a_half);
    if (launched != kOk) return launched;
    if (split_k > 1) fused_gemm::launch_split_k_epilogue<OutT>(params, stream);
    return launch_status();
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = 1, attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = static_cast<unsigned>(split_k);
  config.attrs = attributes;
  config.numAttrs = 2;
  cudaLaunchKernelEx(&config, kKernel, params, static_cast<const uint8_t*>(a_half));
  return launch_status();
}

template <int BM, int BN, int kCtas, class OutT>
int fused_wgmma_run(FP4GEN_FUSED_GEMM_PARAMS, cudaStream_t stream) {
  using T = fused_wgmma::Tile<BM, BN>;
  return launch_half_a_gemm<BM, BN, OutT, fused_wgmma::gemm_kernel<BM, BN, kCtas, OutT>, T::kThreads,
                            T::kSmemBytes>(FP4GEN_FUSED_GEMM_ARGS, stream);
}

}  // namespace fp4gen
