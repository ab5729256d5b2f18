// Hopper NVFP4 GEMM for small M, read straight from the packed operands:
//     D[i, j] = beta * C[i, j] + (alpha * (row_amax[i or 0] * (col_amax[j or 0] * sum_k A[i, k] B[j, k]))
//               + bias[j])
// (no bias term when bias is null), where A and B hold block-scaled values e2m1 * e4m3 (docs/numerics.md,
// dequantization, without the amax factor).
//
// Why: when M is small the GEMM is bound by reading B. The wgmma family reads B as 16-bit scratch that a
// separate pass wrote (4 bytes of traffic per element, plus 0.5 to read the codes); this kernel reads the
// 0.5625 bytes of codes and scales once, so one tile row covering M streams B at close to DRAM speed.
//
// Per k-tile of 64 elements: cp.async stages the codes and scales of the CTA's A and B rows (several
// tiles in flight); all threads dequantize the staged tile once into fp16 shared memory; warps multiply it
// with ldmatrix + mma.sync (fp16 in, fp32 accumulate). e2m1 * e4m3 has at most 6 significant bits and lies
// in [2^-10, 2688], so it is exact in fp16: the result equals the NVFP4 product up to summation order.
//
// Small M gives few CTAs (one per 64 columns), too few to keep enough bytes in flight. The caller may split
// K over split_k CTAs per tile: each writes its fp32 partial sums to the workspace, and a second kernel adds
// them in a fixed order (deterministic) and applies the epilogue.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fp4gen/abi.h"
#include "fp4gen/async_copy.cuh"

namespace fp4gen {
namespace fused_gemm {

constexpr int kThreads = 128;                // four warps
constexpr int kTileK = 64;                   // elements per k-tile: four NVFP4 blocks
constexpr int kCodeBytes = kTileK / 2;       // packed codes per row and k-tile
constexpr int kScaleBytes = kTileK / 16;     // E4M3 block scales per row and k-tile
constexpr int kHalfRowBytes = kTileK * 2;    // one row of the k-tile in fp16: eight 16-byte chunks
// Each operand's fp16 values carry a factor 2^-14 (see decode8); the accumulator carries their product.
constexpr float kAccumulatorUnscale = 0x1p28f;

template <int BM, int BN>
struct Tile {
  static constexpr int kRows = BM + BN;  // A's rows, then B's, share the staging and dequantization code
  static constexpr int kWarpsM = BM >= 32 ? 2 : 1;
  static constexpr int kWarpsN = 4 / kWarpsM;
  static constexpr int kWarpM = BM / kWarpsM, kWarpN = BN / kWarpsN;
  static constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "a warp tile is whole 16x16 ldmatrix/mma steps");
  static constexpr int kStageBytes = kRows * (kCodeBytes + kScaleBytes);
  // staged k-tiles: small tiles stage few bytes each, so they keep more in flight; larger ones keep three,
  // so that three 128x64 CTAs (77 KB each with four) fit in a multiprocessor's shared memory
  static constexpr int kStages = kStageBytes <= 4096 ? 8 : 3;
  static constexpr int kHalfBytes = kRows * kHalfRowBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kHalfBytes;  // fp16 tile double-buffered
};

struct Params {
  const uint8_t* a_codes;
  const uint8_t* a_scale;
  const uint8_t* b_codes;
  const uint8_t* b_scale;
  const void* c;
  void* d;
  const float* row_amax;
  const float* col_amax;
  const float* bias;  // [N] fp32, or nullptr
  float alpha, beta;
  int64_t m, n, k;
  int64_t lda, lda_scale, ldb, ldb_scale;  // bytes
  int64_t ldc, ldd;                        // elements
  bool row_is_vector, col_is_vector;
  int split_k;                             // > 1: partial sums to `partials` [split_k, m, n], no epilogue
  float* partials;
};

// Eight E2M1 codes (code i in bits 4i..4i+3) -> four fp16x2 words, word j = {code j, code j + 4}, each
// holding value * 2^-14. Placing a code's exponent and mantissa bits (e1 e0 m) at fp16 bits 11..9 makes
// the fp16 exponent field e: for e >= 1 that is 2^(e-15) * (1 + m/2) = 2^-14 * value, and for e = 0 the
// fp16 subnormal m * 2^-15 = 2^-14 * (m * 0.5). The sign bit moves to bit 15. Four shift/mask pairs for
// eight elements, instead of a table lookup each.
__device__ __forceinline__ void decode8(uint32_t codes, uint32_t (&out)[4]) {
  out[0] = ((codes << 9) & 0x0E000E00u) | ((codes << 12) & 0x80008000u);
  out[1] = ((codes << 5) & 0x0E000E00u) | ((codes << 8) & 0x80008000u);
  out[2] = ((codes << 1) & 0x0E000E00u) | ((codes << 4) & 0x80008000u);
  out[3] = ((codes >> 3) & 0x0E000E00u) | (codes & 0x80008000u);
}

// value * 2^-14 times the block scale stays exact in fp16: the product value * scale is a multiple of
// 2^-10 below 2688, so after the 2^-14 it is a multiple of 2^-24 (fp16's subnormal step) below 0.17, with
// at most 6 significant bits. fp16 multiplication keeps subnormals.
__device__ __forceinline__ uint32_t scale_pair(uint32_t word, __half2 scale) {
  const __half2 product = __hmul2(*reinterpret_cast<const __half2*>(&word), scale);
  return *reinterpret_cast<const uint32_t*>(&product);
}

__device__ __forceinline__ __half2 e4m3_to_half2(uint32_t byte) {
  // exact: every E4M3 value (NaN included) is an fp16 value
  const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(byte * 0x101u), __NV_E4M3);
  return *reinterpret_cast<const __half2*>(&pair);
}

