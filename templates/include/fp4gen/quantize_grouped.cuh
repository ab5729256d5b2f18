// Grouped quantization (mixture of experts): x [T, K] whose rows are tokens sorted by group, with the groups'
// cumulative row ends in device memory (never read on the host), or stacked x [E, N, K] (group e = rows
// e * N .. e * N + N - 1 of its [E * N, K] view).
//
//   rowwise copy     [T, K/2] codes, [T, K/16] scales, like a dense copy of x; amax per row (vector_amax) or
//                    per group (one per group: each group's own tensor amax)
//   columnwise copy  each group's transpose, its rows padded with zeros (to a multiple of 64, as the caller
//                    lays the groups out: blocks along tokens never straddle groups): in the "column" layout the groups sit side by side along
//                    the padded token axis of one [K, capacity] copy, group g at padded columns
//                    padded_ends[g - 1] .. padded_ends[g] - 1 (capacity bounds their sum for any sizes); in
//                    the stacked layout group g is its own [K, N] matrix at col_group_stride bytes from the
//                    last. amax per (group, column) [E, K] (vector_amax) or per group [E]; with the Hadamard
//                    transform, those of the transformed copy.
//
// Stacked weights are quantized as the dense kernels quantize a matrix (a group is one). Scaled per group, both
// copies, rounded to nearest with no other option (the weights' recipe): the plain quantize kernel (quantize.cuh)
// over all groups in one grid, which takes the groups' amaxes itself where each group's rows are whole units of it
// (launch_stacked_flat), else after stacked_amax_kernel (launch_stacked_plain). Any other options:
// stacked_encode_kernel, which tiles each group as quantize_options does, after stacked_amax_kernel (per-group
// amaxes without the transform) or the padded-row-space amax pass below (grouped_amax_kernel).
//
// Tokens: the amax pass grouped_token_amax_kernel (patches in registers, a warp a run of 16-row blocks of the
// padded row space down a column strip), then, where the options allow (grouped_tokens_plain), the plain quantize
// kernel over the padded rows, once for each copy, each 64-row tile finding its group from padded_ends
// (group_tile_rows in quantize.cuh); otherwise grouped_encode_kernel.
//
// The padded-row-space passes below (grouped_amax_kernel, the encode kernels) work on 64 x 64 tiles (capacity
// rows), a CTA on four consecutive tiles of one column tile: each 16-row block finds its group by a binary search
// of padded_ends, then reads its rows of x (zeros past the group's end). Every amax pass accumulates the amaxes
// with atomicMax on |x|'s bit patterns (NaN > Inf > every finite value, so NaN propagates); the encode pass
// encodes the tile as the quantize_options kernels do (encode_options_tile), through a layout that maps the tile
// to the grouped copies. Options are run-time arguments: one library per input dtype and arch serves every
// grouped quantization (a few kernels, chosen at launch).
//
// Offsets that break their contract (decreasing, or past T) cannot reach memory outside x or the outputs: rows
// are clamped to [0, T) and blocks to the capacity; what such groups hold is then undefined.
#pragma once

#include <algorithm>
#include <type_traits>

#include "fp4gen/abi.h"
#include "fp4gen/elements.cuh"
#include "fp4gen/quantize.cuh"
#include "fp4gen/quantize_options.cuh"

namespace fp4gen {

struct GroupedQuantizeArgs {
  const void* x;
  int64_t x_row_stride, rows, cols;
  const int64_t* offsets;      // [groups] cumulative row ends
  const int64_t* padded_ends;  // [groups] cumulative ends of the groups' padded sizes (multiples of 16)
  int64_t groups, capacity;    // capacity: padded rows (a multiple of 16)
  float *row_amax, *col_amax;
  uint8_t *row_data, *row_scale, *col_data, *col_scale;
  int64_t col_group_stride, col_row_stride;  // codes bytes; scales are 8 times fewer
  bool stacked;                              // the columnwise copy: one matrix per group (else one [K, capacity])
  const int64_t* rng_state;
  bool vector_amax, block_2d, hadamard, stochastic;
  int four_over_six;  // 0 none, 1 MAE, 2 MSE
};

// One 16-row block of a tile in the padded row space.
struct GroupedBlock {
  int64_t source;        // x's row of the block's first row
  int64_t padded_start;  // the group's first padded row
  int group;             // -1: past every group (written as zeros in the column layout)
  int valid;             // rows of x in the block (the rest are padding)
};

__device__ __forceinline__ GroupedBlock find_grouped_block(const GroupedQuantizeArgs& a, int64_t padded_row) {
  // the first group whose padded end lies past padded_row
  int64_t lo = 0, hi = a.groups;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a.padded_ends[mid] > padded_row) hi = mid; else lo = mid + 1;
  }
  GroupedBlock b{0, 0, -1, 0};
  if (lo == a.groups) return b;
  const int64_t start = lo > 0 ? a.offsets[lo - 1] : 0, end = a.offsets[lo];
  b.padded_start = lo > 0 ? a.padded_ends[lo - 1] : 0;
  b.group = static_cast<int>(lo);
  b.source = start + (padded_row - b.padded_start);
  const int64_t last = end < a.rows ? end : a.rows;  // rows past T are never read
  const int64_t valid = last - b.source < 16 ? last - b.source : 16;
  b.valid = b.source < 0 || valid < 0 ? 0 : static_cast<int>(valid);
  return b;
}

// A CTA takes kGroupedTilesPerCta consecutive row tiles of one column tile, and loads the next tile's rows of x
// into registers while it works on the current one (a CTA's barriers then no longer wait on DRAM's latency:
// with one tile a CTA, both passes stalled mostly at barriers on the H200).
constexpr int kGroupedTilesPerCta = 4;

// The blocks of the CTA's tiles (one thread each, binary searches side by side). Callers synchronize before
// reading them.
__device__ __forceinline__ void find_cta_blocks(const GroupedQuantizeArgs& a, int64_t first_row,
                                                GroupedBlock (&blocks)[kGroupedTilesPerCta][kOptTile / 16]) {
  if (threadIdx.x < kGroupedTilesPerCta * (kOptTile / 16))
    blocks[threadIdx.x / (kOptTile / 16)][threadIdx.x % (kOptTile / 16)] =
        find_grouped_block(a, first_row + 16 * static_cast<int64_t>(threadIdx.x));
}

// One tile's rows of x in registers: this thread's 16-byte vectors (zeros for padding rows).
template <class InT>
struct GroupedTileLoads {
  static constexpr int kVec = Element<InT>::kPerVector, kVecsPerRow = kOptTile / kVec;
  static constexpr int kPerThread = kOptTile * kVecsPerRow / kOptThreads;
  uint4 vec[kPerThread];

