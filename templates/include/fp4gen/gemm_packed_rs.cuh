// Hopper NVFP4 GEMM for small M with B dequantized into registers (wgmma with A from registers):
//     D[i, j] = beta * C[i, j] + (alpha * (row_amax[i or 0] * (col_amax[j or 0] * sum_k A[i, k] B[j, k]))
//               + bias[j])
// the problem, parameters, workspace and epilogue of gemm_fused_wgmma.cuh.
//
// Why: at small M the GEMM is bound by B, the large operand. gemm_fused_wgmma.cuh dequantizes B's k-tiles into
// fp16 tiles in shared memory that wgmma then reads, once per warp group: each B element crosses shared
// memory as fp16 two or three times (a store, a wgmma read per warp group) besides its codes. Here the CTA
// computes the tile transposed, D^T = B A^T: each warp group decodes its 64 rows of B straight into wgmma's
// register fragments (the "A" operand of m64nBMk16, from registers) and only A, the small operand, is read by
// wgmma from shared memory. B's codes and scales still arrive by cp.async, kStages k-tiles deep, with A's fp16
// rows (dequantized once per GEMM into the workspace, as gemm_fused_wgmma.cuh).
//
// A tile is BM rows of A (wgmma's N) by BN rows of B (BN / 64 warp groups). The fragment of m64k16 a thread
// holds is rows lane / 4 and lane / 4 + 8 of its warp's 16, k pairs 2 (lane % 4) and 2 (lane % 4) + 8. Any
// order of a k-tile's 64 elements gives the same dot products if A's fp16 rows take it too; A's copy takes
// HalfOrder::kSteps (gemm_fused_wgmma.cuh), in which those positions of step s are pair s of decode8 (elements
// s and s + 4) of code words 2 (lane % 4) and 2 (lane % 4) + 1 of the k-tile: one block of each row. So a thread
// loads 8 bytes of codes and one scale a row and k-tile and decodes whole words with constant shifts. (In
// decode8's own order, a k16 step a block, each thread took one pair of every word, shifted by 4 (lane % 4)
// first, and converted all four scales of a row.)
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90.hpp>

#include "fp4gen/cluster.cuh"
#include "fp4gen/gemm_fused_wgmma.cuh"