// The fp16 tile is [rows][8 chunks of 16 bytes]; chunk c of row r lives at chunk c ^ (r % 8), so the eight
// rows an ldmatrix phase reads, and the rows the dequantization stores, fall in distinct banks.
__device__ __forceinline__ uint32_t half_tile_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kHalfRowBytes + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void mma_f16_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies k-tiles of the CTA's operands into stages: staged row r is A's row m0 + r for r < BM, else B's row
// n0 + r - BM; a stage is [kRows x 32 bytes of codes | kRows x 4 bytes of scales]. Rows past M or N are
// zero-filled, and zero codes with zero scales dequantize to 0. A thread copies the same rows in every
// k-tile, and the k-tiles go in order, so the addresses are worked out once, here, and each call to
// load_next moves them one k-tile on (a zero-filled copy's address stays inside row 0 of A: it is never
// read).
template <int BM, int kRows, int kThreads>
struct PackedTileLoader {
  static constexpr int kCodeCopies = (kRows * 2 + kThreads - 1) / kThreads;  // 16-byte chunks, two per row
  static constexpr int kScaleCopies = (kRows + kThreads - 1) / kThreads;     // 4-byte words, one per row
  const uint8_t* code_src[kCodeCopies];
  const uint8_t* scale_src[kScaleCopies];
  bool code_valid[kCodeCopies], scale_valid[kScaleCopies];

  __device__ __forceinline__ PackedTileLoader(const Params& p, int64_t m0, int64_t n0, int k_first, int tid) {
#pragma unroll
    for (int j = 0; j < kCodeCopies; ++j) {
      const int row = (tid + j * kThreads) >> 1, chunk = tid & 1;  // kThreads is even: the chunk is tid's
      const bool is_a = row < BM;
      const int64_t g = is_a ? m0 + row : n0 + (row - BM);
      code_valid[j] = row < kRows && g < (is_a ? p.m : p.n);
      code_src[j] = (code_valid[j] ? (is_a ? p.a_codes + g * p.lda : p.b_codes + g * p.ldb) : p.a_codes) +
                    static_cast<int64_t>(k_first) * kCodeBytes + chunk * 16;
    }
#pragma unroll
    for (int j = 0; j < kScaleCopies; ++j) {
      const int row = tid + j * kThreads;
      const bool is_a = row < BM;
      const int64_t g = is_a ? m0 + row : n0 + (row - BM);
      scale_valid[j] = row < kRows && g < (is_a ? p.m : p.n);
      scale_src[j] = (scale_valid[j] ? (is_a ? p.a_scale + g * p.lda_scale : p.b_scale + g * p.ldb_scale)
                                     : p.a_scale) +
                     static_cast<int64_t>(k_first) * kScaleBytes;
    }
  }