  __device__ __forceinline__ void load(const GroupedQuantizeArgs& a, const GroupedBlock (&blocks)[kOptTile / 16],
                                       int64_t col0) {
    const InT* x = static_cast<const InT*>(a.x);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + j * kOptThreads, r = i / kVecsPerRow, cv = i % kVecsPerRow;
      const GroupedBlock& b = blocks[r / 16];
      const int64_t col = col0 + cv * kVec;
      const bool in = b.group >= 0 && r % 16 < b.valid && col < a.cols;
      vec[j] = in ? *reinterpret_cast<const uint4*>(x + (b.source + r % 16) * a.x_row_stride + col)
                  : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // widened to fp32 into the tile; callers synchronize before reading it
  __device__ __forceinline__ void store(float (*tile)[kOptTile + 1]) const {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + j * kOptThreads, r = i / kVecsPerRow, cv = i % kVecsPerRow;
#pragma unroll
      for (int e = 0; e < kVec; ++e) tile[r][cv * kVec + e] = Element<InT>::word_element_to_float(&vec[j].x, e);
    }
  }
};

// Runs work(t, blocks of tile t) for each of the CTA's tiles with the tile staged in `tile` (synchronized), the
// next tile's loads in flight, and a barrier after each tile's work.
template <class InT, class Work>
__device__ __forceinline__ void for_each_grouped_tile(const GroupedQuantizeArgs& a, float (*tile)[kOptTile + 1],
                                                      GroupedBlock (&blocks)[kGroupedTilesPerCta][kOptTile / 16],
                                                      Work work) {
  const int64_t first_tile = int64_t{blockIdx.x} * kGroupedTilesPerCta, col0 = int64_t{blockIdx.y} * kOptTile;
  const int64_t row_tiles = (a.capacity + kOptTile - 1) / kOptTile;
  const int64_t left = row_tiles - first_tile;
  const int tiles = left < kGroupedTilesPerCta ? static_cast<int>(left) : kGroupedTilesPerCta;
  find_cta_blocks(a, first_tile * kOptTile, blocks);
  __syncthreads();
  GroupedTileLoads<InT> loads;
  loads.load(a, blocks[0], col0);
  for (int t = 0; t < tiles; ++t) {
    loads.store(tile);
    __syncthreads();
    if (t + 1 < tiles) loads.load(a, blocks[t + 1], col0);
    work(t, blocks[t]);
    __syncthreads();
  }
}

// encode_options_tile's layout for a tile of the padded row space.
struct GroupedTileLayout {
  const GroupedQuantizeArgs* a;
  const GroupedBlock* blocks;
  int64_t row0, col0;
  uint8_t *row_data, *row_scale, *col_data, *col_scale;

  __device__ __forceinline__ int64_t row_block(int r, int jb) const {
    const GroupedBlock& b = blocks[r / 16];
    const int64_t block_col = col0 + 16 * jb;
    if (b.group < 0 || r % 16 >= b.valid || block_col >= a->cols) return -1;
    return (b.source + r % 16) * (a->cols / 16) + block_col / 16;
  }
  __device__ __forceinline__ float row_amax(int r) const {
    const GroupedBlock& b = blocks[r / 16];
    if (b.group < 0 || r % 16 >= b.valid) return 0.0f;
    return a->vector_amax ? a->row_amax[b.source + r % 16] : a->row_amax[b.group];
  }
  __device__ __forceinline__ int64_t col_block(int c, int g) const {
    const int64_t col = col0 + c, padded_row = row0 + 16 * g;
    if (col >= a->cols || padded_row >= a->capacity) return -1;
    const GroupedBlock& b = blocks[g];
    if (b.group < 0) return a->stacked ? -1 : col * (a->col_row_stride / 8) + padded_row / 16;
    const int64_t first = a->stacked ? padded_row - b.padded_start : padded_row;
    return b.group * (a->col_group_stride / 8) + col * (a->col_row_stride / 8) + first / 16;
  }
  __device__ __forceinline__ float col_amax(int c, int g) const {
    const GroupedBlock& b = blocks[g];
    if (b.group < 0) return 0.0f;  // an unused block: zeros, encoded as zero codes and a zero scale
    return a->vector_amax ? a->col_amax[b.group * a->cols + col0 + c] : a->col_amax[b.group];
  }
};

// Adds a tile's per-block maxima into the global amaxes, one atomicMax per run of consecutive blocks of one
// group (usually one for the whole tile): `partial(b)` is block b's maximum, `address(group)` the group's amax.
// Maxima are first combined in the CTA because every CTA of a group would otherwise hit the same few
// addresses once per warp, and same-address atomics serialize in L2.
template <class Partial, class Address>
__device__ __forceinline__ void flush_group_maxima(const GroupedBlock (&blocks)[kOptTile / 16], Partial partial,
                                                   Address address) {
  uint32_t run = 0;
  for (int b = 0; b < kOptTile / 16; ++b) {
    if (blocks[b].group < 0) continue;
    run = max(run, partial(b));
    const bool last_of_run = b + 1 == kOptTile / 16 || blocks[b + 1].group != blocks[b].group;
    if (last_of_run) atomicMax(reinterpret_cast<unsigned int*>(address(blocks[b].group)), run), run = 0;
  }
}

