// The quantize pass with the training-quality options (docs/numerics.md): stochastic rounding (kStochastic),
// the random Hadamard transform of the columnwise copy (kHadamard) and 4over6 (kFourOverSix; MAE or MSE at
// run time), given the amaxes of the amax pass (amax.cuh, or amax_hadamard.cuh whose columnwise amaxes are
// those of the transformed copy). What the plain quantize kernels (quantize.cuh) vary at compile time is a
// run-time argument here: which copies (a null output is not written), per-row/per-column or per-tensor
// amaxes (vector_amax) and 1x16 or 16x16 blocks (block_2d).
//
// A CTA takes a 64 x 64 tile of x, widened to fp32 in shared memory. Then thread t encodes the rowwise
// block t % 4 of tile row t / 4 and the columnwise block t / 64 (16 rows) of tile column t % 64: a block is
// one thread's, so the 4over6 errors are summed in the defined order with no exchange between threads.
// (Persistent CTAs that copy the next tile into a second shared-memory buffer with cp.async while encoding one
// measured slower on the H200: 8192 x 8192 bf16, SR 283 -> 303 us, 4over6 528 -> 588 us, bench/RESULTS.md,
// 2026-12-01.)
// With 16x16 blocks the tile's sixteen 16x16 tiles are decided first (their amaxes, and with 4over6 their
// 16 row errors added as a tree), and the columnwise codes are the rowwise codes transposed through shared
// memory (so stochastic rounding's bits are the rowwise copy's, as the definition says).
#pragma once

#include <algorithm>

#include "fp4gen/abi.h"
#include "fp4gen/elements.cuh"
#include "fp4gen/four_over_six.cuh"
#include "fp4gen/hadamard.cuh"
#include "fp4gen/nvfp4.cuh"
#include "fp4gen/stochastic.cuh"

namespace fp4gen {

constexpr int kOptTile = 64, kOptThreads = 256;

// 16 round-to-nearest codes of fl(v[k] * r), element k in nibble k.
template <bool kHardwareCvt>
__device__ __forceinline__ uint64_t encode16_nearest(const float (&v)[16], float r) {
  const uint32_t lo = encode_codes<kHardwareCvt, 8>(v, r), hi = encode_codes<kHardwareCvt, 8>(v + 8, r);
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}

// 16 stochastically rounded codes of fl(v[k] * r) with the block's random words.
__device__ __forceinline__ uint64_t encode16_stochastic(const float (&v)[16], float r, uint4 bits) {
  const uint32_t lo = encode_codes_stochastic(*reinterpret_cast<const float(*)[8]>(v), r, make_uint2(bits.x, bits.y));
  const uint32_t hi = encode_codes_stochastic(*reinterpret_cast<const float(*)[8]>(v + 8), r, make_uint2(bits.z, bits.w));
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}

// NaN-ignoring block amax (as upstream's kernels): fmaxf drops a NaN operand.
__device__ __forceinline__ float block_amax16(const float (&v)[16]) {
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < 16; ++k) m = fmaxf(m, fabsf(v[k]));
  return m;
}