  // The next k-tile (k_first, then k_first + 1, ...) into the stage at `codes`.
  __device__ __forceinline__ void load_next(uint8_t* codes, int tid) {
    uint8_t* const scales = codes + kRows * kCodeBytes;
#pragma unroll
    for (int j = 0; j < kCodeCopies; ++j) {
      if ((kRows * 2) % kThreads != 0 && tid + j * kThreads >= kRows * 2) break;
      cp_async_16(codes + (tid + j * kThreads) * 16, code_src[j], code_valid[j]);
      code_src[j] += kCodeBytes;
    }
#pragma unroll
    for (int j = 0; j < kScaleCopies; ++j) {
      if (kRows % kThreads != 0 && tid + j * kThreads >= kRows) break;
      cp_async_4(scales + (tid + j * kThreads) * kScaleBytes, scale_src[j], scale_valid[j]);
      scale_src[j] += kScaleBytes;
    }
  }
};

// Half of a 16-element block: the chunk of eight fp16 values, each times 2^-14, from four code bytes (the block's
// first or second uint32 of codes) and the block's scale byte, the elements in decode8's order.
__device__ __forceinline__ uint4 dequantize_half_block(uint32_t codes, uint32_t scale_byte) {
  const __half2 scale = e4m3_to_half2(scale_byte);
  uint32_t v[4];
  decode8(codes, v);
  return make_uint4(scale_pair(v[0], scale), scale_pair(v[1], scale), scale_pair(v[2], scale), scale_pair(v[3], scale));
}

// One 16-element block (its 8 bytes of codes and its scale byte) as its two 16-byte chunks.
__device__ __forceinline__ void dequantize_block(uint2 packed, uint32_t scale_byte, uint4& first, uint4& second) {
  first = dequantize_half_block(packed.x, scale_byte), second = dequantize_half_block(packed.y, scale_byte);
}

// Every staged 16-element block once into the fp16 tile [kRows][128 bytes] (half_tile_offset's swizzle):
// two 16-byte chunks per block. Within a chunk the elements sit in decode8's order; A and B share it, so
// the dot products are unchanged. Task i = tid + j * kThreads is block i % 4 of row i / 4: its codes at
// byte 8i, its scale at byte i, and since kThreads / 4 rows is a multiple of 8, row % 8 (hence the swizzle)
// is the same for every j: each address is one base plus a constant.
template <int kRows, int kThreads>
__device__ __forceinline__ void dequantize_packed_k_tile(const uint8_t* codes, uint8_t* half_tile, int tid) {
  static_assert(kThreads % 32 == 0, "a thread's rows keep their residue modulo 8");
  const uint8_t* const scales = codes + kRows * kCodeBytes;
  const uint32_t first_chunk = half_tile_offset(tid >> 2, 2 * (tid & 3));
#pragma unroll
  for (int j = 0; j < (kRows * 4 + kThreads - 1) / kThreads; ++j) {
    const int i = tid + j * kThreads;
    if ((kRows * 4) % kThreads != 0 && i >= kRows * 4) break;
    uint4 first, second;
    dequantize_block(*reinterpret_cast<const uint2*>(codes + 8 * i), scales[i], first, second);
    const uint32_t offset = first_chunk + j * (kThreads / 4) * kHalfRowBytes;
    *reinterpret_cast<uint4*>(half_tile + offset) = first;
    *reinterpret_cast<uint4*>(half_tile + (offset ^ 16)) = second;  // chunk 2 * block + 1
  }
}

template <class OutT>
__device__ __forceinline__ float load_output(const void* base, int64_t index) {
  return static_cast<float>(static_cast<const OutT*>(base)[index]);
}

template <class OutT>
__device__ __forceinline__ void store_output(void* base, int64_t index, float value) {
  if constexpr (std::is_same_v<OutT, float>) {
    static_cast<float*>(base)[index] = value;
  } else {
    static_cast<OutT*>(base)[index] = __float2bfloat16_rn(value);
  }
}