// The amax pass: row amaxes (of x) into row_amax, column amaxes (of the transformed copy with the transform)
// into col_amax, each null when not wanted. Both are zeroed before this runs.
template <class InT>
__global__ void __launch_bounds__(kOptThreads) grouped_amax_kernel(const GroupedQuantizeArgs a) {
  __shared__ float tile[kOptTile][kOptTile + 1];
  __shared__ GroupedBlock blocks[kGroupedTilesPerCta][kOptTile / 16];
  __shared__ uint32_t warp_row_max[kOptThreads / 32];          // per-group row amaxes: each warp's 8 rows
  __shared__ uint32_t block_col_max[kOptTile / 16][kOptTile];  // column amaxes: each block's, per column
  const int64_t col0 = int64_t{blockIdx.y} * kOptTile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for_each_grouped_tile<InT>(a, tile, blocks, [&](int, const GroupedBlock(&tile_blocks)[kOptTile / 16]) {
    if (a.row_amax != nullptr) {  // four threads a row, 16 columns each; a warp's 8 rows lie in one block
      const int r = threadIdx.x / 4, part = threadIdx.x % 4;
      const GroupedBlock& b = tile_blocks[r / 16];
      uint32_t bits = 0;
#pragma unroll
      for (int k = 0; k < 16; ++k) bits = max(bits, float_abs_bits(tile[r][16 * part + k]));
      bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, 1));
      bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, 2));
      const bool row_in = b.group >= 0 && r % 16 < b.valid;
      if (a.vector_amax) {
        if (part == 0 && row_in) atomicMax(reinterpret_cast<unsigned int*>(a.row_amax + b.source + r % 16), bits);
      } else {
        bits = row_in ? bits : 0u;
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, offset));
        if (lane == 0) warp_row_max[warp] = bits;
      }
    }
    if (a.col_amax != nullptr) {  // one 16-row block of one column a thread; a warp's 32 threads share the block
      const int c = threadIdx.x % kOptTile, g = threadIdx.x / kOptTile;
      float v[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = tile[16 * g + k][c];
      if (a.hadamard) hadamard16_to_bf16<InT>(v);
      uint32_t bits = 0;
#pragma unroll
      for (int k = 0; k < 16; ++k) bits = max(bits, float_abs_bits(v[k]));
      block_col_max[g][c] = col0 + c < a.cols ? bits : 0u;
    }
    __syncthreads();
    if (a.row_amax != nullptr && !a.vector_amax && threadIdx.x == 0)
      flush_group_maxima(tile_blocks, [&](int b) { return max(warp_row_max[2 * b], warp_row_max[2 * b + 1]); },
                         [&](int group) { return a.row_amax + group; });
    if (a.col_amax != nullptr) {
      if (a.vector_amax) {  // a thread a column
        const int c = threadIdx.x;
        if (c < kOptTile && col0 + c < a.cols)
          flush_group_maxima(tile_blocks, [&](int b) { return block_col_max[b][c]; },
                             [&](int group) { return a.col_amax + group * a.cols + col0 + c; });
      } else if (threadIdx.x < 32) {  // a warp: each block's maximum over the columns, then the flush
        uint32_t m[kOptTile / 16];
#pragma unroll
        for (int b = 0; b < kOptTile / 16; ++b) {
          m[b] = max(block_col_max[b][lane], block_col_max[b][lane + 32]);
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) m[b] = max(m[b], __shfl_xor_sync(0xFFFFFFFFu, m[b], offset));
        }
        if (lane == 0)
          flush_group_maxima(tile_blocks, [&](int b) { return m[b]; }, [&](int group) { return a.col_amax + group; });
      }
    }
  });
}

// The amax pass of grouped tokens (not stacked): the amaxes grouped_amax_kernel gives, from patches held in
// registers as amax_hadamard_tensor_kernel holds them, where that kernel's 64 x 64 tiles through shared memory ran
// at 1.6-1.9 TB/s on the H200 (bench/RESULTS.md, 2026-12-03). A warp takes one strip of 32 vectors of columns
// (kVec each) and a run of consecutive 16-row blocks of the padded row space down it; a lane loads 16 rows of
// its vector (zeros past the group's tokens, as the columnwise copy has them), transforms them with the
// transform, and keeps maxima:
//  - per token (kVectorAmax): a row's maximum over the warp's columns by a transposing reduction (16 rows over
//    32 lanes in 16 shuffles), one atomicMax a row and strip;
//  - per (group, column) (kVectorAmax): each of its columns' maxima over the run's blocks of one group, one
//    atomicMax a column when the group changes or the run ends;
//  - per group: two running maxima, reduced over the warp and flushed the same way.
// A block's group comes from the padded ends as the quantize kernel's tiles find theirs (group_tile_rows), looked up
// again only when the run leaves the group's padded rows.
// CTAs of four warps, at least three a multiprocessor: the transforming variants of 16-bit inputs take about 166
// registers a thread (the patch, the transform's pairs and the group's bounds), which three CTAs of 128 threads fit.
constexpr int kTokenAmaxThreads = 128, kTokenAmaxWarps = kTokenAmaxThreads / 32, kTokenAmaxMinCtasPerSm = 3;

// The maximum of v[i] over the 32 lanes, for 16 values, in 16 shuffles: each step halves the values a lane keeps
// (the upper or lower half, by a bit of its lane) and takes the maximum with its partner's other half. Lane l ends
// with the maximum of value token_amax_row(l) (twice: lanes l and l ^ 1).
template <int kHalf>
__device__ __forceinline__ void transpose_max_step(uint32_t (&v)[16], int lane) {
  const bool upper = lane & (2 * kHalf);
#pragma unroll
  for (int j = 0; j < kHalf; ++j) {
    const uint32_t send = upper ? v[j] : v[j + kHalf], keep = upper ? v[j + kHalf] : v[j];
    v[j] = max(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 2 * kHalf));
  }
}
__device__ __forceinline__ uint32_t transpose_max16(uint32_t (&v)[16], int lane) {
  transpose_max_step<8>(v, lane), transpose_max_step<4>(v, lane), transpose_max_step<2>(v, lane);
  transpose_max_step<1>(v, lane);
  return max(v[0], __shfl_xor_sync(0xFFFFFFFFu, v[0], 1));
}
__device__ __forceinline__ int token_amax_row(int lane) {
  return ((lane >> 4) & 1) * 8 + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1);
}

