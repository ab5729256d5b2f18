// The quantize pass: x [M, K] -> rowwise NVFP4 (codes [M, K/2], scales [M, K/16]) and/or columnwise NVFP4
// of x.T (codes [K, M/2], scales [K, M/16]), given the amaxes of the amax pass (spec sections 2-4, 6.2).
//
// A CTA encodes 64x64 tiles: each is read once into shared memory (coalesced 16-byte cp.async copies,
// the next tile's in flight while the current one is encoded) and both directions come from there. Rowwise, four consecutive lanes cover one row's 64 elements, so
// their 8-byte code stores form one 32-byte sector. Columnwise, two lanes share two adjacent columns of a
// 16-row block, each reading half of its rows as 32-bit words, so that one shared-memory load and one
// packed max serve both columns; their codes are staged in shared memory and stored by lanes regrouped
// per column, again 32 contiguous bytes per four lanes. 16x16 blocks (weights) share one scale per tile, so
// their columnwise codes are the transpose of the rowwise ones.
#pragma once

#include <algorithm>

#include "fp4gen/abi.h"
#include "fp4gen/async_copy.cuh"
#include "fp4gen/elements.cuh"
#include "fp4gen/nvfp4.cuh"

namespace fp4gen {

constexpr int kQuantTile = 64, kQuantThreads = 256, kBlocksPerTileRow = kQuantTile / 16;
// Resident CTAs per SM that the register allocation must allow. 16-bit inputs: 6 (40 registers), the
// occupancy the kernel had before the column-pair path, which left alone takes 44-60 registers (4-5
// CTAs); at 40 a few loop invariants are reloaded from the stack (8-24 bytes). 8 (32 registers, 100%
// occupancy) would spill 32-56 bytes. fp32: the padded tiles take 38 KB of shared memory, so 5 CTAs fit.
template <class InT>
constexpr int kQuantMinCtasPerSm = sizeof(InT) == 4 ? 5 : 6;
// Tile coordinates are 32-bit; quantize_can_implement refuses more tiles than this (a 2^42-element tensor).
constexpr int64_t kMaxQuantTiles = int64_t{1} << 30;

// Persistent CTAs, each over a contiguous run of the 64x64 tiles in row-major order, with two shared-memory
// buffers: the next tile's cp.async copy is in flight while the current one is encoded. Consecutive tiles
// of a run mostly share their 64 rows, so the rows' global scales are recomputed only when that changes.
template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHardwareCvt>
__global__ void __launch_bounds__(kQuantThreads, kQuantMinCtasPerSm<InT>)
    quantize_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                    const float* __restrict__ row_amax, const float* __restrict__ col_amax,
                    uint8_t* __restrict__ row_data, uint8_t* __restrict__ row_scale, uint8_t* __restrict__ col_data,
                    uint8_t* __restrict__ col_scale) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector, kVecsPerRow = kQuantTile / kVec;
  constexpr int kCopies = kQuantTile * kVecsPerRow / kQuantThreads, kCopyRowStep = kQuantThreads / kVecsPerRow;
  static_assert(kQuantTile * kVecsPerRow % kQuantThreads == 0, "every thread copies the same number of vectors");
  // Rows padded by 16 bytes: row r + 4 starts 16 banks after row r, so the two halves of a column pair
  // (rows 4 apart) and, rowwise, the 16-byte reads of two consecutive rows fall on disjoint banks.
  constexpr int kTilePitch = kQuantTile + 16 / sizeof(InT);
  __shared__ __align__(16) InT tile[2][kQuantTile][kTilePitch];
  // Columnwise codes and scale bytes, per column and block, until the lanes regrouped per column store
  // them. The codes' block index is XOR-swizzled with bits 2-3 of the column (col_stage_blk): both the
  // writers (16 consecutive columns, one block) and the readers (4 columns x 4 blocks) of a half-warp's
  // 8-byte accesses then cover all 32 banks once.
  __shared__ uint2 col_stage[kColwise ? kQuantTile : 1][kBlocksPerTileRow];
  __shared__ uint8_t col_scale_stage[kColwise ? kQuantTile : 1][kBlocksPerTileRow];
  __shared__ float row_block_max[k2D ? kQuantTile : 1][kBlocksPerTileRow];
  // per row / column of the current tile; with tensor scaling, one entry for the whole call
  __shared__ GlobalScale row_global[kRowwise && kRowScaled ? kQuantTile : 1];
  __shared__ GlobalScale col_global[kColwise && kRowScaled ? kQuantTile : 1];
  const int t = threadIdx.x;
  // (tile row, tile column) advance without a division per tile: a 64-bit division is a called subroutine
  // of ~25 instructions.
  const int tiles_k = static_cast<int>((cols + kQuantTile - 1) / kQuantTile);
  const int n_tiles = static_cast<int>((rows + kQuantTile - 1) / kQuantTile) * tiles_k;
  const int cta = blockIdx.x, ctas = gridDim.x, per_cta = n_tiles / ctas, extra = n_tiles % ctas;
  const int first_tile = cta * per_cta + min(cta, extra), end_tile = first_tile + per_cta + (cta < extra ? 1 : 0);
  auto advance = [&](int& tm, int& tk) {
    if (++tk == tiles_k) tk = 0, ++tm;
  };
  // extents of a tile that lie inside the tensor, at most 64
  auto rows_in = [&](int tm) { return static_cast<int>(std::min<int64_t>(rows - int64_t{tm} * kQuantTile, kQuantTile)); };
  auto cols_in = [&](int tk) { return static_cast<int>(std::min<int64_t>(cols - int64_t{tk} * kQuantTile, kQuantTile)); };

  const int cp_row = t / kVecsPerRow, cp_col = (t % kVecsPerRow) * kVec;
  // this thread's first source element within a tile, and the distance to its next one
  const InT* const cp_src = x + cp_row * x_row_stride + cp_col;
  const int64_t cp_step = kCopyRowStep * x_row_stride;
  // M and K are multiples of 16, so a 16-element block is wholly inside or outside; outside is zero-filled
  auto prefetch = [&](int tm, int tk, int buf) {
    const InT* src = cp_src + int64_t{tm} * (kQuantTile * x_row_stride) + int64_t{tk} * kQuantTile;
    const int rows_left = rows_in(tm);
    const bool col_inside = cp_col < cols_in(tk);
#pragma unroll
    for (int i = 0; i < kCopies; ++i, src += cp_step) {  // a trip count nvcc can unroll
      const int r = cp_row + i * kCopyRowStep;
      const bool inside = col_inside && r < rows_left;
      cp_async_16(&tile[buf][r][cp_col], inside ? src : x, inside);
    }
  };

  // Tensor scaling: the one global scale is computed once, and kept in shared memory rather than in
  // registers live across the tile loop (4 more registers cost a CTA per SM). The loop's first barrier
  // publishes it.
  if constexpr (!kRowScaled) {
    if (kRowwise && t == 0) row_global[0] = global_scale(row_amax[0]);
    if (kColwise && t == 32) col_global[0] = global_scale(col_amax[0]);
  }

  // Thread roles: rowwise block (row t/4, block t%4). Columnwise, lanes l and l^1 of a warp share
  // columns 2p, 2p+1 of block t/64 (p = 16 * (warp % 2) + l / 2): lane half h = l % 2 reads the block's
  // rows 4h..4h+3 and 8+4h..8+4h+3 (with the row padding, the halves' words fall on disjoint banks), and
  // after the exchanges owns column 2p+h. The columnwise store regroups lanes per column (column t/4,
  // block t%4).
  const int rw_row = t / kBlocksPerTileRow, rw_blk = t % kBlocksPerTileRow;
  const int cw_half = t % 2, cw_pair = t / 32 % 2 * 16 + t % 32 / 2, cw_blk = t / kQuantTile;
  const int cw_col = 2 * cw_pair + cw_half;
  const int st_col = t / kBlocksPerTileRow, st_blk = t % kBlocksPerTileRow;
  auto col_stage_blk = [](int col, int blk) { return blk ^ (col / 4 % kBlocksPerTileRow); };
  const int64_t row_data_pitch = cols / 2, row_scale_pitch = cols / 16;
  const int64_t col_data_pitch = rows / 2, col_scale_pitch = rows / 16;

  int buf = 0;
  int tm = first_tile / tiles_k, tk = first_tile % tiles_k, scaled_tm = -1;
  int next_tm = tm, next_tk = tk;
  advance(next_tm, next_tk);
  if (first_tile < end_tile) prefetch(tm, tk, 0);
  cp_async_commit();
  for (int tile_id = first_tile; tile_id < end_tile; ++tile_id, buf ^= 1) {
    if (tile_id + 1 < end_tile) prefetch(next_tm, next_tk, buf ^ 1);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning "the current tile"
    const int64_t m0 = int64_t{tm} * kQuantTile, k0 = int64_t{tk} * kQuantTile;
    const int rows_left = rows_in(tm), cols_left = cols_in(tk);
    // the global scales of the tile's rows and columns, once each, while the copies land
    if constexpr (kRowScaled) {
      if (kRowwise && t < kQuantTile) {
        if (tm != scaled_tm) row_global[t] = global_scale(row_amax[m0 + (t < rows_left ? t : 0)]);
      } else if (kColwise && t >= kQuantTile && t < 2 * kQuantTile) {
        const int c = t - kQuantTile;
        col_global[c] = global_scale(col_amax[k0 + (c < cols_left ? c : 0)]);
      }
    }
    cp_async_wait<1>();
    __syncthreads();

    const bool rw_ok = rw_row < rows_left && rw_blk * 16 < cols_left;
    const bool cw_ok = cw_col < cols_left && cw_blk * 16 < rows_left;
    uint32_t rw_words[16 * sizeof(InT) / 4];  // a row block is 16 contiguous elements: read it as 16-byte vectors
#pragma unroll
    for (int v = 0; v < 16 / kVec; ++v)
      *reinterpret_cast<uint4*>(&rw_words[4 * v]) =
          *reinterpret_cast<const uint4*>(&tile[buf][rw_row][rw_blk * 16 + v * kVec]);
    float rw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) rw[i] = E::word_element_to_float(rw_words, i);
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
        const int64_t grow = m0 + rw_row;
        const float bamax = k2D ? tile_16x16_max(rw_row / 16, rw_blk) : rw_amax;
        const BlockEncoding enc = encode_block_scale(bamax, row_global[kRowScaled ? rw_row : 0]);
        *reinterpret_cast<uint2*>(row_data + grow * row_data_pitch + k0 / 2 + rw_blk * 8) =
            encode_block_codes<kHardwareCvt>(rw, enc.inverse);
        row_scale[grow * row_scale_pitch + k0 / 16 + rw_blk] = static_cast<uint8_t>(enc.scale_byte);
      }
    }
    if constexpr (kColwise) {
      // a row of the column pair: one 32-bit word of two 16-bit elements, or two fp32 words
      constexpr int kPairWords = sizeof(InT) / 2;
      uint32_t cw_words[8][kPairWords];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const InT* src = &tile[buf][cw_blk * 16 + 8 * (i / 4) + 4 * cw_half + i % 4][2 * cw_pair];
        if constexpr (kPairWords == 1) {
          cw_words[i][0] = *reinterpret_cast<const uint32_t*>(src);
        } else {
          const uint2 w = *reinterpret_cast<const uint2*>(src);
          cw_words[i][0] = w.x, cw_words[i][1] = w.y;
        }
      }
      float lo[8], hi[8];  // columns 2p and 2p+1
