// The quantize pass: x [M, K] -> rowwise NVFP4 (codes [M, K/2], scales [M, K/16]) and/or columnwise NVFP4
// of x.T (codes [K, M/2], scales [K, M/16]), given the amaxes of the amax pass (spec sections 2-4, 6.2).
//
// A CTA encodes 64x64 tiles: each is read once into shared memory (coalesced 16-byte cp.async copies,
// the next tile's in flight while the current one is encoded) and both directions come from there. Rowwise, four consecutive lanes cover one row's 64 elements, so
// their 8-byte code stores form one 32-byte sector. Columnwise, lanes take consecutive columns (no shared
// memory bank conflicts); their codes are staged in shared memory and stored by lanes regrouped per
// column, again 32 contiguous bytes per four lanes. 16x16 blocks (weights) share one scale per tile, so
// their columnwise codes are the transpose of the rowwise ones.
#pragma once

#include <algorithm>

#include "fp4gen/abi.h"
#include "fp4gen/async_copy.cuh"
#include "fp4gen/elements.cuh"
#include "fp4gen/nvfp4.cuh"

namespace fp4gen {

constexpr int kQuantTile = 64, kQuantThreads = 256, kBlocksPerTileRow = kQuantTile / 16;

// Persistent CTAs walk the 64x64 tiles (row-major tile order) with two shared-memory buffers: the next
// tile's cp.async copy is in flight while the current one is encoded.
template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHardwareCvt>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                    const float* __restrict__ row_amax, const float* __restrict__ col_amax,
                    uint8_t* __restrict__ row_data, uint8_t* __restrict__ row_scale, uint8_t* __restrict__ col_data,
                    uint8_t* __restrict__ col_scale) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector, kVecsPerRow = kQuantTile / kVec;
  __shared__ __align__(16) InT tile[2][kQuantTile][kQuantTile];
  __shared__ uint2 col_stage[kColwise ? kQuantTile : 1][kBlocksPerTileRow];
  __shared__ float row_block_max[k2D ? kQuantTile : 1][kBlocksPerTileRow];
  __shared__ GlobalScale row_global[kRowwise ? kQuantTile : 1], col_global[kColwise ? kQuantTile : 1];
  const int t = threadIdx.x;
  const int64_t tiles_k = (cols + kQuantTile - 1) / kQuantTile;
  const int64_t n_tiles = ((rows + kQuantTile - 1) / kQuantTile) * tiles_k;

  // M and K are multiples of 16, so a 16-element block is wholly inside or outside; outside is zero-filled
  auto prefetch = [&](int64_t tile_id, int buf) {
    const int64_t m0 = (tile_id / tiles_k) * kQuantTile, k0 = (tile_id % tiles_k) * kQuantTile;
    static_assert(kQuantTile * kVecsPerRow % kQuantThreads == 0, "every thread copies the same number of vectors");
#pragma unroll
    for (int i = 0; i < kQuantTile * kVecsPerRow / kQuantThreads; ++i) {  // a trip count nvcc can unroll
      const int v = t + i * kQuantThreads, r = v / kVecsPerRow, c = (v % kVecsPerRow) * kVec;
      const bool inside = m0 + r < rows && k0 + c < cols;
      cp_async_16(&tile[buf][r][c], inside ? x + (m0 + r) * x_row_stride + k0 + c : x, inside);
    }
  };

  // Thread roles: rowwise block (row t/4, block t%4); columnwise block (column t%64, block t/64); the
  // columnwise store regroups lanes per column (column t/4, block t%4).
  const int rw_row = t / kBlocksPerTileRow, rw_blk = t % kBlocksPerTileRow;
  const int cw_col = t % kQuantTile, cw_blk = t / kQuantTile;
  const int st_col = t / kBlocksPerTileRow, st_blk = t % kBlocksPerTileRow;

  int buf = 0;
  if (blockIdx.x < n_tiles) prefetch(blockIdx.x, 0);
  cp_async_commit();
  for (int64_t tile_id = blockIdx.x; tile_id < n_tiles; tile_id += gridDim.x, buf ^= 1) {
    if (tile_id + gridDim.x < n_tiles) prefetch(tile_id + gridDim.x, buf ^ 1);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning "the current tile"
    const int64_t m0 = (tile_id / tiles_k) * kQuantTile, k0 = (tile_id % tiles_k) * kQuantTile;
    // the global scales of the tile's rows and columns, once each, while the copies land
    if (kRowwise && t < kQuantTile) {
      row_global[t] = global_scale(row_amax[kRowScaled ? (m0 + t < rows ? m0 + t : 0) : 0]);
    } else if (kColwise && t >= kQuantTile && t < 2 * kQuantTile) {
      const int c = t - kQuantTile;
      col_global[c] = global_scale(col_amax[kRowScaled ? (k0 + c < cols ? k0 + c : 0) : 0]);
    }
    cp_async_wait<1>();
    __syncthreads();

    const bool rw_ok = m0 + rw_row < rows && k0 + rw_blk * 16 < cols;
    const bool cw_ok = k0 + cw_col < cols && m0 + cw_blk * 16 < rows;
    uint32_t rw_words[16 * sizeof(InT) / 4];  // a row block is 16 contiguous elements: read it as 16-byte vectors
#pragma unroll
    for (int v = 0; v < 16 / kVec; ++v)
      *reinterpret_cast<uint4*>(&rw_words[4 * v]) =
          *reinterpret_cast<const uint4*>(&tile[buf][rw_row][rw_blk * 16 + v * kVec]);
    float rw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) rw[i] = E::to_float(reinterpret_cast<const InT*>(rw_words)[i]);
    const float rw_amax = block_abs_max_words<InT>(rw_words);
    if constexpr (k2D) {  // 16x16 tile amax: max over the 16 row-block maxima of the tile
      row_block_max[rw_row][rw_blk] = rw_amax;
      __syncthreads();
    }
    auto tile_16x16_max = [&](int tile_row, int tile_col) {
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j) m = fmaxf(m, row_block_max[tile_row * 16 + j][tile_col]);
      return m;
    };

    if constexpr (kRowwise) {
      if (rw_ok) {
        const int64_t grow = m0 + rw_row, gcol = k0 + rw_blk * 16;
        const float bamax = k2D ? tile_16x16_max(rw_row / 16, rw_blk) : rw_amax;
        const BlockEncoding enc = encode_block_scale(bamax, row_global[rw_row]);
        *reinterpret_cast<uint2*>(row_data + grow * (cols / 2) + gcol / 2) =
            encode_block_codes<kHardwareCvt>(rw, enc.inverse);
        row_scale[grow * (cols / 16) + gcol / 16] = static_cast<uint8_t>(enc.scale_byte);
      }
    }
    if constexpr (kColwise) {
      float cw[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) cw[i] = E::to_float(tile[buf][cw_blk * 16 + i][cw_col]);
      if (cw_ok) {
        const int64_t gcol = k0 + cw_col, grow = m0 + cw_blk * 16;
        const float bamax = k2D ? tile_16x16_max(cw_blk, cw_col / 16) : block_abs_max(cw);
        const BlockEncoding enc = encode_block_scale(bamax, col_global[cw_col]);
        col_stage[cw_col][cw_blk] = encode_block_codes<kHardwareCvt>(cw, enc.inverse);
        col_scale[gcol * (rows / 16) + grow / 16] = static_cast<uint8_t>(enc.scale_byte);
      }
    }
    // every read of tile[buf], the global scales and the 16x16 maxima is done before this barrier,
    // so the next iteration may refill them
    __syncthreads();
    if constexpr (kColwise) {  // lanes 4c..4c+3 write column c's four 8-byte blocks: 32 contiguous bytes
      if (k0 + st_col < cols && m0 + st_blk * 16 < rows)
        *reinterpret_cast<uint2*>(col_data + (k0 + st_col) * (rows / 2) + (m0 + st_blk * 16) / 2) =
            col_stage[st_col][st_blk];
    }
  }
  cp_async_wait<0>();
}