template <class InT, bool kHadamard, bool kVectorAmax>
__global__ void __launch_bounds__(kTokenAmaxThreads, kTokenAmaxMinCtasPerSm)
    grouped_token_amax_kernel(const GroupedQuantizeArgs a, int64_t strips, int64_t blocks_per_run) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector;
  const int lane = threadIdx.x % 32;
  const int64_t run = int64_t{blockIdx.x} * kTokenAmaxWarps + threadIdx.x / 32;
  const int64_t strip = run % strips, b_end = std::min(a.capacity / 16, (run / strips + 1) * blocks_per_run);
  const int64_t col = (strip * 32 + lane) * kVec;  // cols % 16 == 0: a lane's vector is wholly in or out
  const bool col_in = col < a.cols;
  const InT* const x = static_cast<const InT*>(a.x) + col;
  const QuantRowGroups tg{a.offsets, a.padded_ends, a.groups, a.rows, kVectorAmax};
  int group = -1;
  int64_t padded_start = 0, padded_end = -1, token_start = 0, token_end = 0;  // the current group's
  uint32_t col_bits[kVec] = {};             // per (group, column): this group's maxima of the lane's columns
  uint32_t row_bits = 0u, group_col_bits = 0u;  // per group
  auto flush = [&]() {  // the current group's column (and per-group) maxima; warp-uniform
    if (group < 0) return;
    if constexpr (kVectorAmax) {
      if (a.col_amax != nullptr && col_in) {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (col_bits[j] != 0u) atomicMax(reinterpret_cast<unsigned int*>(a.col_amax + group * a.cols + col + j), col_bits[j]);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) col_bits[j] = 0u;
    } else {
      const uint32_t r = warp_max_bits(row_bits), c = warp_max_bits(group_col_bits);
      if (lane == 0 && a.row_amax != nullptr && r != 0u) atomicMax(reinterpret_cast<unsigned int*>(a.row_amax + group), r);
      if (lane == 0 && a.col_amax != nullptr && c != 0u) atomicMax(reinterpret_cast<unsigned int*>(a.col_amax + group), c);
      row_bits = group_col_bits = 0u;
    }
  };
  for (int64_t b = (run / strips) * blocks_per_run; b < b_end; ++b) {
    const int64_t p0 = b * 16;
    if (p0 >= padded_end) {  // a new group's padded rows (or past every group)
      flush();
      group = -1;
      const GroupTileRows t = group_tile_rows(tg, p0, 16);
      if (t.group < 0) break;  // zero rows from here on: no maximum changes
      group = t.group;
      padded_start = group > 0 ? a.padded_ends[group - 1] : 0, padded_end = a.padded_ends[group];
      token_start = group > 0 ? a.offsets[group - 1] : 0, token_end = std::min<int64_t>(a.offsets[group], a.rows);
    }
    const int64_t source = token_start + (p0 - padded_start);  // as group_tile_rows finds it
    const int valid = source >= 0 && token_end > source ? static_cast<int>(std::min<int64_t>(token_end - source, 16)) : 0;
    if (valid == 0) continue;  // padding: zeros, also after the transform
    uint4 patch[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      patch[i] = col_in && i < valid ? load_streaming<false>(x + (source + i) * a.x_row_stride) : make_uint4(0, 0, 0, 0);
    // rows, untransformed
    if constexpr (kVectorAmax) {
      if (a.row_amax != nullptr) {
        uint32_t row_max[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const uint32_t m = vector_abs_max<InT>(0u, patch[i]);
          row_max[i] = E::abs_bits_as_float_bits(word_element<InT>(m, 0));
          if constexpr (sizeof(InT) == 2) row_max[i] = max(row_max[i], E::abs_bits_as_float_bits(word_element<InT>(m, 1)));
        }
        const uint32_t m = transpose_max16(row_max, lane);
        const int r = token_amax_row(lane);
        if ((lane & 1) == 0 && r < valid && m != 0u) atomicMax(reinterpret_cast<unsigned int*>(a.row_amax + source + r), m);
      }
    } else {
      uint32_t m = 0u;  // packed like the input
#pragma unroll
      for (int i = 0; i < 16; ++i)
        m = vector_abs_max<InT>(m, patch[i]);
      uint32_t bits = E::abs_bits_as_float_bits(word_element<InT>(m, 0));
      if constexpr (sizeof(InT) == 2) bits = max(bits, E::abs_bits_as_float_bits(word_element<InT>(m, 1)));
      row_bits = max(row_bits, bits);
    }
    // columns, transformed with the transform
    if (a.col_amax == nullptr) continue;
    if constexpr (kHadamard) {
      hadamard_patch<InT>(patch);
      if constexpr (kVectorAmax) {
#pragma unroll
        for (int w = 0; w < kVec / (sizeof(InT) == 2 ? 2 : 1); ++w) {
          uint32_t m = 0u;
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            if constexpr (sizeof(InT) == 2) m = max_u16x2(m, vector_word(patch[i], w) & 0x7FFF7FFFu);  // bf16 pairs
            else m = max(m, vector_word(patch[i], w) & 0x7FFFFFFFu);
          }
          if constexpr (sizeof(InT) == 2) {
            col_bits[2 * w] = max(col_bits[2 * w], m << 16), col_bits[2 * w + 1] = max(col_bits[2 * w + 1], m & 0xFFFF0000u);
          } else {
            col_bits[w] = max(col_bits[w], m);
          }
        }
      } else {
        group_col_bits = max(group_col_bits, transformed_patch_abs_max_bits<InT>(patch));
      }
    } else if constexpr (kVectorAmax) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t m = 0u;
#pragma unroll
        for (int i = 0; i < 16; ++i) m = word_abs_max<InT>(m, vector_word(patch[i], w));
#pragma unroll
        for (int e = 0; e < (sizeof(InT) == 2 ? 2 : 1); ++e) {
          const int j = w * (sizeof(InT) == 2 ? 2 : 1) + e;
          col_bits[j] = max(col_bits[j], E::abs_bits_as_float_bits(word_element<InT>(m, e)));
        }
      }
    } else {
      group_col_bits = row_bits;  // the same elements, untransformed
    }
  }
  flush();
}

// Launches grouped_token_amax_kernel: runs of blocks_per_run blocks, as many runs as the variant's resident CTAs
// hold warps (at least one a strip).
template <class InT, bool kHadamard, bool kVectorAmax>
int launch_grouped_token_amax_variant(const GroupedQuantizeArgs& a, cudaStream_t stream) {
  constexpr auto kernel = grouped_token_amax_kernel<InT, kHadamard, kVectorAmax>;
  constexpr int64_t kStripCols = 32 * Element<InT>::kPerVector;
  int device = 0, sms = 0, per_sm = 0;
  if (!current_device_multiprocessors(&device, &sms) || !cached_occupancy<kernel>(device, kTokenAmaxThreads, 0, &per_sm))
    return launch_status();
  const int64_t strips = (a.cols + kStripCols - 1) / kStripCols, blocks = a.capacity / 16;
  const int64_t warps = int64_t{sms} * std::max(per_sm, 1) * kTokenAmaxWarps;
  const int64_t runs_per_strip = std::max<int64_t>(1, std::min(blocks, warps / strips));
  const int64_t blocks_per_run = (blocks + runs_per_strip - 1) / runs_per_strip;
  const int64_t runs = strips * ((blocks + blocks_per_run - 1) / blocks_per_run);
  kernel<<<static_cast<unsigned>((runs + kTokenAmaxWarps - 1) / kTokenAmaxWarps), kTokenAmaxThreads, 0, stream>>>(
      a, strips, blocks_per_run);
  return launch_status();
}