namespace fp4gen {
namespace packed_rs {

using fused_gemm::kCodeBytes;
using fused_gemm::kHalfRowBytes;
using fused_gemm::kScaleBytes;
using fused_gemm::kTileK;
using fused_gemm::Params;
using fused_wgmma::kSwizzleBytes;

template <int BM, int BN>
struct Tile {
  static_assert(BN % 64 == 0 && BN <= 128, "one warp group per 64 rows of B, at most two");
  static_assert(BM % 8 == 0 && BM >= 16 && BM <= 256, "wgmma N: whole eight-row swizzle groups of A, up to 256");
  static constexpr int kWarpGroups = BN / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  // The mainloop: with 128 rows of A or more each k16 step's wgmma is long enough to hide the next step's
  // decode behind it (overlapped, below); with 64 the serial loop measured faster on the H200 (bench/RESULTS.md),
  // and with the whole-word decode both loops ran within 2% of each other at 16 and 64 rows (H100, 2026-12-07).
  static constexpr bool kOverlapDecode = BM >= 128;
  // k-tiles in flight (B's codes and scales, A's fp16 rows): six, four for 128 rows of A so that two CTAs
  // share a multiprocessor (and for 256 rows, whose one CTA a multiprocessor fills the shared memory), and
  // twelve for 16 rows, whose small A slots leave room for them (at M = 16 on the
  // H200, 12 stages against 6: 17% and 14% faster at N x K = 8192 x 8192 and 4096 x 14336, 5% slower at
  // 14336 x 4096; three or four CTAs a multiprocessor with 6 or 10 stages were no faster; bench/RESULTS.md)
  static constexpr int kStages = BM >= 128 ? 4 : BM <= 16 ? 12 : 6;
  static constexpr int kCodeStageBytes = BN * (kCodeBytes + kScaleBytes);
  static constexpr int kASlotBytes = BM * kHalfRowBytes;  // whole 1024-byte groups
  static constexpr int kSmemBytes = kSwizzleBytes + kStages * (kASlotBytes + kCodeStageBytes);
  // Split K in a cluster: the tile's partial sums, [BM][kSumsPitch] fp32 over the stages after the mainloop; the
  // pitch puts the four rows (2 (lane % 4)) that a warp's store touches at once in distinct banks.
  static constexpr int kSumsPitch = BN + 4;
  static_assert(BM * kSumsPitch * 4 <= kStages * (kASlotBytes + kCodeStageBytes), "the partial sums fit");
};

// wgmma m64 x BM x k16, fp16 "A" (here B's rows) from registers, fp16 "B" (A's rows) K-major in shared memory.
template <int BM>
using Mma = decltype(cute::SM90::GMMA::rs_op_selector<cute::half_t, cute::half_t, float,
                                                      cute::Shape<cute::_64, cute::Int<BM>, cute::_16>,
                                                      cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>());

template <class Op, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t b, float* acc, std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, acc[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// Pair `step` of decode8(word) (elements `step` and `step` + 4 of the word's eight, as fp16 times 2^-14), times the
// block scale (exact: see fused_gemm::scale_pair). `step` is a constant wherever this is inlined, and so are the
// shifts: decode8's word `step` alone.
__device__ __forceinline__ uint32_t decode_pair(uint32_t word, int step, __half2 scale) {
  const uint32_t magnitude = step < 3 ? word << (9 - 4 * step) : word >> 3;  // e1 e0 m to bits 11..9 of each half
  const uint32_t sign = word << (12 - 4 * step);                              // the sign to bit 15
  return fused_gemm::scale_pair((magnitude & 0x0E000E00u) | (sign & 0x80008000u), scale);
}

// A thread's code words of one k-tile: words 2q and 2q + 1 (q = lane % 4: the block q of the k-tile) of its rows
// r and r + 8, and those blocks' scales.
struct ThreadWords {
  uint2 low, high;  // rows r and r + 8
  __half2 low_scale, high_scale;
};

// One m64k16 fragment of step `step` (HalfOrder::kSteps): positions 2q, 2q + 1 of the step are pair `step` of
// word 2q, positions 2q + 8, 2q + 9 pair `step` of word 2q + 1, each of rows r and r + 8.
__device__ __forceinline__ void decode_fragment(const ThreadWords& w, int step, uint32_t (&fragment)[4]) {
  fragment[0] = decode_pair(w.low.x, step, w.low_scale);    // row r, word 2q
  fragment[1] = decode_pair(w.high.x, step, w.high_scale);  // row r + 8, word 2q
  fragment[2] = decode_pair(w.low.y, step, w.low_scale);    // row r, word 2q + 1
  fragment[3] = decode_pair(w.high.y, step, w.high_scale);  // row r + 8, word 2q + 1
}

template <int BM, int BN, int kCtas, class OutT>
__global__ void __launch_bounds__(Tile<BM, BN>::kThreads, kCtas) gemm_kernel(const Params p, const uint8_t* a_half) {
  using T = Tile<BM, BN>;
  static_assert(fused_wgmma::ctas_fit_multiprocessor(kCtas, T::kSmemBytes),
                "the tile's shared memory does not fit kCtas CTAs");
  constexpr int kStages = T::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t misalignment = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & (kSwizzleBytes - 1);
  uint8_t* const a_slots = smem_raw + ((kSwizzleBytes - misalignment) & (kSwizzleBytes - 1));
  uint8_t* const stages = a_slots + kStages * T::kASlotBytes;  // kStages x [codes BN x 32 | scales BN x 4]

  const int tid = threadIdx.x, lane = tid & 31, warp_group = tid >> 7, warp = (tid >> 5) & 3;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM, n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int all_k_tiles = static_cast<int>(p.k / kTileK);
  const int k_first = static_cast<int>(static_cast<int64_t>(all_k_tiles) * blockIdx.z / p.split_k);
  const int k_tiles = static_cast<int>(static_cast<int64_t>(all_k_tiles) * (blockIdx.z + 1) / p.split_k) - k_first;

  fused_gemm::PackedTileLoader<0, BN, T::kThreads> b_loader(p, m0, n0, k_first, tid);  // B's rows only
  fused_wgmma::HalfTileLoader<BM, T::kThreads> a_loader(a_half, p.m, p.k, m0, k_first, tid);
  auto stage_k_tile = [&](int stage) {
    b_loader.load_next(stages + stage * T::kCodeStageBytes, tid);
    a_loader.load_next(a_slots + stage * T::kASlotBytes);
  };
  // The pipeline's first `ahead` stages. This kernel is dequantize_rows' programmatic dependent and may start
  // before A's fp16 copy is made, but B was written before dequantize_rows began (it is launched plainly, after
  // whatever wrote B): B's k-tiles are requested first, as one copy group, then the kernel waits for A's copy
  // and requests A's (a group a stage, as stage_k_tile's), so that B's first bytes are on their way while the
  // copy runs (on the H200, bench/RESULTS.md, 2026-12-04: 1-2% off calls on the 16-row and 256-row tiles, the
  // others within 0.5%). The group count is one more than stage_k_tile's alone would give, and the group of B is
  // the oldest, so each cp_async_wait below still covers both operands of its k-tile.
  auto fill_pipeline = [&](int ahead) {
    for (int s = 0; s < ahead; ++s)
      if (s < k_tiles) b_loader.load_next(stages + s * T::kCodeStageBytes, tid);
    cp_async_commit();
    fused_gemm::wait_for_prerequisites_release_dependents();
    for (int s = 0; s < ahead; ++s) {
      if (s < k_tiles) a_loader.load_next(a_slots + s * T::kASlotBytes);
      cp_async_commit();
    }
  };

  // This thread's rows of B within the CTA's BN (its fragment rows r and r + 8) and its block of each k-tile.
  const int row = warp_group * 64 + warp * 16 + (lane >> 2);
  const int block = lane & 3;
  // loads the thread's words and scales of k-tile `stage` (8 bytes of codes and a scale byte a row)
  auto load_words = [&](int stage, ThreadWords& w) {
    const uint8_t* const codes = stages + stage * T::kCodeStageBytes + 8 * block;
    const uint8_t* const scales = stages + stage * T::kCodeStageBytes + BN * kCodeBytes + block;
    w.low = *reinterpret_cast<const uint2*>(codes + row * kCodeBytes);
    w.high = *reinterpret_cast<const uint2*>(codes + (row + 8) * kCodeBytes);
    w.low_scale = fused_gemm::e4m3_to_half2(scales[row * kScaleBytes]);
    w.high_scale = fused_gemm::e4m3_to_half2(scales[(row + 8) * kScaleBytes]);
  };
  // the k-tile's four fragments, one a step
  auto decode_k_tile = [&](int stage, uint32_t (&fragments)[4][4]) {
    ThreadWords w;
    load_words(stage, w);
#pragma unroll
    for (int step = 0; step < 4; ++step) decode_fragment(w, step, fragments[step]);
  };
  // one step's fragment; step 0 loads the k-tile's words, which steps 1-3 (decoded next, in order) take from there
  ThreadWords step_words;
  auto decode_step = [&](int stage, int step, uint32_t (&fragment)[4]) {
    if (step == 0) load_words(stage, step_words);
    decode_fragment(step_words, step, fragment);
  };

  float acc[BM / 2];
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) acc[i] = 0.0f;
  const uint64_t a_descriptor = fused_wgmma::sw128_descriptor(static_cast<uint32_t>(__cvta_generic_to_shared(a_slots)));

  uint32_t fragments[4][4];
  static_assert(!T::kOverlapDecode || kStages >= 3, "the overlapped loop keeps two k-tiles ahead");
  if constexpr (!T::kOverlapDecode) {
    // Serial: one barrier per k-tile. At its top, iteration kt finds k-tile kt landed (every thread waited for
    // its own copies and fenced them for wgmma) and every warp group done with k-tile kt - 1, so kt - 1's stage
    // takes k-tile kt + kStages - 1. Then the thread decodes kt, issues its four wgmma and waits for them; the
    // other warp groups' wgmma (two a CTA, and a second CTA) keep the tensor cores busy meanwhile.
    fill_pipeline(kStages - 1);
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();  // this thread's copies of k-tile kt
      fused_wgmma::fence_async_shared();
      __syncthreads();
      if (kt + kStages - 1 < k_tiles) stage_k_tile((kt + kStages - 1) % kStages);
      cp_async_commit();
      const int stage = kt % kStages;
      decode_k_tile(stage, fragments);
      fused_wgmma::fence_registers(acc);
      fused_wgmma::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk)
        wgmma_rs<Mma<BM>>(fragments[kk], a_descriptor + stage * (T::kASlotBytes >> 4) + 2 * kk, acc,
                          std::make_index_sequence<BM / 2>{});
      fused_wgmma::wgmma_commit();
      fused_wgmma::wgmma_wait<0>();
      fused_wgmma::fence_registers(acc);
    }
  } else {
    // Overlapped, as CUTLASS's register-A mainloop: one commit group per k16 step, at most two pending. Step
    // s + 1's fragment is decoded before step s's wgmma is issued, into a fragment that no pending wgmma reads
    // (four fragments, one a step). ptxas serializes every wgmma (C7513) if a fragment register is written
    // while a wgmma reading it may be pending, so that rule is what lets the decode run under the multiplies.
    //
    // arrive(kt) comes before k-tile kt's first block is decoded (within k-tile kt - 1's last step): the
    // thread's copies of kt have landed and are fenced for wgmma, and, past the barrier, every warp group is
    // done with k-tile kt - 2's wgmma (at most two steps of kt - 1 are pending), so kt - 2's stage takes k-tile
    // kt + kStages - 2.
    auto arrive = [&](int kt) {
      cp_async_wait<kStages - 3>();
      fused_wgmma::fence_async_shared();
      __syncthreads();
      if (kt + kStages - 2 < k_tiles) stage_k_tile((kt + kStages - 2) % kStages);
      cp_async_commit();
    };
    fill_pipeline(kStages - 2);
    if (k_tiles > 0) {
      arrive(0);
      decode_step(0, 0, fragments[0]);
    }
    fused_wgmma::fence_registers(acc);
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int stage = kt % kStages;
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) {
        if (kk + 1 < kTileK / 16) {
          decode_step(stage, kk + 1, fragments[kk + 1]);
        } else if (kt + 1 < k_tiles) {
          arrive(kt + 1);
          decode_step((kt + 1) % kStages, 0, fragments[0]);
        }
        fused_wgmma::wgmma_fence();
        wgmma_rs<Mma<BM>>(fragments[kk], a_descriptor + stage * (T::kASlotBytes >> 4) + 2 * kk, acc,
                          std::make_index_sequence<BM / 2>{});
        fused_wgmma::wgmma_commit();
        fused_wgmma::wgmma_wait<2>();
      }
    }
  }
  fused_wgmma::wgmma_wait<0>();
  fused_wgmma::fence_registers(acc);

  // acc holds D^T: value i of a thread is B row `row` + 8 * (i / 2 % 2) (D's column) and A row
  // 8 * (i / 4) + 2 * (lane % 4) + i % 2 (D's row).
  if (p.split_k == 1 || cluster_ctas() == 1) {
    float* const partials = p.partials + static_cast<int64_t>(blockIdx.z) * p.m * p.n;
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
      const int64_t col = n0 + row + 8 * (i / 2 % 2);
      const int64_t r = m0 + 8 * (i / 4) + 2 * (lane & 3) + i % 2;
      if (r >= p.m || col >= p.n) continue;
      const float v = acc[i] * fused_gemm::kAccumulatorUnscale;  // the fp16 operands each carry 2^-14
      if (p.split_k == 1) {
        fused_gemm::store_epilogue<OutT>(p, r, col, v);
      } else {
        partials[r * p.n + col] = v;
      }
    }
    return;
  }
  // Split K in a cluster (packed_rs_run: two splits, tiles of 64 rows or more): the tile's CTAs are one cluster,
  // rank = split. Each puts its partial sums into its own shared memory (the pipeline's, idle now), then takes
  // half the tile's elements and adds both ranks' sums in split order through distributed shared memory, for
  // the epilogue: the same sums as split_k_epilogue_kernel's, with no partial sums in global memory and no
  // kernel after this one.
  __syncthreads();  // every warp group's wgmma done with the shared memory
  float* const sums = reinterpret_cast<float*>(a_slots);  // [BM][T::kSumsPitch]