// Adds 16 values as a tree into v[0]: v[i] + v[i + 8], then + 4, + 2, + 1 (the order the 16x16 tile error takes).
__device__ __forceinline__ void tree_sum16(float (&v)[16]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(v[i], v[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __fadd_rn(v[i], v[i + 4]);
#pragma unroll
  for (int i = 0; i < 2; ++i) v[i] = __fadd_rn(v[i], v[i + 2]);
  v[0] = __fadd_rn(v[0], v[1]);
}

struct EncodedBlock {
  uint64_t codes;  // element k in nibble k
  uint32_t scale_byte;
};

// One 1x16 block of values v under second-level amax `amax`: standard scale with round-to-nearest or
// stochastic rounding (block `block` of a copy drawn at `offset`), or 4over6 (`magnitudes`: the thread's column of
// the CTA's table for four_over_six_row_error).
template <bool kStochastic, bool kFourOverSix, bool kHardwareCvt>
__device__ __forceinline__ EncodedBlock encode_block16(const float (&v)[16], float amax, bool mse, uint64_t seed,
                                                       uint64_t offset, uint64_t block, float* magnitudes) {
  const float bamax = block_amax16(v);
  if constexpr (kFourOverSix) {
    ScaleCandidate map4, map6;
    four_over_six_candidates(bamax, amax, map4, map6);
    const uint64_t q4 = encode16_nearest<kHardwareCvt>(v, map4.inverse);
    const uint64_t q6 = encode16_nearest<kHardwareCvt>(v, map6.inverse);
    const bool pick4 = four_over_six_row_error<kOptThreads>(v, q4, map4.scale, amax, mse, magnitudes) <
                       four_over_six_row_error<kOptThreads>(v, q6, map6.scale, amax, mse, magnitudes);
    return pick4 ? EncodedBlock{q4, map4.scale_byte} : EncodedBlock{q6, map6.scale_byte};
  } else {
    const BlockEncoding enc = encode_block_scale<false>(bamax, global_scale(amax));
    const uint64_t codes = kStochastic ? encode16_stochastic(v, enc.inverse, block_random_bits(seed, offset, block))
                                       : encode16_nearest<kHardwareCvt>(v, enc.inverse);
    return {codes, enc.scale_byte & 0xFFu};
  }
}

__device__ __forceinline__ void store_codes16(uint8_t* dst, uint64_t codes) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(static_cast<uint32_t>(codes), static_cast<uint32_t>(codes >> 32));
}

// One 64 x 64 tile's shared memory: the tile widened to fp32 and, for 16x16 blocks, each 16x16 tile's decision
// and the rowwise codes (one per byte) for the columnwise copy.
struct OptionsTile {
  float tile[kOptTile][kOptTile + 1];
  float row_block_amax[kOptTile][4];
  float row_errors[2][kOptTile][4];  // 4over6: map-to-4 and map-to-6 error of each block row
  uint8_t tile_codes[kOptTile][kOptTile];
  uint8_t tile_scale[kOptTile / 16][4];
};

// Where a dense x [rows, cols]'s tile at (row0, col0) goes. A layout answers, for the tile's rowwise block jb
// of tile row r and its columnwise block g (16 rows) of tile column c: the block's index in its copy's scale
// storage (-1: not written), which is also its codes' position (8 bytes a block) and its stochastic-rounding
// block number; and the amax it is encoded under.
struct DenseTileLayout {
  int64_t rows, cols, row0, col0;
  const float* row_amax_in;
  const float* col_amax_in;
  uint8_t *row_data, *row_scale, *col_data, *col_scale;
  bool vector_amax;

  __device__ __forceinline__ int64_t row_block(int r, int jb) const {
    const int64_t row = row0 + r, block_col = col0 + 16 * jb;
    return row < rows && block_col < cols ? row * (cols / 16) + block_col / 16 : -1;
  }
  __device__ __forceinline__ float row_amax(int r) const { return vector_amax ? row_amax_in[row0 + r] : row_amax_in[0]; }
  __device__ __forceinline__ int64_t col_block(int c, int g) const {
    const int64_t col = col0 + c, block_row = row0 + 16 * g;  // rows % 16 == 0 with a columnwise copy
    return col < cols && block_row < rows ? col * (rows / 16) + block_row / 16 : -1;
  }
  __device__ __forceinline__ float col_amax(int c, int) const { return vector_amax ? col_amax_in[col0 + c] : col_amax_in[0]; }
};

// Encodes a staged tile (s.tile; callers synchronize after staging) into the copies `layout` names. Thread t
// encodes the rowwise block t % 4 of tile row t / 4 and the columnwise block t / 64 of tile column t % 64. With
// block_2d, a 16x16 tile's amax is the row_amax of its rows; rows the layout does not write must read as zeros.
// InT is the type the tile was staged from (stage_tile_fp32).
template <class InT, bool kStochastic, bool kHadamard, bool kFourOverSix, bool kHardwareCvt, class Layout>
__device__ __forceinline__ void encode_options_tile(OptionsTile& s, const Layout& layout, uint64_t seed,
                                                    uint64_t offset, bool block_2d, bool mse) {
  [[maybe_unused]] float* magnitudes = nullptr;  // 4over6: the thread's column of the table of error values
  if constexpr (kFourOverSix) {
    __shared__ float magnitude_table[8][kOptThreads];
    magnitudes = &magnitude_table[0][threadIdx.x];
  }
  // rowwise: block jb of tile row r (with 16x16 blocks: a row of 16x16 tile jb)
  const int r = threadIdx.x / 4, jb = threadIdx.x % 4;
  const int64_t row_block = layout.row_block(r, jb);
  float v[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = s.tile[r][16 * jb + k];
  if (block_2d) {  // uniform across the CTA: the barriers below are reached by every thread
    const float amax = layout.row_amax(r);
    s.row_block_amax[r][jb] = block_amax16(v);
    __syncthreads();
    float tile_amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) tile_amax = fmaxf(tile_amax, s.row_block_amax[r / 16 * 16 + i][jb]);
    uint64_t codes;
    uint32_t scale_byte;
    if constexpr (kFourOverSix) {
      ScaleCandidate map4, map6;
      four_over_six_candidates(tile_amax, amax, map4, map6);
      const uint64_t q4 = encode16_nearest<kHardwareCvt>(v, map4.inverse);
      const uint64_t q6 = encode16_nearest<kHardwareCvt>(v, map6.inverse);
      s.row_errors[0][r][jb] = four_over_six_row_error<kOptThreads>(v, q4, map4.scale, amax, mse, magnitudes);
      s.row_errors[1][r][jb] = four_over_six_row_error<kOptThreads>(v, q6, map6.scale, amax, mse, magnitudes);
      __syncthreads();
      float e4[16], e6[16];  // the tile's 16 row errors, added as a tree (tree_sum16)
#pragma unroll
      for (int i = 0; i < 16; ++i) e4[i] = s.row_errors[0][r / 16 * 16 + i][jb], e6[i] = s.row_errors[1][r / 16 * 16 + i][jb];
      tree_sum16(e4);  // (levels spelled out: a loop halving its bound was left rolled, e4 and e6 in local memory)
      tree_sum16(e6);
      const bool pick4 = e4[0] < e6[0];
      codes = pick4 ? q4 : q6;
      scale_byte = pick4 ? map4.scale_byte : map6.scale_byte;
    } else {
      const BlockEncoding enc = encode_block_scale<false>(tile_amax, global_scale(amax));
      codes = kStochastic ? encode16_stochastic(v, enc.inverse, block_random_bits(seed, offset, row_block))
                          : encode16_nearest<kHardwareCvt>(v, enc.inverse);
      scale_byte = enc.scale_byte & 0xFFu;
    }
    if (layout.row_data != nullptr && row_block >= 0) {
      store_codes16(layout.row_data + 8 * row_block, codes);
      layout.row_scale[row_block] = static_cast<uint8_t>(scale_byte);
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) s.tile_codes[r][16 * jb + k] = static_cast<uint8_t>((codes >> (4 * k)) & 0xFu);
    if (r % 16 == 0) s.tile_scale[r / 16][jb] = static_cast<uint8_t>(scale_byte);  // for the columnwise copy
    __syncthreads();
  } else if (layout.row_data != nullptr && row_block >= 0) {
    const EncodedBlock enc =
        encode_block16<kStochastic, kFourOverSix, kHardwareCvt>(v, layout.row_amax(r), mse, seed, offset, row_block,
                                                                magnitudes);
    store_codes16(layout.row_data + 8 * row_block, enc.codes);
    layout.row_scale[row_block] = static_cast<uint8_t>(enc.scale_byte);
  }

  // columnwise: block g (tile rows 16g .. 16g + 15) of tile column c
  if (layout.col_data == nullptr) return;
  const int c = threadIdx.x % kOptTile, g = threadIdx.x / kOptTile;
  const int64_t col_block = layout.col_block(c, g);
  if (col_block < 0) return;
  uint8_t* data_dst = layout.col_data + 8 * col_block;
  uint8_t* scale_dst = layout.col_scale + col_block;
  if (block_2d) {
    uint64_t codes = 0;
#pragma unroll
    for (int k = 0; k < 16; ++k) codes |= static_cast<uint64_t>(s.tile_codes[16 * g + k][c]) << (4 * k);
    store_codes16(data_dst, codes);
    *scale_dst = s.tile_scale[g][c / 16];
    return;
  }
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = s.tile[16 * g + k][c];
  if constexpr (kHadamard) hadamard16_to_bf16<InT>(v);
  // the columnwise copy draws at offset + 1, so the two copies of one call never share bits
  const EncodedBlock enc = encode_block16<kStochastic, kFourOverSix, kHardwareCvt>(v, layout.col_amax(c, g), mse, seed,
                                                                                  offset + 1, col_block, magnitudes);
  store_codes16(data_dst, enc.codes);
  *scale_dst = static_cast<uint8_t>(enc.scale_byte);
}

template <class InT, bool kStochastic, bool kHadamard, bool kFourOverSix, bool kHardwareCvt>
__global__ void __launch_bounds__(kOptThreads)
    quantize_options_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                            const float* __restrict__ row_amax, const float* __restrict__ col_amax,
                            uint8_t* __restrict__ row_data, uint8_t* __restrict__ row_scale,
                            uint8_t* __restrict__ col_data, uint8_t* __restrict__ col_scale,
                            const int64_t* __restrict__ rng_state, bool vector_amax, bool block_2d, bool mse) {
  __shared__ OptionsTile s;
  const int64_t row0 = int64_t{blockIdx.x} * kOptTile, col0 = int64_t{blockIdx.y} * kOptTile;
  stage_tile_fp32<InT, kOptTile, kOptThreads>(x, x_row_stride, rows, cols, row0, col0, s.tile);
  __syncthreads();
  uint64_t seed = 0, offset = 0;
  if constexpr (kStochastic) seed = static_cast<uint64_t>(rng_state[0]), offset = static_cast<uint64_t>(rng_state[1]);
  const DenseTileLayout layout{rows, cols, row0, col0, row_amax, col_amax, row_data, row_scale, col_data, col_scale,
                               vector_amax};
  encode_options_tile<InT, kStochastic, kHadamard, kFourOverSix, kHardwareCvt>(s, layout, seed, offset, block_2d, mse);
}