template <class InT>
int launch_grouped_token_amax(const GroupedQuantizeArgs& a, cudaStream_t stream) {
  if (a.hadamard) {
    return a.vector_amax ? launch_grouped_token_amax_variant<InT, true, true>(a, stream)
                         : launch_grouped_token_amax_variant<InT, true, false>(a, stream);
  }
  return a.vector_amax ? launch_grouped_token_amax_variant<InT, false, true>(a, stream)
                       : launch_grouped_token_amax_variant<InT, false, false>(a, stream);
}

// Stochastic rounding's seed and offset, read on the device (so a captured call draws anew at each replay).
__device__ __forceinline__ void stochastic_draw(const GroupedQuantizeArgs& a, uint64_t& seed, uint64_t& offset) {
  seed = static_cast<uint64_t>(a.rng_state[0]), offset = static_cast<uint64_t>(a.rng_state[1]);
}

template <class InT, bool kStochastic, bool kHadamard, bool kFourOverSix, bool kHardwareCvt>
__global__ void __launch_bounds__(kOptThreads) grouped_encode_kernel(const GroupedQuantizeArgs a) {
  __shared__ OptionsTile s;
  __shared__ GroupedBlock blocks[kGroupedTilesPerCta][kOptTile / 16];
  uint64_t seed = 0, offset = 0;
  if constexpr (kStochastic) stochastic_draw(a, seed, offset);
  const int64_t first_row = int64_t{blockIdx.x} * kGroupedTilesPerCta * kOptTile, col0 = int64_t{blockIdx.y} * kOptTile;
  for_each_grouped_tile<InT>(a, s.tile, blocks, [&](int t, const GroupedBlock(&tile_blocks)[kOptTile / 16]) {
    const GroupedTileLayout layout{&a, tile_blocks, first_row + t * kOptTile, col0, a.row_data, a.row_scale,
                                   a.col_data, a.col_scale};
    encode_options_tile<InT, kStochastic, kHadamard, kFourOverSix, kHardwareCvt>(s, layout, seed, offset,
                                                                                a.block_2d, a.four_over_six == 2);
  });
}

// Stacked weights: group e is rows e * N .. e * N + N - 1 of x's [E * N, K] view, a dense matrix of its own, so
// they skip the padded row space: a CTA takes one 64 x 64 tile of one group (found by a division, not a search),
// as the dense quantize_options kernel takes a tile, and no tile straddles two groups. The copies' storage, block
// numbers (stochastic rounding's too) and amaxes are those GroupedTileLayout gives the same blocks.
struct StackedTileLayout {
  const GroupedQuantizeArgs* a;
  int64_t group, group_rows, row0, col0;  // row0: the tile's first row within its group
  uint8_t *row_data, *row_scale, *col_data, *col_scale;

  __device__ __forceinline__ int64_t row_block(int r, int jb) const {
    const int64_t row = row0 + r, block_col = col0 + 16 * jb;
    if (row >= group_rows || block_col >= a->cols) return -1;
    return (group * group_rows + row) * (a->cols / 16) + block_col / 16;
  }
  // Also the amax of a 16x16 block's tile (encode_options_tile) when only the columnwise copy is made: the group's one
  // amax is then in col_amax alone (quantize_grouped_run passes no row_amax without rowwise outputs).
  __device__ __forceinline__ float row_amax(int r) const {
    if (row0 + r >= group_rows) return 0.0f;
    if (a->vector_amax) return a->row_amax[group * group_rows + row0 + r];
    return (a->row_amax != nullptr ? a->row_amax : a->col_amax)[group];
  }
  __device__ __forceinline__ int64_t col_block(int c, int g) const {
    const int64_t col = col0 + c, block_row = row0 + 16 * g;
    if (col >= a->cols || block_row >= group_rows) return -1;
    return group * (a->col_group_stride / 8) + col * (a->col_row_stride / 8) + block_row / 16;
  }
  __device__ __forceinline__ float col_amax(int c, int) const {
    return a->vector_amax ? a->col_amax[group * a->cols + col0 + c] : a->col_amax[group];
  }
};

template <class InT, bool kStochastic, bool kHadamard, bool kFourOverSix, bool kHardwareCvt>
__global__ void __launch_bounds__(kOptThreads) stacked_encode_kernel(const GroupedQuantizeArgs a, int64_t group_rows,
                                                                      int64_t tiles_per_group) {
  __shared__ OptionsTile s;
  const int64_t group = blockIdx.x / tiles_per_group;
  const int64_t row0 = (blockIdx.x - group * tiles_per_group) * kOptTile, col0 = int64_t{blockIdx.y} * kOptTile;
  const InT* x = static_cast<const InT*>(a.x) + group * group_rows * a.x_row_stride;
  stage_tile_fp32<InT, kOptTile, kOptThreads>(x, a.x_row_stride, group_rows, a.cols, row0, col0, s.tile);
  __syncthreads();
  uint64_t seed = 0, offset = 0;
  if constexpr (kStochastic) stochastic_draw(a, seed, offset);
  const StackedTileLayout layout{&a, group, group_rows, row0, col0, a.row_data, a.row_scale, a.col_data, a.col_scale};
  encode_options_tile<InT, kStochastic, kHadamard, kFourOverSix, kHardwareCvt>(s, layout, seed, offset, a.block_2d,
                                                                              a.four_over_six == 2);
}

// Stacked weights scaled per group, without the transform: each group's amax of |x| (NaN-propagating, as the amax
// pass) into row_amax and col_amax (either may be null), x read once in 16-byte vectors. The CTAs of a group split
// its vectors between them (chunks_per_group of them, each every chunks_per_group * 256-th vector a thread) and
// add their maxima with one atomicMax each.
constexpr int kStackedAmaxThreads = 256, kStackedAmaxCtas = 2048;  // CTAs a launch aims at