#pragma unroll
      for (int i = 0; i < 8; ++i)
        lo[i] = E::word_element_to_float(cw_words[i], 0), hi[i] = E::word_element_to_float(cw_words[i], 1);
      float bamax;
      if constexpr (k2D) {
        bamax = tile_16x16_max(cw_blk, cw_col / 16);
      } else if constexpr (kPairWords == 1) {
        auto abs_max = [](uint32_t a, uint32_t b) { return abs_max_xorsign<InT>(a, b); };
        auto word = [&](int i) { return cw_words[i][0]; };
        uint32_t m = abs_max(abs_max(abs_max(word(0), word(1)), abs_max(word(2), word(3))),
                             abs_max(abs_max(word(4), word(5)), abs_max(word(6), word(7))));
        m = abs_max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        bamax = xorsign_half_to_amax<InT>(m, cw_half);
      } else {
        float m_lo = 0.0f, m_hi = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) m_lo = fmaxf(m_lo, fabsf(lo[i])), m_hi = fmaxf(m_hi, fabsf(hi[i]));
        // send the partner the half of the column it owns
        const float theirs = __shfl_xor_sync(0xFFFFFFFFu, cw_half ? m_lo : m_hi, 1);
        bamax = fmaxf(cw_half ? m_hi : m_lo, theirs);
      }
      const BlockEncoding enc = encode_block_scale(bamax, col_global[kRowScaled ? cw_col : 0]);
      const float r_theirs = __shfl_xor_sync(0xFFFFFFFFu, enc.inverse, 1);
      const uint32_t codes_lo = encode_codes8<kHardwareCvt>(lo, cw_half ? r_theirs : enc.inverse);
      const uint32_t codes_hi = encode_codes8<kHardwareCvt>(hi, cw_half ? enc.inverse : r_theirs);
      // Each code word holds this half's rows: codes of rows 4h..4h+3 in its low 16 bits, of rows
      // 8+4h..8+4h+3 in its high 16 bits. Lane half 0 supplies the low halves of the column's two words.
      const uint32_t mine = cw_half ? codes_hi : codes_lo;
      const uint32_t theirs = __shfl_xor_sync(0xFFFFFFFFu, cw_half ? codes_lo : codes_hi, 1);
      if (cw_ok) {
        // PRMT selectors: bytes 0-3 are mine, 4-7 theirs; half 0's bytes go low in each 16-bit pair
        const uint32_t sel_low = cw_half ? 0x1054u : 0x5410u, sel_high = cw_half ? 0x3276u : 0x7632u;
        col_stage[cw_col][col_stage_blk(cw_col, cw_blk)] =
            make_uint2(__byte_perm(mine, theirs, sel_low), __byte_perm(mine, theirs, sel_high));
        col_scale_stage[cw_col][cw_blk] = static_cast<uint8_t>(enc.scale_byte);
      }
    }
    // every read of tile[buf], the global scales and the 16x16 maxima is done before this barrier,
    // so the next iteration may refill them
    __syncthreads();
    // lanes 4c..4c+3 write column c's four 8-byte blocks (32 contiguous bytes) and its four scale bytes
    if constexpr (kColwise) {
      if (st_col < cols_left && st_blk * 16 < rows_left) {
        *reinterpret_cast<uint2*>(col_data + (k0 + st_col) * col_data_pitch + m0 / 2 + st_blk * 8) =
            col_stage[st_col][col_stage_blk(st_col, st_blk)];
        col_scale[(k0 + st_col) * col_scale_pitch + m0 / 16 + st_blk] = col_scale_stage[st_col][st_blk];
      }
    }
    scaled_tm = tm;
    tm = next_tm, tk = next_tk;
    advance(next_tm, next_tk);
  }
  cp_async_wait<0>();
}

template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D>
int quantize_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                           const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data,
                           uint8_t* col_scale) {
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if ((kColwise || k2D) && rows % 16 != 0) return kInvalidProblem;
  if (((rows + kQuantTile - 1) / kQuantTile) * ((cols + kQuantTile - 1) / kQuantTile) > kMaxQuantTiles)
    return kInvalidProblem;
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