template <class InT, bool kStochastic, bool kHadamard, bool kFourOverSix>
int quantize_options_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols,
                                   const float* row_amax, const float* col_amax, uint8_t* row_data,
                                   uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale, const int64_t* rng_state,
                                   int64_t vector_amax, int64_t block_2d, int64_t error_mse) {
  const bool rowwise = row_data != nullptr, colwise = col_data != nullptr;
  if (rows < 0 || cols < 0 || cols % 16 != 0 || !(rowwise || colwise)) return kInvalidProblem;
  if ((vector_amax != 0 && vector_amax != 1) || (block_2d != 0 && block_2d != 1) || (error_mse != 0 && error_mse != 1))
    return kInvalidProblem;
  if ((colwise || block_2d) && rows % 16 != 0) return kInvalidProblem;
  if (block_2d && (vector_amax || kHadamard)) return kInvalidProblem;  // 16x16 tiles: per tensor, no transform
  if (kHadamard && !colwise) return kInvalidProblem;  // the transform is of the columnwise copy
  if (kStochastic && rng_state == nullptr) return kInvalidProblem;
  if (rowwise && (row_amax == nullptr || row_scale == nullptr)) return kInvalidProblem;
  if (colwise && (col_amax == nullptr || col_scale == nullptr)) return kInvalidProblem;
  if ((cols + kOptTile - 1) / kOptTile > 65535) return kInvalidProblem;  // gridDim.y
  if ((rows + kOptTile - 1) / kOptTile > 0x7FFFFFFF) return kInvalidProblem;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  if ((rowwise && !aligned(row_data, 8)) || (colwise && !aligned(col_data, 8))) return kMisaligned;
  return kOk;
}

template <class InT, bool kStochastic, bool kHadamard, bool kFourOverSix, bool kHardwareCvt>
int quantize_options_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                         const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data,
                         uint8_t* col_scale, const int64_t* rng_state, int64_t vector_amax, int64_t block_2d,
                         int64_t error_mse, cudaStream_t stream) {
  const int status = quantize_options_can_implement<InT, kStochastic, kHadamard, kFourOverSix>(
      x, x_row_stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data, col_scale, rng_state,
      vector_amax, block_2d, error_mse);
  if (status != kOk) return status;
  if (rows == 0 || cols == 0) return kOk;
  const dim3 grid(static_cast<unsigned>((rows + kOptTile - 1) / kOptTile), static_cast<unsigned>((cols + kOptTile - 1) / kOptTile));
  quantize_options_kernel<InT, kStochastic, kHadamard, kFourOverSix, kHardwareCvt><<<grid, kOptThreads, 0, stream>>>(
      static_cast<const InT*>(x), x_row_stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data,
      col_scale, rng_state, vector_amax != 0, block_2d != 0, error_mse != 0);
  return launch_status();
}

}  // namespace fp4gen