template <class InT>
__global__ void __launch_bounds__(kStackedAmaxThreads)
    stacked_amax_kernel(const GroupedQuantizeArgs a, int64_t group_rows, int64_t chunks_per_group) {
  constexpr int kVec = Element<InT>::kPerVector;
  __shared__ uint32_t warp_max[kStackedAmaxThreads / 32];
  const int64_t group = blockIdx.x / chunks_per_group, chunk = blockIdx.x - group * chunks_per_group;
  const InT* x = static_cast<const InT*>(a.x) + group * group_rows * a.x_row_stride;
  const int64_t per_row = a.cols / kVec, step = chunks_per_group * kStackedAmaxThreads;
  const int64_t step_rows = step / per_row, step_vecs = step - step_rows * per_row;
  const int64_t first = chunk * kStackedAmaxThreads + threadIdx.x;
  int64_t row = first / per_row, vec = first - row * per_row;  // advanced without dividing again
  uint32_t bits = 0;
  for (; row < group_rows; row += step_rows, vec += step_vecs) {
    if (vec >= per_row) vec -= per_row, ++row;
    if (row >= group_rows) break;
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + row * a.x_row_stride + vec * kVec));
#pragma unroll
    for (int e = 0; e < kVec; ++e) bits = max(bits, float_abs_bits(Element<InT>::word_element_to_float(&v.x, e)));
  }
  bits = warp_max_bits(bits);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kStackedAmaxThreads / 32; ++w) bits = max(bits, warp_max[w]);
    if (a.row_amax != nullptr) atomicMax(reinterpret_cast<unsigned int*>(a.row_amax + group), bits);
    if (a.col_amax != nullptr) atomicMax(reinterpret_cast<unsigned int*>(a.col_amax + group), bits);
  }
}

inline GroupedQuantizeArgs grouped_quantize_args(
    const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const int64_t* offsets,
    const int64_t* padded_ends, int64_t groups, int64_t capacity, float* row_amax, float* col_amax, uint8_t* row_data,
    uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale, int64_t col_group_stride, int64_t col_row_stride,
    int64_t stacked, const int64_t* rng_state, int64_t vector_amax, int64_t block_2d, int64_t hadamard,
    int64_t four_over_six, int64_t stochastic) {
  return GroupedQuantizeArgs{x, x_row_stride, rows, cols, offsets, padded_ends, groups, capacity, row_amax, col_amax,
                             row_data, row_scale, col_data, col_scale, col_group_stride, col_row_stride, stacked != 0,
                             rng_state, vector_amax != 0, block_2d != 0, hadamard != 0, stochastic != 0,
                             static_cast<int>(four_over_six)};
}

// Where stacked weights (one dense [group_rows, cols] matrix a group) are quantized. Both copies, rounded to
// nearest and scaled by each group's amax, take the plain quantize kernel: as one [groups * group_rows, cols]
// tensor in one grid (kStackedFlat) where each group's rows are whole units (within the kernel's tile count), else
// after stacked_amax_kernel with one grid row a group. Any other options: the amax pass, then their encode pass.
enum class StackedLaunch { kFlat, kGridRows, kEncode };

template <class InT>
StackedLaunch stacked_launch(const GroupedQuantizeArgs& a) {
  constexpr int64_t kTileRows = QuantLane<InT>::kTileRows, kRowsPerUnit = kTileRows * kQuantWarps;
  const int64_t group_rows = a.rows / a.groups;
  const bool plain = !a.vector_amax && !a.hadamard && !a.stochastic && a.four_over_six == 0 && a.row_data != nullptr &&
                     a.col_data != nullptr && group_rows % 16 == 0;
  if (plain && group_rows > 0 && a.cols > 0 && a.capacity > 0 && group_rows % kRowsPerUnit == 0 &&
      a.groups * group_rows / kTileRows * quant_tiles_k(a.cols) <= kMaxQuantTiles)
    return StackedLaunch::kFlat;
  return plain && a.groups <= 65535 ? StackedLaunch::kGridRows : StackedLaunch::kEncode;  // (gridDim.y)
}

// The counters of the flat stacked launch (QuantRowGroups::flat_counters): two, then one a group.
inline size_t stacked_flat_counters_bytes(int64_t groups) { return sizeof(uint32_t) * static_cast<size_t>(groups + 2); }

template <class InT>
int quantize_grouped_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols,
                                   const int64_t* offsets, const int64_t* padded_ends, int64_t groups,
                                   int64_t capacity, float* row_amax, float* col_amax, uint8_t* row_data,
                                   uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale, int64_t col_group_stride,
                                   int64_t col_row_stride, int64_t stacked, const int64_t* rng_state,
                                   int64_t vector_amax, int64_t block_2d, int64_t hadamard, int64_t four_over_six,
                                   int64_t stochastic, void* workspace) {
  const bool rowwise = row_data != nullptr, colwise = col_data != nullptr;
  for (const int64_t flag : {stacked, vector_amax, block_2d, hadamard, stochastic})
    if (flag != 0 && flag != 1) return kInvalidProblem;
  if (four_over_six < 0 || four_over_six > 2 || (four_over_six != 0 && stochastic)) return kInvalidProblem;
  if (rows < 0 || cols < 0 || cols % 16 != 0 || groups < 1 || capacity < 0 || capacity % 16 != 0) return kInvalidProblem;
  if (!(rowwise || colwise) || offsets == nullptr || padded_ends == nullptr) return kInvalidProblem;
  if (rowwise && (row_amax == nullptr || row_scale == nullptr)) return kInvalidProblem;
  if (colwise && (col_amax == nullptr || col_scale == nullptr || col_row_stride < 0 || col_row_stride % 8 != 0 ||
                  col_group_stride < 0 || col_group_stride % 8 != 0))
    return kInvalidProblem;
  if (block_2d && (vector_amax || hadamard || !stacked)) return kInvalidProblem;  // 16x16: stacked weights, per group
  if (stacked && rows % groups != 0) return kInvalidProblem;  // [E * N, K]: N rows a group
  if (stacked && workspace == nullptr &&
      stacked_launch<InT>(grouped_quantize_args(
          x, x_row_stride, rows, cols, offsets, padded_ends, groups, capacity, row_amax, col_amax, row_data, row_scale,
          col_data, col_scale, col_group_stride, col_row_stride, stacked, rng_state, vector_amax, block_2d, hadamard,
          four_over_six, stochastic)) == StackedLaunch::kFlat)
    return kInvalidProblem;  // the flat launch's counters (quantize_grouped_workspace_size)
  if (workspace != nullptr && !aligned(workspace, 4)) return kMisaligned;
  if (hadamard && !colwise) return kInvalidProblem;
  if (stochastic && rng_state == nullptr) return kInvalidProblem;
  if ((cols + kOptTile - 1) / kOptTile > 65535) return kInvalidProblem;  // gridDim.y
  if ((capacity + kOptTile - 1) / kOptTile > 0x7FFFFFFF) return kInvalidProblem;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  if ((rowwise && !aligned(row_data, 8)) || (colwise && !aligned(col_data, 8))) return kMisaligned;
  return kOk;
}

