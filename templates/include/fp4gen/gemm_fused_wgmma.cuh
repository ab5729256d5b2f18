// Hopper NVFP4 GEMM that reads the packed operands and multiplies with wgmma:
//     D[i, j] = beta * C[i, j] + (alpha * (row_amax[i or 0] * (col_amax[j or 0] * sum_k A[i, k] B[j, k]))
//               + bias[j])
// the same problem, parameters and epilogue as gemm_fused_dequant.cuh, whose staging and on-chip
// dequantization it shares; what differs is the multiply.
//
// Why: the mma.sync kernel issues its MMAs from the same warps that dequantize, and mma.sync reaches only
// part of Hopper's tensor-core rate; the wgmma family reads bf16 scratch that a separate pass wrote. Here
// one warp group per 64 rows of the tile issues asynchronous wgmma (fp16 in, fp32 accumulate, both operands
// from shared memory) for k-tile kt and, while the tensor cores run it, stages k-tile kt + kStages and
// dequantizes k-tile kt + 1 into the other fp16 buffer. No operand passes through global memory as fp16.
//
// The fp16 tile is the 128-byte-swizzled K-major layout wgmma reads: rows of 64 elements (128 bytes), chunk
// c of row r at chunk c ^ (r % 8), eight-row groups 1024 bytes apart, the buffer 1024-byte aligned;
// half_tile_offset computes exactly this.
#pragma once

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
  static constexpr int kRows = BM + BN;
  static constexpr int kStageBytes = kRows * (kCodeBytes + kScaleBytes);
  static constexpr int kStages = 4;
  static constexpr int kHalfBytes = kRows * kHalfRowBytes;  // whole 1024-byte groups: kRows is a multiple of 64
  // two fp16 tiles (the one the tensor cores read, the one being written) first, at the aligned base; the
  // stages after them; slack to align the base. (A third tile, so that the tensor cores keep a k-tile queued
  // across the barrier, measured slower on the H200: it halves the CTAs per multiprocessor of 128x128 tiles.)
  static constexpr int kBuffers = 2;
  static constexpr int kSmemBytes = kSwizzleBytes + kBuffers * kHalfBytes + kStages * kStageBytes;
};

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

template <int BM, int BN, class OutT>
__global__ void __launch_bounds__(Tile<BM, BN>::kThreads, 1) gemm_kernel(const Params p) {
  using T = Tile<BM, BN>;
  constexpr int kThreads = T::kThreads, kStages = T::kStages;
  extern __shared__ uint8_t smem_raw[];
  // aligned by an offset from smem_raw, not through an integer cast, so the compiler still knows these
  // are shared-memory addresses (LDS/STS rather than generic loads and stores)
  const uint32_t misalignment = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & (kSwizzleBytes - 1);
  uint8_t* const halves = smem_raw + ((kSwizzleBytes - misalignment) & (kSwizzleBytes - 1));
  uint8_t* const stages = halves + T::kBuffers * T::kHalfBytes;  // kStages x [codes kRows x 32 | scales kRows x 4]

  const int tid = threadIdx.x, lane = tid & 31, warp_group = tid >> 7, warp = (tid >> 5) & 3;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM, n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int all_k_tiles = static_cast<int>(p.k / kTileK);
  const int k_first = static_cast<int>(static_cast<int64_t>(all_k_tiles) * blockIdx.z / p.split_k);
  const int k_tiles = static_cast<int>(static_cast<int64_t>(all_k_tiles) * (blockIdx.z + 1) / p.split_k) - k_first;

  const fused_gemm::PackedTileLoader<BM, T::kRows, kThreads> loader(p, m0, n0, k_first, tid);
  auto stage_k_tile = [&](int kt, int slot) { loader.load(stages + slot * T::kStageBytes, kt, tid); };
  auto dequantize_k_tile = [&](int kt) {
    fused_gemm::dequantize_packed_k_tile<T::kRows, kThreads>(stages + (kt % kStages) * T::kStageBytes,
                                                             halves + (kt % T::kBuffers) * T::kHalfBytes, tid);
    fence_async_shared();
  };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

  const uint32_t halves_address = static_cast<uint32_t>(__cvta_generic_to_shared(halves));
  // this warp group's 64 rows of A, and all of B; a k16 step is 32 bytes further along the rows
  auto multiply_k_tile = [&](int kt) {
    const uint32_t tile = halves_address + (kt % T::kBuffers) * T::kHalfBytes;
    const uint32_t a = tile + warp_group * 64 * kHalfRowBytes, b = tile + BM * kHalfRowBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk)
      wgmma<Mma<BN>>(sw128_descriptor(a + 32 * kk), sw128_descriptor(b + 32 * kk), acc,
                     std::make_index_sequence<BN / 2>{});
    wgmma_commit();
  };

  // One barrier per k-tile. At its top, iteration kt finds k-tile kt in fp16 buffer kt % 2 (written and
  // fenced by every thread) and k-tile kt + 1 staged. It issues kt's wgmma, refills the stage k-tile kt left
  // (with kt + kStages), dequantizes kt + 1 into the other buffer while the tensor cores work, and waits for
  // its wgmma and for k-tile kt + 2's copies before the barrier.
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < k_tiles) stage_k_tile(s, s);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();  // k-tile 0
  __syncthreads();
  dequantize_k_tile(0);
  cp_async_wait<kStages - 2>();  // k-tile 1
  __syncthreads();
  for (int kt = 0; kt < k_tiles; ++kt) {
    fence_registers(acc);
    multiply_k_tile(kt);
    if (kt + kStages < k_tiles) stage_k_tile(kt + kStages, kt % kStages);
    cp_async_commit();
    if (kt + 1 < k_tiles) dequantize_k_tile(kt + 1);
    cp_async_wait<kStages - 2>();
    wgmma_wait<0>();
    fence_registers(acc);
    __syncthreads();
  }

  // The accumulator of m64nBNk16: for value i of a thread, row 16 * warp + lane / 4 + 8 * (i / 2 % 2) and
  // column 8 * (i / 4) + 2 * (lane % 4) + i % 2 (pairs of adjacent columns).
  float* const partials = p.partials + static_cast<int64_t>(blockIdx.z) * p.m * p.n;
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

}  // namespace fused_wgmma

template <int BM, int BN, class OutT>
int fused_wgmma_run(FP4GEN_FUSED_GEMM_PARAMS, cudaStream_t stream) {
  using T = fused_wgmma::Tile<BM, BN>;
  return launch_packed_gemm<BM, BN, OutT, fused_wgmma::gemm_kernel<BM, BN, OutT>, T::kThreads, T::kSmemBytes>(
      FP4GEN_FUSED_GEMM_ARGS, stream);
}

}  // namespace fp4gen