// The epilogue of one output element, in the order of the wgmma family's visitor tree
// (bilateral_epilogue.hpp); `acc` is the plain NVFP4 dot product.
template <class OutT>
__device__ __forceinline__ float epilogue_value(const Params& p, int64_t row, int64_t col, float acc) {
  const float row_amax = p.row_amax[p.row_is_vector ? row : 0];
  const float col_amax = p.col_amax[p.col_is_vector ? col : 0];
  float v = __fmul_rn(p.alpha, __fmul_rn(row_amax, __fmul_rn(col_amax, acc)));
  if (p.bias != nullptr) v = __fadd_rn(v, p.bias[col]);
  return p.beta != 0.0f ? __fmaf_rn(p.beta, load_output<OutT>(p.c, row * p.ldc + col), v) : v;
}

template <class OutT>
__device__ __forceinline__ void store_epilogue(const Params& p, int64_t row, int64_t col, float acc) {
  store_output<OutT>(p.d, row * p.ldd + col, epilogue_value<OutT>(p, row, col, acc));
}

template <int BM, int BN, class OutT>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const Params p) {
  using T = Tile<BM, BN>;
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kStages = T::kStages;
  uint8_t* const stages = smem;                          // kStages x [codes kRows x 32 | scales kRows x 4]
  uint8_t* const halves = smem + kStages * T::kStageBytes;  // 2 x [kRows x 128] fp16, A's rows first

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM, n0 = static_cast<int64_t>(blockIdx.x) * BN;
  // this CTA's share of the k-tiles: split blockIdx.z of split_k, as even as possible
  const int all_k_tiles = static_cast<int>(p.k / kTileK);
  const int k_first = static_cast<int>(static_cast<int64_t>(all_k_tiles) * blockIdx.z / p.split_k);
  const int k_tiles = static_cast<int>(static_cast<int64_t>(all_k_tiles) * (blockIdx.z + 1) / p.split_k) - k_first;

  PackedTileLoader<BM, T::kRows, kThreads> loader(p, m0, n0, k_first, tid);
  // k-tiles are staged in order, each once
  auto stage_k_tile = [&](int slot) { loader.load_next(stages + slot * T::kStageBytes, tid); };
  auto dequantize_k_tile = [&](int slot, uint8_t* half_tile) {
    dequantize_packed_k_tile<T::kRows, kThreads>(stages + slot * T::kStageBytes, half_tile, tid);
  };

  const int warp_m = warp / T::kWarpsN, warp_n = warp % T::kWarpsN;
  float acc[T::kMmaM][T::kMmaN][4] = {};

  auto multiply_k_tile = [&](const uint8_t* half_tile) {
    const uint8_t* const a_tile = half_tile;
    const uint8_t* const b_tile = half_tile + BM * kHalfRowBytes;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t a[T::kMmaM][4], b[T::kMmaN][2];
#pragma unroll
      for (int mt = 0; mt < T::kMmaM; ++mt) {  // x4: rows 0-15 at k 0-7, then at k 8-15
        const int row = warp_m * T::kWarpM + mt * 16 + (lane & 15);
        ldmatrix_x4(a[mt], a_tile + half_tile_offset(row, 2 * kk + (lane >> 4)));
      }
#pragma unroll
      for (int np = 0; np < T::kMmaN / 2; ++np) {  // x4: two n8 tiles, each at k 0-7 and k 8-15
        const int row = warp_n * T::kWarpN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t r[4];
        ldmatrix_x4(r, b_tile + half_tile_offset(row, 2 * kk + ((lane >> 3) & 1)));
        b[2 * np][0] = r[0], b[2 * np][1] = r[1], b[2 * np + 1][0] = r[2], b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < T::kMmaM; ++mt)
#pragma unroll
        for (int nt = 0; nt < T::kMmaN; ++nt) mma_f16_16816(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  };

  // Software pipeline with one barrier per k-tile: iteration kt dequantizes k-tile kt+1 into one fp16
  // buffer while the MMAs read k-tile kt from the other, so one warp's ALU work overlaps another's MMAs.
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < k_tiles) stage_k_tile(s);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();  // k-tile 0 staged
  __syncthreads();
  dequantize_k_tile(0, halves);
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // k-tile kt+1 staged
    // Every thread has staged k-tile kt+1 and written the fp16 tile of kt, and is done with k-tile kt's
    // stage (refilled now) and with the fp16 tile of kt-1 (overwritten by kt+1 now).
    __syncthreads();
    if (kt + kStages < k_tiles) stage_k_tile(kt % kStages);
    cp_async_commit();
    if (kt + 1 < k_tiles) dequantize_k_tile((kt + 1) % kStages, halves + ((kt + 1) & 1) * T::kHalfBytes);
    multiply_k_tile(halves + (kt & 1) * T::kHalfBytes);
  }

  // The accumulator fragment of an m16n8 tile: rows lane/4 and lane/4 + 8, columns 2 * (lane % 4) and
  // the next.
  const int group = lane >> 2, pair = (lane & 3) * 2;
  float* const partials = p.partials + static_cast<int64_t>(blockIdx.z) * p.m * p.n;