template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D>
int quantize_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                           const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data,
                           uint8_t* col_scale) {
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if ((kColwise || k2D) && rows % 16 != 0) return kInvalidProblem;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if (kRowwise && (row_amax == nullptr || row_data == nullptr || row_scale == nullptr)) return kInvalidProblem;
  if (kColwise && (col_amax == nullptr || col_data == nullptr || col_scale == nullptr)) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  if ((kRowwise && !aligned(row_data, 8)) || (kColwise && !aligned(col_data, 8))) return kMisaligned;
  return kOk;
}

template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHardwareCvt>
int quantize_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                 const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale,
                 cudaStream_t stream) {
  const int status = quantize_can_implement<InT, kRowwise, kColwise, kRowScaled, k2D>(
      x, x_row_stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data, col_scale);
  if (status != kOk) return status;
  if (rows == 0 || cols == 0) return kOk;
  auto kernel = quantize_kernel<InT, kRowwise, kColwise, kRowScaled, k2D, kHardwareCvt>;
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kQuantThreads, 0) != cudaSuccess)
    return launch_status();
  const int64_t tiles = ((rows + kQuantTile - 1) / kQuantTile) * ((cols + kQuantTile - 1) / kQuantTile);
  const int64_t grid = std::min<int64_t>(tiles, static_cast<int64_t>(sms) * std::max(per_sm, 1));
  kernel<<<static_cast<unsigned>(grid), kQuantThreads, 0, stream>>>(
      static_cast<const InT*>(x), x_row_stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data,
      col_scale);
  return launch_status();
}

}  // namespace fp4gen