// The grid of the padded-row-space passes: kGroupedTilesPerCta row tiles a CTA, a column tile a grid row.
inline dim3 grouped_grid(int64_t capacity, int64_t cols) {
  const int64_t row_tiles = (capacity + kOptTile - 1) / kOptTile;
  return dim3(static_cast<unsigned>((row_tiles + kGroupedTilesPerCta - 1) / kGroupedTilesPerCta),
              static_cast<unsigned>((cols + kOptTile - 1) / kOptTile));
}

// The encode pass of the options (stacked_encode_kernel or grouped_encode_kernel), compiled for each combination
// the options allow.
template <class InT, bool kHardwareCvt, bool kStacked, bool kStochastic, bool kHadamard, bool kFourOverSix>
void launch_encode_kernel(const GroupedQuantizeArgs& a, dim3 grid, cudaStream_t stream, int64_t group_rows,
                          int64_t tiles_per_group) {
  if constexpr (kStacked) {
    stacked_encode_kernel<InT, kStochastic, kHadamard, kFourOverSix, kHardwareCvt><<<grid, kOptThreads, 0, stream>>>(
        a, group_rows, tiles_per_group);
  } else {
    grouped_encode_kernel<InT, kStochastic, kHadamard, kFourOverSix, kHardwareCvt><<<grid, kOptThreads, 0, stream>>>(a);
  }
}

template <class InT, bool kHardwareCvt, bool kStacked>
void launch_encode(const GroupedQuantizeArgs& a, dim3 grid, cudaStream_t stream, int64_t group_rows,
                   int64_t tiles_per_group) {
  auto launch = [&](auto stochastic, auto hadamard, auto four_over_six) {
    launch_encode_kernel<InT, kHardwareCvt, kStacked, decltype(stochastic)::value, decltype(hadamard)::value,
                         decltype(four_over_six)::value>(a, grid, stream, group_rows, tiles_per_group);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (a.stochastic) {
    if (a.hadamard) launch(Yes{}, Yes{}, No{}); else launch(Yes{}, No{}, No{});
  } else if (a.four_over_six != 0) {
    if (a.hadamard) launch(No{}, Yes{}, Yes{}); else launch(No{}, No{}, Yes{});
  } else {
    if (a.hadamard) launch(No{}, Yes{}, No{}); else launch(No{}, No{}, No{});
  }
}

// Stacked weights in the plain quantize kernel as one flat tensor, which takes the groups' amaxes itself (no amax
// pass): the CTAs take the amaxes of units up to kStackedFlatAmaxLead ahead of those they quantize, so that most
// of a unit's second read comes from L2 (see flat_amax_units in quantize_kernel).
template <class InT, bool kHardwareCvt, bool k2D>
int launch_stacked_flat(const GroupedQuantizeArgs& a, int64_t group_rows, void* workspace, cudaStream_t stream) {
  if (cudaMemsetAsync(workspace, 0, stacked_flat_counters_bytes(a.groups), stream) != cudaSuccess)
    return launch_status();
  QuantRowGroups matrices{};
  matrices.matrix_rows = group_rows;
  matrices.flat_counters = static_cast<uint32_t*>(workspace);
  matrices.amax_lead = kStackedFlatAmaxLead;
  return launch_quantize_kernel<InT, true, true, false, k2D, false, false, kHardwareCvt, false, true>(
      a.x, a.x_row_stride, a.groups * group_rows, a.cols, static_cast<const float*>(a.row_amax),
      static_cast<const float*>(a.col_amax), a.row_data, a.row_scale, a.col_data, a.col_scale, nullptr, matrices,
      stream);
}

// Stacked weights in the plain quantize kernel otherwise, the programmatic dependent of stacked_amax_kernel: one
// grid row a group (quantize_kernel's matrices), the CTAs of a full grid shared out between the groups, each
// group's units dealt to its CTAs where quant_units_dealt says so.
template <class InT, bool kHardwareCvt, bool k2D>
int launch_stacked_plain(const GroupedQuantizeArgs& a, int64_t group_rows, cudaStream_t stream) {
  constexpr int64_t kRowsPerUnit = QuantLane<InT>::kTileRows * kQuantWarps, kUnitCols = kUnitTiles * kQuantTileCols;
  constexpr auto kernel = quantize_kernel<InT, true, true, false, k2D, kHardwareCvt, false, false>;
  int device = 0, sms = 0, per_sm = 0;
  if (!current_device_multiprocessors(&device, &sms) || !cached_occupancy<kernel>(device, kQuantThreads, 0, &per_sm))
    return launch_status();
  const int64_t units = (group_rows + kRowsPerUnit - 1) / kRowsPerUnit * ((a.cols + kUnitCols - 1) / kUnitCols);
  const int64_t ctas = std::min<int64_t>(units, std::max<int64_t>(1, int64_t{sms} * std::max(per_sm, 1) / a.groups));
  return launch_programmatic_dependent(kernel, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(a.groups)),
                                       dim3(kQuantThreads), 0, stream, static_cast<const InT*>(a.x), a.x_row_stride,
                                       group_rows, a.cols, static_cast<const float*>(a.row_amax),
                                       static_cast<const float*>(a.col_amax), a.row_data, a.row_scale, a.col_data,
                                       a.col_scale, static_cast<const int64_t*>(nullptr), kUnitTiles,
                                       quant_units_dealt(units, ctas), QuantRowGroups{});
}

// Tokens in the plain quantize kernel (quantize.cuh's grouped tokens), where the options allow it: round to nearest
// or stochastic rounding of 16-bit inputs, the transform or not, no 4over6, and the column layout whose padded rows
// are the kernel's (groups padded to kGroupPadRows, one [K, capacity] copy). One kernel a copy: the rowwise copy
// (the tokens' rows), then the columnwise copy (the padded rows; the transform is the columnwise-only kernel's).
inline bool grouped_tokens_plain(const GroupedQuantizeArgs& a, size_t in_bytes) {
  return !a.stacked && !a.block_2d && a.four_over_six == 0 && (!a.stochastic || in_bytes == 2) &&
         a.capacity % kGroupPadRows == 0 && (a.col_data == nullptr || (a.col_group_stride == 0 &&
                                                                         a.col_row_stride == a.capacity / 2));
}