#pragma unroll
  for (int mt = 0; mt < T::kMmaM; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + warp_m * T::kWarpM + mt * 16 + group + half * 8;
      if (row >= p.m) continue;
#pragma unroll
      for (int nt = 0; nt < T::kMmaN; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = n0 + warp_n * T::kWarpN + nt * 8 + pair + e;
          if (col >= p.n) continue;
          const float acc_value = acc[mt][nt][half * 2 + e] * kAccumulatorUnscale;  // exact: a power of two
          if (p.split_k == 1) {
            store_epilogue<OutT>(p, row, col, acc_value);
          } else {
            partials[row * p.n + col] = acc_value;
          }
        }
      }
    }
  }
}

// The first steps of a GEMM kernel launched by launch_programmatic_dependent: wait until the kernels before it
// have finished and their writes are visible, then release the launch of the kernel after it (the split-K
// reduction, or the next operation's kernel; every fp4gen kernel launched as a programmatic dependent waits
// likewise before it touches what the kernel before it writes), so that launch overlaps this kernel's work.
__device__ __forceinline__ void wait_for_prerequisites_release_dependents() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
}

// Split K: the partial sums of each output element, added in split order, then the epilogue.
// Launched as the GEMM's programmatic dependent: it waits for the GEMM's partial sums first.
template <class OutT>
__global__ void __launch_bounds__(256) split_k_epilogue_kernel(const Params p) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t elements = p.m * p.n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = p.partials[i];
    for (int s = 1; s < p.split_k; ++s) sum += p.partials[s * elements + i];
    store_epilogue<OutT>(p, i / p.n, i % p.n, sum);
  }
}

}  // namespace fused_gemm

// The C ABI of the family (codegen/families.py): every entry point takes the same parameters.
#define FP4GEN_FUSED_GEMM_PARAMS                                                                               \
  const uint8_t *a_codes, const uint8_t *a_scale, const uint8_t *b_codes, const uint8_t *b_scale, const void *c, \
      void *d, const float *row_amax, const float *col_amax, const float *bias, float alpha, float beta,        \
      int64_t m, int64_t n, int64_t k, int64_t lda, int64_t lda_scale, int64_t ldb, int64_t ldb_scale,          \
      int64_t split_k, int64_t ldc, int64_t ldd, int64_t row_is_vector, int64_t col_is_vector, void *workspace

inline size_t fused_gemm_workspace_size(FP4GEN_FUSED_GEMM_PARAMS) {
  (void)a_codes, (void)a_scale, (void)b_codes, (void)b_scale, (void)c, (void)d, (void)row_amax, (void)col_amax;
  (void)bias, (void)alpha, (void)beta, (void)k, (void)lda, (void)lda_scale, (void)ldb, (void)ldb_scale, (void)ldc, (void)ldd;
  (void)row_is_vector, (void)col_is_vector, (void)workspace;
  return split_k > 1 && m > 0 && n > 0 ? static_cast<size_t>(split_k * m * n) * sizeof(float) : 0;
}