#pragma unroll
  for (int i = 0; i < BM / 2; ++i)
    sums[(8 * (i / 4) + 2 * (lane & 3) + i % 2) * T::kSumsPitch + row + 8 * (i / 2 % 2)] =
        acc[i] * fused_gemm::kAccumulatorUnscale;
  cluster_arrive();
  cluster_wait();  // every rank's partial sums are visible
  const int splits = static_cast<int>(cluster_ctas()), share = (BM * BN + splits - 1) / splits;
  const int begin = static_cast<int>(cluster_rank()) * share, end = min(BM * BN, begin + share);
  for (int e = begin + tid; e < end; e += T::kThreads) {  // consecutive threads: consecutive columns
    const int local_row = e / BN, local_col = e % BN;
    const int64_t r = m0 + local_row, col = n0 + local_col;
    if (r >= p.m || col >= p.n) continue;
    const float* const slot = sums + local_row * T::kSumsPitch + local_col;
    float sum = load_cluster_shared(slot, 0);
    for (int s = 1; s < splits; ++s) sum += load_cluster_shared(slot, s);
    fused_gemm::store_epilogue<OutT>(p, r, col, sum);
  }
  cluster_arrive();
  cluster_wait();  // no rank exits while another may still read its shared memory
}

}  // namespace packed_rs