template <class InT, bool kHardwareCvt, bool kStochastic>
int launch_grouped_tokens_plain(const GroupedQuantizeArgs& a, cudaStream_t stream) {
  const QuantRowGroups groups{a.offsets, a.padded_ends, a.groups, a.rows, a.vector_amax};
  if (a.row_data != nullptr) {
    const int launched =
        launch_quantize_kernel<InT, true, false, true, false, false, kStochastic, kHardwareCvt, true>(
            a.x, a.x_row_stride, a.capacity, a.cols, a.row_amax, nullptr, a.row_data, a.row_scale, nullptr, nullptr,
            a.rng_state, groups, stream);
    if (launched != kOk) return launched;
  }
  if (a.col_data == nullptr) return kOk;
  if (a.hadamard) {
    return launch_quantize_kernel<InT, false, true, true, false, true, kStochastic, kHardwareCvt, true>(
        a.x, a.x_row_stride, a.capacity, a.cols, nullptr, a.col_amax, nullptr, nullptr, a.col_data, a.col_scale,
        a.rng_state, groups, stream);
  }
  return launch_quantize_kernel<InT, false, true, true, false, false, kStochastic, kHardwareCvt, true>(
      a.x, a.x_row_stride, a.capacity, a.cols, nullptr, a.col_amax, nullptr, nullptr, a.col_data, a.col_scale,
      a.rng_state, groups, stream);
}

// Stacked weights in one grid: the flat launch's counters. Nothing for any other call.
template <class InT>
size_t quantize_grouped_workspace_size(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols,
                                       const int64_t* offsets, const int64_t* padded_ends, int64_t groups,
                                       int64_t capacity, float* row_amax, float* col_amax, uint8_t* row_data,
                                       uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale,
                                       int64_t col_group_stride, int64_t col_row_stride, int64_t stacked,
                                       const int64_t* rng_state, int64_t vector_amax, int64_t block_2d,
                                       int64_t hadamard, int64_t four_over_six, int64_t stochastic, void*) {
  if (!stacked || groups < 1) return 0;
  const GroupedQuantizeArgs a = grouped_quantize_args(
      x, x_row_stride, rows, cols, offsets, padded_ends, groups, capacity, row_amax, col_amax, row_data, row_scale,
      col_data, col_scale, col_group_stride, col_row_stride, stacked, rng_state, vector_amax, block_2d, hadamard,
      four_over_six, stochastic);
  return stacked_launch<InT>(a) == StackedLaunch::kFlat ? stacked_flat_counters_bytes(groups) : 0;
}

// Zeroes the amaxes, runs the amax pass, then the encode pass of the options asked for.
template <class InT, bool kHardwareCvt>
int quantize_grouped_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const int64_t* offsets,
                         const int64_t* padded_ends, int64_t groups, int64_t capacity, float* row_amax, float* col_amax,
                         uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale,
                         int64_t col_group_stride, int64_t col_row_stride, int64_t stacked, const int64_t* rng_state,
                         int64_t vector_amax, int64_t block_2d, int64_t hadamard, int64_t four_over_six,
                         int64_t stochastic, void* workspace, cudaStream_t stream) {
  const int status = quantize_grouped_can_implement<InT>(
      x, x_row_stride, rows, cols, offsets, padded_ends, groups, capacity, row_amax, col_amax, row_data, row_scale,
      col_data, col_scale, col_group_stride, col_row_stride, stacked, rng_state, vector_amax, block_2d, hadamard,
      four_over_six, stochastic, workspace);
  if (status != kOk) return status;
  const GroupedQuantizeArgs a = grouped_quantize_args(
      x, x_row_stride, rows, cols, offsets, padded_ends, groups, capacity, row_data ? row_amax : nullptr,
      col_data ? col_amax : nullptr, row_data, row_scale, col_data, col_scale, col_group_stride, col_row_stride,
      stacked, rng_state, vector_amax, block_2d, hadamard, four_over_six, stochastic);
  if (a.row_amax != nullptr &&
      cudaMemsetAsync(a.row_amax, 0, sizeof(float) * (vector_amax ? rows : groups), stream) != cudaSuccess)
    return launch_status();
  if (a.col_amax != nullptr &&
      cudaMemsetAsync(a.col_amax, 0, sizeof(float) * (vector_amax ? groups * cols : groups), stream) != cudaSuccess)
    return launch_status();
  if (capacity == 0 || cols == 0) return kOk;
  if (stacked) {  // one group a dense matrix
    const int64_t group_rows = rows / groups, tiles_per_group = (group_rows + kOptTile - 1) / kOptTile;
    if (group_rows == 0) return kOk;
    const StackedLaunch launch = stacked_launch<InT>(a);
    if (launch == StackedLaunch::kFlat) {
      return block_2d ? launch_stacked_flat<InT, kHardwareCvt, true>(a, group_rows, workspace, stream)
                      : launch_stacked_flat<InT, kHardwareCvt, false>(a, group_rows, workspace, stream);
    }
    if (!vector_amax && !hadamard) {
      const int64_t vecs = group_rows * (cols / Element<InT>::kPerVector);
      const int64_t wanted = std::max<int64_t>(1, kStackedAmaxCtas / groups);
      const int64_t chunks = std::min<int64_t>(wanted, (vecs + kStackedAmaxThreads - 1) / kStackedAmaxThreads);
      stacked_amax_kernel<InT><<<static_cast<unsigned>(groups * chunks), kStackedAmaxThreads, 0, stream>>>(
          a, group_rows, chunks);
    } else {  // per-row, per-column or transformed amaxes: the general pass
      grouped_amax_kernel<InT><<<grouped_grid(capacity, cols), kOptThreads, 0, stream>>>(a);
    }
    if (const int launched = launch_status(); launched != kOk) return launched;
    if (launch == StackedLaunch::kGridRows) {
      return block_2d ? launch_stacked_plain<InT, kHardwareCvt, true>(a, group_rows, stream)
                      : launch_stacked_plain<InT, kHardwareCvt, false>(a, group_rows, stream);
    }
    const dim3 grid(static_cast<unsigned>(groups * tiles_per_group),
                    static_cast<unsigned>((cols + kOptTile - 1) / kOptTile));
    launch_encode<InT, kHardwareCvt, true>(a, grid, stream, group_rows, tiles_per_group);
  } else {
    if (const int launched = launch_grouped_token_amax<InT>(a, stream); launched != kOk) return launched;
    if (grouped_tokens_plain(a, sizeof(InT))) {
      if constexpr (sizeof(InT) == 2) {
        if (stochastic) return launch_grouped_tokens_plain<InT, kHardwareCvt, true>(a, stream);
      }
      return launch_grouped_tokens_plain<InT, kHardwareCvt, false>(a, stream);
    }
    launch_encode<InT, kHardwareCvt, false>(a, grouped_grid(capacity, cols), stream, 0, 0);
  }
  return launch_status();
}

}  // namespace fp4gen