template <int BM, int BN>
int fused_gemm_can_implement(FP4GEN_FUSED_GEMM_PARAMS) {
  (void)alpha, (void)bias, (void)row_is_vector, (void)col_is_vector, (void)ldc, (void)ldd;
  if (m < 0 || n < 0 || k <= 0 || k % fused_gemm::kTileK != 0 || k / fused_gemm::kTileK > INT32_MAX)
    return kInvalidProblem;
  if ((m + BM - 1) / BM > 65535 || (n + BN - 1) / BN > INT32_MAX) return kInvalidProblem;  // grid limits
  // every split takes at least one k-tile (gridDim.z is at most 65535)
  if (split_k < 1 || split_k > k / fused_gemm::kTileK || split_k > 65535) return kInvalidProblem;
  if (row_amax == nullptr || col_amax == nullptr || d == nullptr || (beta != 0.0f && c == nullptr))
    return kInvalidProblem;
  if (split_k > 1 && m > 0 && n > 0 && workspace == nullptr) return kInvalidProblem;
  // cp.async moves 16-byte chunks of codes and 4-byte words of scales
  if (!aligned(a_codes, 16) || !aligned(b_codes, 16) || lda % 16 != 0 || ldb % 16 != 0) return kMisaligned;
  if (!aligned(a_scale, 4) || !aligned(b_scale, 4) || lda_scale % 4 != 0 || ldb_scale % 4 != 0) return kMisaligned;
  return kOk;
}

// The parameters above, as arguments.
#define FP4GEN_FUSED_GEMM_ARGS                                                                                \
  a_codes, a_scale, b_codes, b_scale, c, d, row_amax, col_amax, bias, alpha, beta, m, n, k, lda, lda_scale, ldb, \
      ldb_scale, split_k, ldc, ldd, row_is_vector, col_is_vector, workspace

namespace fused_gemm {

// The kernels' parameters; the partial sums of split K at the start of the workspace.
inline Params make_params(FP4GEN_FUSED_GEMM_PARAMS) {
  return Params{a_codes, a_scale, b_codes, b_scale, c, d, row_amax, col_amax, bias, alpha, beta,
                m, n, k, lda, lda_scale, ldb, ldb_scale, ldc, ldd,
                row_is_vector != 0, col_is_vector != 0, static_cast<int>(split_k), static_cast<float*>(workspace)};
}

template <class OutT>
void launch_split_k_epilogue(const Params& params, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((params.m * params.n + 255) / 256, 4096);  // grid-stride beyond
  launch_programmatic_dependent(split_k_epilogue_kernel<OutT>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0,
                                stream, params);
}

}  // namespace fused_gemm

// opt_in_shared_bytes on the current device, as a status: kOk, or the CUDA error. Kernels above 48 KB of
// dynamic shared memory must opt in before their launch (a per-function attribute, not a stream operation).
template <auto kKernel>
int opt_in_shared_bytes_here(size_t bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = opt_in_shared_bytes<kKernel>(device, bytes);
  return err == cudaSuccess ? kOk : kCudaErrorBase + static_cast<int>(err);
}

// Checks the problem and launches kKernel, a GEMM over the packed operands with BM x BN tiles, kThreads
// threads and kSmemBytes of dynamic shared memory (and, with split K, the kernel that adds the partial sums).
template <int BM, int BN, class OutT, auto kKernel, int kThreads, int kSmemBytes>
int launch_packed_gemm(FP4GEN_FUSED_GEMM_PARAMS, cudaStream_t stream) {
  const int status = fused_gemm_can_implement<BM, BN>(FP4GEN_FUSED_GEMM_ARGS);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  if (const int opted = opt_in_shared_bytes_here<kKernel>(kSmemBytes); opted != kOk) return opted;
  const fused_gemm::Params params = fused_gemm::make_params(FP4GEN_FUSED_GEMM_ARGS);
  const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN), static_cast<unsigned>((m + BM - 1) / BM),
                  static_cast<unsigned>(split_k));
  kKernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  if (split_k > 1) fused_gemm::launch_split_k_epilogue<OutT>(params, stream);
  return launch_status();
}

template <int BM, int BN, class OutT>
int fused_gemm_run(FP4GEN_FUSED_GEMM_PARAMS, cudaStream_t stream) {
  return launch_packed_gemm<BM, BN, OutT, fused_gemm::gemm_kernel<BM, BN, OutT>, fused_gemm::kThreads,
                            fused_gemm::Tile<BM, BN>::kSmemBytes>(FP4GEN_FUSED_GEMM_ARGS, stream);
}

}  // namespace fp4gen