// Split K in two runs as one cluster a tile, summed on chip, for tiles of 64 rows or more; other splits, and the
// 16-row tile, write partial sums for split_k_epilogue_kernel. (On the H200, bench/RESULTS.md, 2026-12-04:
// clusters of two took 4-6% off M = 128 and 256 calls that the rule splits in two, and made the 16-row tile's
// 1-3% slower; clusters of 4 and 8 CTAs of this kernel's shape did not all fit at once, 62 of 4 and 30 of 8
// against the 64 and 32 that 8192 x 8192 and 4096 x 14336 need at M <= 128, and ran 1.5-1.6x slower.)
constexpr int64_t kPackedRsClusterSplit = 2;

template <int BM, int BN, int kCtas, class OutT>
int packed_rs_run(FP4GEN_FUSED_GEMM_PARAMS, cudaStream_t stream) {
  using T = packed_rs::Tile<BM, BN>;
  return launch_half_a_gemm<BM, BN, OutT, packed_rs::gemm_kernel<BM, BN, kCtas, OutT>, T::kThreads, T::kSmemBytes,
                            fused_wgmma::HalfOrder::kSteps>(FP4GEN_FUSED_GEMM_ARGS, stream,
                                                            BM >= 64 && split_k == kPackedRsClusterSplit);
}

}  // namespace fp4gen
