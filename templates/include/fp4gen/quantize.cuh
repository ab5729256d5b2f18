// The quantize pass: x [M, K] -> rowwise NVFP4 (codes [M, K/2], scales [M, K/16]) and/or columnwise NVFP4
// of x.T (codes [K, M/2], scales [K, M/16]), given the amaxes of the amax pass (or, for the columnwise copy
// after the row pass, row_pass.cuh's column amaxes) (spec sections 2-4, 6.2).
//
// Each warp encodes tiles of 64 columns x 16 * kGroups rows. A lane owns a patch of 16 rows x one 16-byte
// vector (8 16-bit or 4 fp32 elements); the lanes of a 16-row group cover the tile's 64 contiguous
// columns, so every load instruction reads whole 128-byte lines. Then:
//  - a columnwise block (16 rows of one column) lies wholly in one lane: its amax, scale and codes need no
//    other lane;
//  - a rowwise block (16 columns of one row) spans kBlockLanes = 2 (16-bit) or 4 (fp32) lanes: one
//    exchange of partial maxima, after which the lanes split the rows whose scales they compute;
//  - each element is widened to fp32 once for both directions.
// A lane loads its patch straight into registers (16 loads in flight, issued before the previous tile's
// flushes; 16 warps per SM cover the rest of the wait).
// The codes are encoded half a patch (8 rows) at a time in a rolled loop, the second half's registers
// moved into the first half's in between, which keeps the hot code within the instruction cache (the
// fully unrolled patch did not fit).
//
// What bounded earlier versions was neither DRAM bytes nor instructions but L2 write requests: a tile
// writes 32 bytes of codes and 4 bytes of scales per row and per column, and each such piece stored
// straight from the lanes is its own request. So outputs are gathered in shared memory and leave in
// larger pieces: the CTA's warps take stacked tile rows and walk the same tile columns in step, so a
// tile column's columnwise codes leave as 128-byte lines per column (after a CTA barrier), and each warp
// keeps its rowwise codes of kCodeStageTiles tiles and its rowwise scales of a unit's tiles (up to kUnitTiles).
// With row scaling, the global scales of a tile's rows and columns are computed once per warp (the lanes
// in turn, from amaxes loaded a tile ahead) into the warp's shared memory. Whole tiles' codes and columnwise
// scales leave the stages with plain 16-byte stores, only tiles at the tensor's edges piece by piece with
// bounds tests; a unit's rowwise scales leave in 8-byte pieces, each tested.
//
// On sm_90a, a 16-bit tile whose every block passes fast_encode_ok (nvfp4.cuh: no code can saturate, no
// product can underflow to -0, no NaN in the tile's rows or columns) is encoded by encode_codes_fast,
// which needs two instructions per element and direction fewer than the exact encode; the warp decides
// per tile, and other tiles take the exact encode. Both give the spec's bytes (tests/cuda/e2m1_exhaustive.cu
// compares them on the CPU). Also on sm_90a, a tile's 16 block scales per lane are computed with no branch
// (reciprocal_rn_in_range instead of __frcp_rn) wherever the global scales of its rows and columns allow
// it (see rows_special), so that their dependent chains overlap; __frcp_rn's branch had serialized them.
//
// The pass is launched as the programmatic dependent of the kernel that writes its amaxes (the amax pass, or
// column_amax_reduce_kernel after the row pass) and waits for it (griddepcontrol.wait) before it reads them;
// stacked weights in one grid (kStackedFlat) follow only the zeroing of their counters and take the amaxes
// themselves (flat_amax_units).
#pragma once

#include <algorithm>
#include <type_traits>

#include "fp4gen/abi.h"
#include "fp4gen/async_copy.cuh"
#include "fp4gen/elements.cuh"
#include "fp4gen/hadamard.cuh"
#include "fp4gen/nvfp4.cuh"
#include "fp4gen/stochastic.cuh"

namespace fp4gen {

constexpr int kQuantWarps = 4, kQuantThreads = 32 * kQuantWarps, kQuantTileCols = 64;
// A CTA's unit of work: unit_tiles consecutive tile columns of kQuantWarps consecutive tile rows, one per
// warp; unit_tiles is kUnitTiles, or a half or a quarter of it where the units would not fill the GPU (see
// quant_unit_tiles_for). A warp's rowwise codes leave every kCodeStageTiles tiles (64 bytes a row), its rowwise
// scales at the end of the unit (4 bytes a tile and row).
constexpr int kUnitTiles = 8, kCodeStageTiles = 2;
// The row-scaled columnwise-only kernel (the pass after the row pass, row_pass.cuh) has no rowwise stages and
// takes single tiles instead, dealt to the CTAs in turn in row-major order, with loads and stores that leave
// L2 first (see kAfterRowPass in quantize_kernel). The same kernel also follows the amax pass (row scaling
// with no rowwise copy), where that gains nothing. Grouped tokens (kGrouped) take units like the other kernels:
// their tiles then share a group along a unit; on the H200 that ran 2-6% faster in six of the twelve MoE calls
// measured, within 0.5% in four, slower in two (Qwen3-30B-A3B FC2's X, 768 columns: 1.6% and 3.8%;
// bench/RESULTS.md, 2026-12-03).
template <bool kRowwise, bool kColwise, bool kRowScaled, bool kGrouped = false>
constexpr bool quant_after_row_pass() {
  return kRowScaled && kColwise && !kRowwise && !kGrouped;
}
// Tiles a unit for a tensor of tile_rows x tiles_k tiles on a GPU of `slots` CTA slots. Round to nearest:
// kUnitTiles, halved (to at least kCodeStageTiles, so that units start at even tiles and the codes' stage stays
// whole) while the units would fill less than 70% of the slots; with whole units an 8192 x 4096 tensor gave
// each H200 multiprocessor two CTAs (8 warps) where four fit, and a 4096 x 4096 one a single CTA. Stochastic
// rounding, whose tiles take about twice as long: the same width where its units fill at least 90% of one
// wave or whole units make at least three waves, else kCodeStageTiles. The thresholds are where the widths
// crossed on the H200 (bench/RESULTS.md, 2026-12-02): 8192 x 6144 to nearest ran 5% faster in whole units than
// in halves at 73% of the slots; the stochastic kernels ran 5-8% faster in the narrowest units on tensors of
// one to three waves, about 1% slower on a nearly full single wave and about 2% slower from three waves on.
__host__ __device__ constexpr int quant_unit_tiles_for(int64_t tile_rows, int64_t tiles_k, int64_t slots,
                                                       bool stochastic) {
  const int64_t unit_rows = (tile_rows + kQuantWarps - 1) / kQuantWarps;
  auto units = [&](int64_t unit_tiles) { return unit_rows * ((tiles_k + unit_tiles - 1) / unit_tiles); };
  int unit_tiles = kUnitTiles;
  while (unit_tiles > kCodeStageTiles && 10 * units(unit_tiles) < 7 * slots) unit_tiles /= 2;
  if (!stochastic) return unit_tiles;
  const bool one_full_wave = units(unit_tiles) <= slots && 10 * units(unit_tiles) >= 9 * slots;
  return one_full_wave || units(kUnitTiles) >= 3 * slots ? unit_tiles : kCodeStageTiles;
}
// Whether the CTAs' units are dealt in turn (CTA c takes units c, c + ctas, ...) instead of one run of
// consecutive units each: for the kernels with both copies, tensor scaling and rounding to nearest
// (quant_may_deal_units), where a matrix has at least 32 CTAs and at least three units a CTA. Dealt, the CTAs work
// on neighbouring units at any moment, so the columnwise copy's 128-byte column lines go out together for
// neighbouring rows of that copy; in runs, they go out spread over the whole copy, whose rows are as long as x has
// rows. On the H200 (bench/RESULTS.md, 2026-12-03), bf16 graph us, runs -> dealt: per tensor both 229376 x 4096
// 1860 -> 1580, 196608 x 2048 793 -> 662, 16384 x 28672 839 -> 803, stacked 8 x 28672 x 4096 16x16 1840 -> 1614;
// up to two waves of units within 1.5% either way; stacked weights of 128 experts (4 CTAs an expert) 0.4-2.3%
// slower, and the rowwise-only and columnwise-only kernels (stochastic rounding) and grouped tokens no faster, so
// those keep runs. (Row scaling with both copies takes the row pass wherever its rows fit, so its both-copies
// kernel, which wider rows take, was not measured dealt and keeps runs.)
template <bool kRowwise, bool kColwise, bool kRowScaled, bool kStochastic>
constexpr bool quant_may_deal_units() {
  return kRowwise && kColwise && !kRowScaled && !kStochastic;
}
__host__ __device__ constexpr bool quant_units_dealt(int64_t units, int64_t ctas) {
  return ctas >= 32 && units >= 3 * ctas;
}
// kStackedFlat (quantize_grouped's stacked weights in one grid, which takes their amaxes itself): units of
// kCodeStageTiles tiles (64 KB of input), and the amaxes taken up to kStackedFlatAmaxLead units (32 MB of input)
// ahead of the unit a CTA quantizes, so that its second read finds the unit in L2 (50 MB on the H100 and the
// H200). On the H100 (bench/RESULTS.md, 2026-12-07, graph us, bf16, 16x16 blocks), against an amax pass and then
// whole units (8 tiles): Qwen3-30B-A3B's FC1 experts 841 -> 802, FC2's 467 -> 408, Mixtral's 2049 -> 1917. With
// the amaxes taken in the kernel, whole units gained only 0.5-4% and half units (4 tiles) lost 5% on FC1; leads
// of 256 and 1024 units ran within 0.6% of 512 (1.7% with 1x16 blocks).
constexpr int64_t kStackedFlatAmaxLead = 512;
constexpr int kCodeStageBytes = kCodeStageTiles * kQuantTileCols / 2, kScaleStageBytes = kUnitTiles * kQuantTileCols / 16;
// A lane holds its patch in 64 registers; at most 128 per thread gives 4 CTAs, 16 warps, per SM.
constexpr int kQuantMinCtasPerSm = 4;
// Tile columns of a tensor `cols` wide (the kernel's tiles_k; quantize_run rounds the grid with it).
__host__ __device__ constexpr int64_t quant_tiles_k(int64_t cols) { return (cols + kQuantTileCols - 1) / kQuantTileCols; }
// Tile and unit indices are 32-bit; quantize_can_implement refuses more tiles than this (2^42 elements).
constexpr int64_t kMaxQuantTiles = int64_t{1} << 30;

// The transpose of an 8 x 8 matrix of 4-bit codes held a row a word (nibble c of w[k] is element (k, c)), in
// place: elements (k, c) and (c, k) trade places by three exchanges between rows 4, 2 and 1 apart, of the
// elements whose column differs from their row in that bit; the first two move whole bytes (one byte permute
// an output word), the last nibbles (a shift and a masked merge each). 32 instructions for 64 codes.
__device__ __forceinline__ void transpose_code_nibbles(uint32_t (&w)[8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t a = w[k], b = w[k + 4];
    w[k] = __byte_perm(a, b, 0x5410), w[k + 4] = __byte_perm(a, b, 0x7632);
  }
#pragma unroll
  for (int k = 0; k < 8; k += (k % 2 ? 3 : 1)) {  // rows 0, 1, 4, 5 with rows 2, 3, 6, 7
    const uint32_t a = w[k], b = w[k + 2];
    w[k] = __byte_perm(a, b, 0x6240), w[k + 2] = __byte_perm(a, b, 0x7351);
  }
#pragma unroll
  for (int k = 0; k < 8; k += 2) {
    const uint32_t a = w[k], b = w[k + 1];
    w[k] = (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u), w[k + 1] = ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);
  }
}

// Where a lane's patch lies in its warp's tile, for an input type.
template <class InT>
struct QuantLane {
  static constexpr int kVec = Element<InT>::kPerVector;  // elements per 16-byte vector: 8 or 4
  static constexpr int kLanesK = kQuantTileCols / kVec;  // lanes across the tile's columns: 8 or 16
  static constexpr int kBlockLanes = 16 / kVec;          // lanes of one rowwise block: 2 or 4
  static constexpr int kGroups = 32 / kLanesK;           // 16-row groups in a tile: 4 or 2
  static constexpr int kTileRows = 16 * kGroups;         // 64 or 32
  static constexpr int kTileBlocks = kQuantTileCols / 16;  // rowwise blocks across a tile row: 4
  // Rows whose rowwise scales a lane computes: rows kBlockLanes * j + q of its group, q = lane % kBlockLanes.
  static constexpr int kOwnedRows = 16 / kBlockLanes;
};

// Grouped tokens (quantize_grouped.cuh, a mixture of experts' tokens sorted by expert): the kernel's rows are then a
// padded row space in which group g's tokens offsets[g - 1] .. offsets[g] - 1 (from 0 for g = 0) start at padded
// row padded_ends[g - 1] (0) and are followed by zero rows up to padded_ends[g], a multiple of kGroupPadRows, so
// that a tile row lies in one group; rows past the last group are zeros. The columnwise copy is that of the padded
// rows (each group's transpose, side by side); the rowwise copy goes to the tokens' own rows. Amaxes are per token
// ([tokens]) for rows and per group and column ([groups, cols]) for columns, or one of each a group ([groups]).
constexpr int kGroupPadRows = 64;
// QuantRowGroups: how quantize_kernel's rows fall into groups, for its two grouped instances (the dense launches
// pass it empty): grouped tokens (kGrouped) read the first five fields, stacked matrices quantized in one flat
// grid (kStackedFlat, quantize_grouped's stacked weights) the last three.
struct QuantRowGroups {
  const int64_t* offsets;      // [groups] cumulative token ends
  const int64_t* padded_ends;  // [groups] cumulative padded ends
  int64_t groups, tokens;
  bool per_token;  // amaxes per token and per (group, column); else one a group
  int64_t matrix_rows;  // the rows of each stacked matrix
  // kStackedFlat's counters, zeroed before the launch (see flat_amax_units in quantize_kernel): [0] the next unit
  // to quantize, [1] the next unit whose amax to take, [2 + m] matrix m's units whose amax has been taken
  uint32_t* flat_counters;
  int64_t amax_lead;  // how many units ahead of the one it quantizes a CTA keeps the amaxes taken
};

// The tokens of one tile row of the padded row space.
struct GroupTileRows {
  int64_t source;  // the token of the tile's first row
  int valid;       // tokens in the tile (its first rows); the rest are zero rows
  int group;       // -1: past every group
};

// The tokens of the tile row starting at padded row p0 (a multiple of kGroupPadRows / a divisor): every lane of
// the warp calls it (a ballot per 32 groups counts the groups that end at or before p0, which is the tile's group
// while the ends do not decrease). Offsets that break their contract still give tokens within [0, tokens).
__device__ __forceinline__ GroupTileRows group_tile_rows(const QuantRowGroups& tg, int64_t p0, int tile_rows) {
  const int lane = threadIdx.x % 32;
  int64_t g = 0;
  for (int64_t e0 = 0; e0 < tg.groups; e0 += 32)
    g += __popc(__ballot_sync(0xFFFFFFFFu, e0 + lane < tg.groups && tg.padded_ends[e0 + lane] <= p0));
  GroupTileRows t{0, 0, -1};
  if (g >= tg.groups) return t;
  const int64_t start = g > 0 ? tg.offsets[g - 1] : 0, padded_start = g > 0 ? tg.padded_ends[g - 1] : 0;
  const int64_t source = start + (p0 - padded_start), last = std::min<int64_t>(tg.offsets[g], tg.tokens);
  t.group = static_cast<int>(g);
  if (source >= 0 && last > source) t.source = source, t.valid = static_cast<int>(std::min<int64_t>(last - source, tile_rows));
  return t;
}

// The block amaxes of a lane's patch (patch[i]: its vector of row i), NaN elements ignored as upstream's
// kernels do (0 if all are NaN): `col[c]` for the lane's columns (16 rows each); `row[j]` for the
// rowwise blocks of its owned rows kBlockLanes * j + q, which needs the other lanes of the block, so every
// lane of the warp must call it. With 16x16 blocks every entry is the amax of the 16 x 16 tile.
template <class InT, bool kRows, bool k2D>
__device__ __forceinline__ void patch_block_amax(const uint4 (&patch)[16], int q, float (&row)[QuantLane<InT>::kOwnedRows],
                                                 float (&col)[QuantLane<InT>::kVec]) {
  using L = QuantLane<InT>;
  if constexpr (sizeof(InT) == 2) {
    auto am = [](uint32_t a, uint32_t b) { return abs_max_xorsign<InT>(a, b); };
    uint32_t col_max[4], row_pairs[8];  // packed: column pairs 2k, 2k+1; rows 2p, 2p+1
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint4 a = patch[2 * p], b = patch[2 * p + 1];
      const uint32_t pair_max[4] = {am(a.x, b.x), am(a.y, b.y), am(a.z, b.z), am(a.w, b.w)};
#pragma unroll
      for (int k = 0; k < 4; ++k) col_max[k] = p == 0 ? pair_max[k] : am(col_max[k], pair_max[k]);
      if constexpr (kRows && !k2D) {
        const uint32_t ra = am(am(a.x, a.y), am(a.z, a.w)), rb = am(am(b.x, b.y), am(b.z, b.w));
        // rows 2p and 2p+1 side by side (the maxima of ra's halves low, of rb's high), so that one
        // exchange with the other lane of the block serves two rows
        row_pairs[p] = am(__byte_perm(ra, rb, 0x5410), __byte_perm(ra, rb, 0x7632));
      }
    }
    if constexpr (k2D) {  // the 16x16 tile: both lanes' columns
      uint32_t m = am(am(col_max[0], col_max[1]), am(col_max[2], col_max[3]));
      m = am(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      const float tile = fmaxf(xorsign_half_to_amax<InT>(m, 0), xorsign_half_to_amax<InT>(m, 1));
#pragma unroll
      for (int j = 0; j < L::kOwnedRows; ++j) row[j] = tile;
#pragma unroll
      for (int c = 0; c < L::kVec; ++c) col[c] = tile;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        col[2 * k] = xorsign_half_to_amax<InT>(col_max[k], 0);
        col[2 * k + 1] = xorsign_half_to_amax<InT>(col_max[k], 1);
      }
      if constexpr (kRows) {
#pragma unroll
        for (int p = 0; p < 8; ++p) {
          const uint32_t both = am(row_pairs[p], __shfl_xor_sync(0xFFFFFFFFu, row_pairs[p], 1));
          row[p] = xorsign_half_to_amax<InT>(both, q);  // row 2p + q
        }
      }
    }
  } else {
    float col_max[4] = {0.0f, 0.0f, 0.0f, 0.0f}, tile = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint4 v = patch[i];
      const float a[4] = {fabsf(__uint_as_float(v.x)), fabsf(__uint_as_float(v.y)), fabsf(__uint_as_float(v.z)),
                          fabsf(__uint_as_float(v.w))};
#pragma unroll
      for (int k = 0; k < 4; ++k) col_max[k] = fmaxf(col_max[k], a[k]);
      if constexpr (kRows && !k2D) {
        float m = fmaxf(fmaxf(a[0], a[1]), fmaxf(a[2], a[3]));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
        if (i % 4 == q) row[i / 4] = fmaxf(m, 0.0f);  // a block of NaNs: 0
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) col[k] = col_max[k], tile = fmaxf(tile, col_max[k]);
    if constexpr (k2D) {
      tile = fmaxf(tile, __shfl_xor_sync(0xFFFFFFFFu, tile, 1));
      tile = fmaxf(tile, __shfl_xor_sync(0xFFFFFFFFu, tile, 2));
#pragma unroll
      for (int j = 0; j < L::kOwnedRows; ++j) row[j] = tile;
#pragma unroll
      for (int c = 0; c < L::kVec; ++c) col[c] = tile;
    }
  }
}

// 16 bytes of the input (read-only during the kernel), read once: not kept in L1 (L1::no_allocate), where
// the kernel's register spills live; a streamed input evicted them, and each reload waited for L2.
// kEvictFirst: also first out of L2 (an evict_first cache policy), so that the lines the row pass left there
// stay until this kernel reads them.
template <bool kEvictFirst>
__device__ __forceinline__ uint4 load_streaming(const void* src) {
  uint4 v;
  if constexpr (kEvictFirst) {
    asm("{\n .reg .b64 policy;\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        " ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], policy;\n}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(src));
  } else {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(src));
  }
  return v;
}

// An output store; kStreaming: .cs (evict first), for outputs that should not displace the input in L2.
template <bool kStreaming, class V>
__device__ __forceinline__ void store_output(V* dst, V value) {
  if constexpr (kStreaming) {
    __stcs(dst, value);
  } else {
    *dst = value;
  }
}

// The first n of kBytes (8 or 16) staged bytes (src at a kBytes boundary) to global memory: one vector store where
// whole and aligned; a whole piece at a 4- or 8-byte boundary in words. Such pieces are common: an output row of
// rows / 16 scale bytes starts at a 4- or 8-byte boundary only when rows is a multiple of 64 but not of 256, as
// in grouped tokens' padded row space (on the H200, storing those columnwise scales a byte at a time took 11-13%
// of the grouped columnwise kernel's time with the transform; bench/RESULTS.md, 2026-12-03).
template <int kBytes, bool kStreaming = false>
__device__ __forceinline__ void store_piece(uint8_t* dst, const uint8_t* src, int n) {
  static_assert(kBytes == 16 || kBytes == 8, "8- or 16-byte pieces");
  auto store_words = [&](auto word) {  // the piece as kBytes / sizeof(word) words of word's type
    using Word = decltype(word);
#pragma unroll
    for (int w = 0; w < kBytes / static_cast<int>(sizeof(Word)); ++w)
      store_output<kStreaming>(reinterpret_cast<Word*>(dst) + w, reinterpret_cast<const Word*>(src)[w]);
  };
  if (n == kBytes && aligned(dst, kBytes)) {
    store_words(std::conditional_t<kBytes == 16, uint4, uint2>{});
  } else if (n == kBytes && aligned(dst, 8)) {
    store_words(uint2{});
  } else if (n == kBytes && aligned(dst, 4)) {
    store_words(uint32_t{});
  } else {
    for (int b = 0; b < n; ++b) store_output<kStreaming>(dst + b, src[b]);
  }
}

// Persistent CTAs, each over a contiguous run of units (see kUnitTiles) in row-major order; after the row pass,
// single tiles dealt in turn (quant_after_row_pass).
// A grid of gridDim.y > 1 quantizes that many matrices (quantize_grouped's stacked expert weights): matrix b is
// x's rows b * rows .. b * rows + rows - 1, and its amaxes, copies and block numbers (stochastic rounding's) follow
// matrix b - 1's; each takes gridDim.x CTAs. The dense launches have one.
// kStochastic: stochastic rounding (stochastic.cuh) with the seed and offset in rng_state (read on the device):
// the rowwise copy draws at the offset, the columnwise copy at the offset + 1, as quantize_options does.
// kGrouped: grouped tokens (see QuantRowGroups; rows is the padded row count), row scaling's machinery carrying
// each tile's group's amaxes.
// kStackedFlat: stacked matrices of row_groups.matrix_rows rows each (a multiple of a unit's rows), quantized as
// one [rows, cols] tensor whose units the CTAs take from a counter in order across matrices (grid y = 1); each
// unit takes its matrix's amaxes (tensor scaling), which this kernel takes too (flat_amax_units), and writes its
// columnwise outputs to its matrix's copy, which follows the one before it. (With one grid row a matrix, each CTA
// working through its own matrix's units, the stacked quantize kernel took 6-13% more time an element than a dense
// one; in one grid Qwen3-30B-A3B's FC1 experts took 858 us instead of 970, a dense tensor's time: bench/RESULTS.md,
// 2026-12-07, H100.)
// With neither, row_groups is unused (the dense launches pass it empty).
template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHardwareCvt, bool kHadamard,
          bool kStochastic, bool kGrouped = false, bool kStackedFlat = false>
__global__ void __launch_bounds__(kQuantThreads, kQuantMinCtasPerSm)
    quantize_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                    const float* __restrict__ row_amax, const float* __restrict__ col_amax,
                    uint8_t* __restrict__ row_data, uint8_t* __restrict__ row_scale, uint8_t* __restrict__ col_data,
                    uint8_t* __restrict__ col_scale, const int64_t* __restrict__ rng_state, int unit_tiles_arg,
                    bool units_dealt_arg, const QuantRowGroups row_groups) {
  using L = QuantLane<InT>;
  static_assert(!kGrouped || (kRowScaled && !k2D && kGroupPadRows % L::kTileRows == 0),
                "grouped tokens: per-tile amaxes through row scaling, 1x16 blocks, tile rows within a group");
  static_assert(!kStackedFlat || (!kRowScaled && !kGrouped && !kStochastic && !kHadamard),
                "stacked matrices in a flat grid: tensor scaling, round to nearest, no transform");
  const int64_t matrix = blockIdx.y;
  x += matrix * rows * x_row_stride;
  if (row_amax != nullptr) row_amax += matrix * (kRowScaled ? rows : 1);
  if (col_amax != nullptr) col_amax += matrix * (kRowScaled ? cols : 1);
  if (row_data != nullptr) row_data += matrix * rows * (cols / 2), row_scale += matrix * rows * (cols / 16);
  if (col_data != nullptr) col_data += matrix * cols * (rows / 2), col_scale += matrix * cols * (rows / 16);
  [[maybe_unused]] const uint64_t matrix_block0 = static_cast<uint64_t>(matrix * rows * (cols / 16));
  // kHadamard (the columnwise-only kernel): each tile's patch is transformed in place before anything reads it,
  // and from then on holds V values (bf16, or fp32 words holding bf16 values; hadamard.cuh).
  static_assert(!kHadamard || (kColwise && !kRowwise && !k2D), "the transform is of the columnwise copy, 1x16 blocks");
  // A rowwise block's two lanes share its random words (one Philox call each, exchanged); gradients are 1x16.
  static_assert(!kStochastic || (sizeof(InT) == 2 && !k2D), "stochastic rounding: 16-bit inputs, 1x16 blocks");
  using V = std::conditional_t<kHadamard, HadamardPatchElement<InT>, InT>;
  constexpr int kVec = L::kVec, kBlockLanes = L::kBlockLanes, kOwnedRows = L::kOwnedRows;
  // The fast software encode is for 16-bit inputs (whose products with r cannot underflow for r above a
  // bound) rounded to nearest, and sm_100a has the hardware conversion.
  constexpr bool kFastEncode = !kHardwareCvt && sizeof(InT) == 2 && !kStochastic;
  // Branch-free block scales (reciprocal_rn_in_range) on sm_90a, where the reciprocal is checked against
  // __frcp_rn on the GPU; sm_100a, which cannot be run here, keeps __frcp_rn.
  constexpr bool kBranchFreeScales = !kHardwareCvt;
  constexpr int kMinSubnormalExponent = Element<V>::kMinSubnormalExponent;
  // After the row pass (quant_after_row_pass): the last rows of x it read are in L2, and loads and stores that
  // leave L2 first keep them there until this kernel gets to them. (Walking the tiles bottom up, to read those
  // rows first, found about twice as much of x in L2 but measured about 1 us slower on 8192x8192 on the H200:
  // bench/RESULTS.md, b43f5ad, 2026-11-30.)
  constexpr bool kAfterRowPass = quant_after_row_pass<kRowwise, kColwise, kRowScaled, kGrouped>();
  const int unit_tiles = kAfterRowPass ? 1 : unit_tiles_arg;  // a divisor of kUnitTiles (quant_unit_tiles_for)
  constexpr bool kMayDeal = quant_may_deal_units<kRowwise, kColwise, kRowScaled, kStochastic>();
  const bool units_dealt = kAfterRowPass || (kMayDeal && units_dealt_arg);  // else runs (quant_units_dealt)
  // Each warp's rowwise outputs: its tile row's codes of kCodeStageTiles consecutive tiles and its scales
  // of the unit's tiles (a stage row holds kUnitTiles tiles' scales; a narrower unit uses part of it).
  __shared__ __align__(16) uint8_t row_code_stage[kRowwise ? kQuantWarps : 1][L::kTileRows][kCodeStageBytes];
  __shared__ __align__(16) uint8_t row_scale_stage[kRowwise ? kQuantWarps : 1][L::kTileRows][kScaleStageBytes];
  // Columnwise outputs of the CTA's current tiles (its warps' tile rows are stacked), gathered so that a
  // column's codes leave in 128-byte lines (64 with fp32) and its scales 16 bytes at a time. The codes'
  // 16-byte pieces are XOR-swizzled with the lane's column group, so that the lanes' writes spread over
  // the banks.
  constexpr int kColCodeBytes = kQuantWarps * L::kTileRows / 2, kColScaleBytes = kQuantWarps * L::kTileRows / 16;
  constexpr int kColCodePieces = kColCodeBytes / 16;
  __shared__ __align__(16) uint8_t col_code_stage[kColwise ? kQuantTileCols : 1][kColCodeBytes];
  __shared__ __align__(16) uint8_t col_scale_stage[kColwise ? kQuantTileCols : 1][kColScaleBytes];
  auto col_code_piece = [](int col, int piece) { return piece ^ (col / 8 % kColCodePieces); };
  // the global scales (row scaling) of the current tile's rows and columns
  __shared__ GlobalScale row_global[kRowwise && kRowScaled ? kQuantWarps : 1][L::kTileRows];
  __shared__ GlobalScale col_global[kColwise && kRowScaled ? kQuantWarps : 1][kQuantTileCols];
  // the rowwise blocks' inverse scales r, [block][row] so that two consecutive rows are one 8-byte read
  __shared__ __align__(8) float row_inverse[kRowwise && !k2D ? kQuantWarps : 1][L::kTileBlocks][L::kTileRows];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int kc = lane % L::kLanesK, group = lane / L::kLanesK, q = lane % kBlockLanes;
  const int block = kc / kBlockLanes;  // the lane's rowwise block within the tile
  const int tiles_k = static_cast<int>(quant_tiles_k(cols));
  const int units_k = (tiles_k + unit_tiles - 1) / unit_tiles;

  // The kernel that writes the amaxes may still be running (launch_quantize_kernel launches this grid as its
  // programmatic dependent, so that this grid's launch and set-up overlap its last wave): wait for it and its
  // amaxes here.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // Grouped tokens' rowwise copy: only the padded rows that groups use (the last padded end, on the device; the
  // launch covers the capacity, about 12% more at 128 uniform groups), shared out between the CTAs. Tiles past
  // them have no tokens and write nothing. (The columnwise copy writes zeros there, so it takes every row.)
  int64_t used_rows = rows;
  if (kGrouped && !kColwise && row_groups.groups > 0)
    used_rows = std::min<int64_t>(std::max<int64_t>(row_groups.padded_ends[row_groups.groups - 1], 0), rows);
  const int tiles_m = static_cast<int>((used_rows + L::kTileRows - 1) / L::kTileRows);
  const int n_units = (tiles_m + kQuantWarps - 1) / kQuantWarps * units_k;
  const int ctas = gridDim.x, cta = blockIdx.x;
  const int per_cta = n_units / ctas, extra = n_units % ctas;
  // kStackedFlat: each CTA takes its next unit from a counter when it starts a unit (see flat_amax_units)
  __shared__ int flat_taken;
  auto take_flat_unit = [&](uint32_t* counter) {
    if (threadIdx.x == 0) flat_taken = static_cast<int>(atomicAdd(counter, 1u));
    __syncthreads();
    const int taken = flat_taken;
    __syncthreads();  // (flat_taken may be written again)
    return taken;
  };
  const int first_unit = kStackedFlat ? take_flat_unit(row_groups.flat_counters)
                                      : (units_dealt ? cta : cta * per_cta + min(cta, extra));
  const int end_unit =
      kStackedFlat || units_dealt ? n_units : first_unit + per_cta + (cta < extra ? 1 : 0);
  // (read from the launch's constants where used: a register held for it made ptxas spill in the per-tensor kernel)
  auto unit_step = [&]() { return kAfterRowPass || (kMayDeal && units_dealt_arg) ? static_cast<int>(gridDim.x) : 1; };
  const int64_t row_data_pitch = cols / 2, row_scale_pitch = cols / 16;
  // (a stacked matrix's columnwise copy is [cols, its rows])
  const int64_t col_rows = kStackedFlat ? row_groups.matrix_rows : rows;
  const int64_t col_data_pitch = col_rows / 2, col_scale_pitch = col_rows / 16;

  // how many of the 16 rows from row0 on lie inside the tensor (so per-row tests are 32-bit)
  auto rows_inside = [&](int64_t row0) { return static_cast<int>(std::max<int64_t>(std::min<int64_t>(rows - row0, 16), 0)); };

  uint64_t seed = 0, row_draw = 0;  // stochastic rounding: the rowwise copy's offset; the columnwise copy's is + 1
  if constexpr (kStochastic) seed = static_cast<uint64_t>(rng_state[0]), row_draw = static_cast<uint64_t>(rng_state[1]);
  const uint64_t col_draw = row_draw + 1;

  // tensor scaling: one global scale per direction for the whole call
  GlobalScale tensor_row_global{}, tensor_col_global{};
  // Whether this lane's rows / columns of the current tile (row scaling: the lane's share of the tile's
  // amaxes) are special: a NaN amax (a NaN element; the fast encode is not for NaN) or a global scale
  // outside block_reciprocals_in_range. On sm_90a a tile where no lane's flag is set computes its block
  // scales with no branch (side by side; with __frcp_rn's branch each block waited for the one before) and
  // may take the fast encode; other tiles take __frcp_rn and the exact encode.
  bool rows_special = false, cols_special = false;
  auto special = [](float amax, GlobalScale g) { return isnan(amax) || !block_reciprocals_in_range(g); };
  // 16x16 blocks, both copies: the columnwise codes are the rowwise codes transposed (a 16 x 16 block has one
  // scale and both copies one global scale, so each element has one code), so both copies take the rowwise amax
  // (callers pass the tensor's amax for both); the transpose costs about half an instruction a code against the
  // seven or so of encoding it again, and took the 16-bit kernels' spills away (ptxas: 104 and 48 bytes to 0).
  constexpr bool kTransposeCodes = k2D && kRowwise && kColwise;
  // kStackedFlat: the units of one matrix (units never straddle two: matrix_rows is a multiple of a unit's rows)
  [[maybe_unused]] const int flat_matrix_units =
      kStackedFlat ? static_cast<int>(row_groups.matrix_rows / (kQuantWarps * L::kTileRows)) * units_k : 1;
  // matrix m's amaxes (tensor scaling: kStackedFlat's matrix m, else the grid row's matrix, m = 0)
  auto load_tensor_globals = [&](int64_t m) {
    const float* col_amax_source = kTransposeCodes ? row_amax : col_amax;
    float row_m = 0.0f, col_m = 0.0f;
    if constexpr (kStackedFlat) {
      // this kernel takes the amaxes (flat_amax_units): wait until every unit of the matrix has added its own, then
      // read them from L2 (the read-only path may hold a line of them from before)
      const uint32_t* taken = row_groups.flat_counters + 2 + m;
      while (load_acquire(taken) < static_cast<uint32_t>(flat_matrix_units)) __nanosleep(64);
      if (kRowwise) row_m = __ldcg(row_amax + m);
      if (kColwise) col_m = __ldcg(col_amax_source + m);
    } else {
      if (kRowwise) row_m = row_amax[m];
      if (kColwise) col_m = col_amax_source[m];
    }
    if (kRowwise) tensor_row_global = global_scale(row_m), rows_special = special(row_m, tensor_row_global);
    if (kColwise) tensor_col_global = global_scale(col_m), cols_special = special(col_m, tensor_col_global);
  };
  if constexpr (!kRowScaled && !kStackedFlat) load_tensor_globals(0);
  // kStackedFlat: the matrix whose amaxes are loaded (none yet)
  [[maybe_unused]] int64_t flat_matrix = -1;

  // Whether an output's 16-byte pieces (its scales' kColScaleBytes pieces) are aligned wherever they start:
  // then whole tiles leave with plain vector stores and no per-piece tests.
  auto vector_ok = [](const uint8_t* base, int64_t pitch, int bytes) { return aligned(base, bytes) && pitch % bytes == 0; };
  const bool row_data_vec = kRowwise && vector_ok(row_data, row_data_pitch, 16);
  const bool col_data_vec = kColwise && vector_ok(col_data, col_data_pitch, 16);
  const bool col_scale_vec = kColwise && vector_ok(col_scale, col_scale_pitch, kColScaleBytes);

  // Writes the staged rowwise bytes of the warp's tile rows to rows row0 .. min(row0 + tile rows, row_end) - 1 of
  // global memory: kWidth bytes of each row, from tensor column byte `first_byte` of a row `pitch`
  // bytes long, in 16-byte pieces where aligned.
  auto flush_rows = [&](uint8_t* dst, int64_t pitch, int64_t first_byte, const uint8_t* stage, auto width,
                        int64_t row0, int64_t row_end, bool vec) {
    constexpr int kWidth = decltype(width)::value, kPieces = kWidth / 16, kRowsPerPass = 32 / kPieces;
    __syncwarp();  // every lane's bytes are staged
    if (vec && row0 + L::kTileRows <= row_end && first_byte + kWidth <= pitch) {  // whole: no tests per piece
      const int r = lane / kPieces, piece = lane % kPieces;
      uint8_t* d = dst + (row0 + r) * pitch + first_byte + 16 * piece;
      const uint8_t* s = stage + r * kWidth + 16 * piece;
#pragma unroll
      for (int k = 0; k < L::kTileRows / kRowsPerPass; ++k)
        *reinterpret_cast<uint4*>(d + k * kRowsPerPass * pitch) =
            *reinterpret_cast<const uint4*>(s + k * kRowsPerPass * kWidth);
    } else {
      for (int id = lane; id < L::kTileRows * kPieces; id += 32) {
        const int r = id / kPieces, piece = id % kPieces;
        const int64_t offset = first_byte + 16 * piece;
        const int n = static_cast<int>(std::min<int64_t>(pitch - offset, 16));
        if (row0 + r >= row_end || n <= 0) continue;
        store_piece<16>(dst + (row0 + r) * pitch + offset, stage + r * kWidth + 16 * piece, n);
      }
    }
    __syncwarp();  // the stage may be refilled
  };

  // Row scaling: the amaxes of a tile's rows and columns, lane l holding those of rows/columns l and
  // l + 32, are loaded a tile ahead and turned into the warp's shared global scales at the end of the
  // tile before (only when the tile row / tile column changes), so a tile reads them with no wait.
  constexpr int kRowAmaxPerLane = (L::kTileRows + 31) / 32, kColAmaxPerLane = kQuantTileCols / 32;
  float next_row_amax[kRowAmaxPerLane], next_col_amax[kColAmaxPerLane];
  // (Grouped tokens: those of the tile's group, `tile_rows`; a tile past every group has zero amaxes.)
  auto load_amaxes = [&](int tm, int tk, bool new_tile_col, const GroupTileRows& tile_rows) {
    if constexpr (kGrouped) {
      const int64_t g = tile_rows.group;
#pragma unroll
      for (int k = 0; k < kRowAmaxPerLane; ++k) {
        if constexpr (kRowwise) {
          const int64_t token = tile_rows.source + std::min(lane + 32 * k, std::max(tile_rows.valid - 1, 0));
          next_row_amax[k] = g < 0 ? 0.0f : row_amax[row_groups.per_token ? token : g];
        }
      }
#pragma unroll
      for (int k = 0; k < kColAmaxPerLane; ++k) {
        if constexpr (kColwise) {
          const int64_t col = std::min<int64_t>(int64_t{tk} * kQuantTileCols + lane + 32 * k, cols - 1);
          next_col_amax[k] = g < 0 ? 0.0f : col_amax[row_groups.per_token ? g * cols + col : g];
        }
      }
      return;
    }
    if constexpr (kRowScaled && kRowwise) {
#pragma unroll
      for (int k = 0; k < kRowAmaxPerLane; ++k)
        next_row_amax[k] = row_amax[std::min<int64_t>(int64_t{tm} * L::kTileRows + lane + 32 * k, rows - 1)];
    }
    if (kRowScaled && kColwise && new_tile_col) {
#pragma unroll
      for (int k = 0; k < kColAmaxPerLane; ++k)
        next_col_amax[k] = col_amax[std::min<int64_t>(int64_t{tk} * kQuantTileCols + lane + 32 * k, cols - 1)];
    }
  };

  auto publish_global_scales = [&](bool new_tile_row, bool new_tile_col) {
    __syncwarp();  // every lane is done reading the previous tile's
    if (kRowwise && new_tile_row) {
      rows_special = false;
#pragma unroll
      for (int k = 0; k < kRowAmaxPerLane; ++k)
        if (lane + 32 * k < L::kTileRows) {
          const GlobalScale g = global_scale(next_row_amax[k]);
          row_global[warp][lane + 32 * k] = g;
          rows_special = rows_special || special(next_row_amax[k], g);
        }
    }
    if (kColwise && new_tile_col) {
      cols_special = false;
#pragma unroll
      for (int k = 0; k < kColAmaxPerLane; ++k) {
        const GlobalScale g = global_scale(next_col_amax[k]);
        col_global[warp][lane + 32 * k] = g;
        cols_special = cols_special || special(next_col_amax[k], g);
      }
    }
    __syncwarp();
  };

  // The CTA's units in turn, its warps in step: a unit is unit_tiles consecutive tiles (the last of a row
  // may have fewer) of kQuantWarps consecutive tile rows, one per warp.
  auto unit_tm = [&](int unit) { return unit / units_k * kQuantWarps + warp; };  // row-major
  auto unit_first_tk = [&](int unit) { return unit % units_k * unit_tiles; };
  auto unit_end_tk = [&](int unit) { return std::min(unit_first_tk(unit) + unit_tiles, tiles_k); };
  int unit = first_unit, tm = unit_tm(unit), tk = unit_first_tk(unit);

  // A lane's patch: rows [first, first + 8) of its 16 rows of tile (tm, tk) into dst[0..8), straight into
  // registers. M and K are multiples of 16 wherever a 16-element block is read whole, so each block is
  // wholly inside or outside; outside reads as zeros and is not stored. The next tile's patch is loaded as
  // soon as this tile's codes are made, so its loads are in flight during the flushes instead of waited
  // for at the top of the tile. (Loading half of it earlier, into the registers the encode's first half
  // frees, made ptxas spill in the encode loop.)
  uint4 patch[16];
  struct PatchSource {
    const InT* first_row;  // the lane's vector in the patch's row 0
    int rows;              // how many of its rows are read (the others are zeros)
  };
  auto patch_source = [&](int tm_, int tk_, const GroupTileRows& tile_rows) {
    const int64_t c0 = int64_t{tk_} * kQuantTileCols + kc * kVec;
    if constexpr (kGrouped) {  // the group's tokens, then zero rows
      const int64_t r0 = tile_rows.source + 16 * group;
      return PatchSource{x + r0 * x_row_stride + c0, c0 < cols ? std::max(std::min(tile_rows.valid - 16 * group, 16), 0) : 0};
    }
    const int64_t r0 = int64_t{tm_} * L::kTileRows + 16 * group;
    return PatchSource{x + r0 * x_row_stride + c0, c0 < cols ? rows_inside(r0) : 0};
  };
  // the tokens of a tile row (grouped tokens; warp-uniform, every lane calls it)
  auto tile_rows_of = [&](int tm_) {
    if constexpr (kGrouped) return group_tile_rows(row_groups, int64_t{tm_} * L::kTileRows, L::kTileRows);
    return GroupTileRows{0, 0, 0};
  };
  auto load_patch_rows = [&](uint4* dst, PatchSource source, int first) {
    const InT* src = source.first_row + first * x_row_stride;
    if (first + 8 <= source.rows) {  // the common case, with no per-row tests or zeros
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[i] = load_streaming<kAfterRowPass>(src + i * x_row_stride);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        dst[i] = first + i < source.rows ? load_streaming<kAfterRowPass>(src + i * x_row_stride)
                                         : make_uint4(0, 0, 0, 0);
    }
  };
  // The columnwise-only kernels of grouped tokens that round to nearest (kStagedPatch) take the next tile's patch
  // through shared memory instead: its 16 copies (cp.async, no registers held) are issued as soon as this tile's
  // patch has been read out of the stage and used, so they are in flight during the whole tile's encode, not only
  // its flushes; the tile's top waits for them and reads the lane's own vectors back (each lane stages and reads only
  // its own, so no barrier). On the H100 (bench/RESULTS.md, 2026-12-06) that took 3-4% off grouped tokens'
  // row-scaled calls (65536 x 2048, 128 groups, with and without the transform) in three runs. Measured and not
  // taken for the dense columnwise-only kernels: 0.5-4% faster with the transform on four shapes but 1.3% slower on
  // 8192 x 14336, 3.9-4.4% slower without it (bound by DRAM, they pay for the extra shared-memory reads, we
  // suppose) and 3-4% with stochastic rounding and the transform (more spills).
  constexpr bool kStagedPatch = kGrouped && kColwise && !kRowwise && !kStochastic;
  __shared__ __align__(16) uint4 patch_stage[kStagedPatch ? kQuantWarps : 1][kStagedPatch ? 16 : 1][32];
  auto stage_patch = [&](PatchSource source) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      cp_async_16_streaming<kAfterRowPass>(&patch_stage[warp][i][lane], source.first_row + i * x_row_stride,
                                           i < source.rows);
    cp_async_commit();
  };
  auto unstage_patch = [&]() {
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < 16; ++i) patch[i] = patch_stage[warp][i][lane];
  };
  // kStackedFlat takes the matrices' amaxes itself, a unit at a time, ahead of their quantization. Before it
  // quantizes unit u, a CTA takes the amaxes of the units counter [1] hands out (atomicMax of each warp's |x| bits
  // into its matrix's amaxes, then [2 + m] counts the unit) until the counter reaches the end of u's matrix, or u
  // + amax_lead if further; then it waits until its matrix has all its units counted. A CTA waits only for units
  // already handed out, to CTAs running, which take their amaxes before they wait for anything, so the wait ends
  // whatever the launch's residency. The unit's data is read twice, the second time while most of it is still in
  // L2: the lead keeps the amaxes far enough ahead that the quantization seldom waits, and near enough that the
  // units in between fit in L2.
  auto flat_amax_units = [&](int unit_) {
    if constexpr (kStackedFlat) {
      const int matrix_end = (unit_ / flat_matrix_units + 1) * flat_matrix_units;
      const int64_t target = std::min<int64_t>(std::max<int64_t>(matrix_end, unit_ + row_groups.amax_lead), n_units);
      uint32_t* const counters = row_groups.flat_counters;
      while (true) {
        if (threadIdx.x == 0) {
          const uint32_t next = *reinterpret_cast<volatile uint32_t*>(counters + 1);
          flat_taken = next < target ? static_cast<int>(atomicAdd(counters + 1, 1u)) : n_units;
        }
        __syncthreads();
        const int item = flat_taken;
        __syncthreads();
        if (item >= n_units) break;
        const int item_tm = unit_tm(item);
        uint32_t bits = 0;
        for (int tk_ = unit_first_tk(item); tk_ < unit_end_tk(item); ++tk_) {
          const PatchSource source = patch_source(item_tm, tk_, GroupTileRows{0, 0, 0});
          load_patch_rows(patch, source, 0), load_patch_rows(patch + 8, source, 8);
#pragma unroll
          for (int i = 0; i < 16; ++i)
#pragma unroll
            for (int e = 0; e < kVec; ++e)
              bits = max(bits, float_abs_bits(Element<InT>::word_element_to_float(&patch[i].x, e)));
        }
        bits = warp_max_bits(bits);
        const int64_t m = item / flat_matrix_units;
        if (lane == 0) {  // (the pointers are the kernel's const inputs; this kernel alone writes them)
          atomicMax(reinterpret_cast<unsigned int*>(const_cast<float*>(row_amax)) + m, bits);
          if (col_amax != nullptr && col_amax != row_amax)
            atomicMax(reinterpret_cast<unsigned int*>(const_cast<float*>(col_amax)) + m, bits);
          __threadfence();
        }
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 2 + m, 1u);
      }
    }
  };
  if (kStackedFlat && first_unit < end_unit) flat_amax_units(first_unit);
  GroupTileRows tile_rows = first_unit < end_unit ? tile_rows_of(tm) : GroupTileRows{0, 0, -1};
  if (first_unit < end_unit) {
    const PatchSource first = patch_source(tm, tk, tile_rows);
    if constexpr (kStagedPatch) {
      stage_patch(first);
    } else {
      load_patch_rows(patch, first, 0), load_patch_rows(patch + 8, first, 8);
    }
  }
  if (kRowScaled && first_unit < end_unit) load_amaxes(tm, tk, true, tile_rows), publish_global_scales(true, true);
  [[maybe_unused]] int flat_next = n_units;  // kStackedFlat: the CTA's unit after this one
  while (unit < end_unit) {
    const int64_t m0 = int64_t{tm} * L::kTileRows, k0 = int64_t{tk} * kQuantTileCols;
    if (kStackedFlat && tk == unit_first_tk(unit)) flat_next = take_flat_unit(row_groups.flat_counters);
    if constexpr (kStackedFlat) {  // a unit's tile rows lie in one matrix (matrix_rows: whole units)
      if (m0 < flat_matrix * col_rows || m0 >= (flat_matrix + 1) * col_rows)
        flat_matrix = m0 / col_rows, load_tensor_globals(flat_matrix);
    }
    const bool unit_ends = tk + 1 == unit_end_tk(unit);
    const int next_unit = unit_ends ? (kStackedFlat ? flat_next : unit + unit_step()) : unit;
    const int next_tm = unit_ends ? unit_tm(next_unit) : tm, next_tk = unit_ends ? unit_first_tk(next_unit) : tk + 1;
    const bool has_next = next_unit < end_unit;
    // the next tile's tokens (grouped: each tile loads its group's amaxes and publishes its global scales)
    const GroupTileRows next_tile_rows = has_next && next_tm != tm ? tile_rows_of(next_tm) : tile_rows;
    const PatchSource next_source = patch_source(next_tm, next_tk, next_tile_rows);  // read only if has_next
    // `patch` holds this tile (its loads were issued during the tile before, see load_patch_rows).
    if (kRowScaled && has_next) load_amaxes(next_tm, next_tk, next_tk != tk, next_tile_rows);
    // Where this tile's rowwise outputs go: its own rows, or its group's tokens. (Evaluated where used: a value
    // live across the encode made ptxas spill in the per-tensor both-copies kernel.)
    auto out_row0 = [&]() -> int64_t { return kGrouped ? tile_rows.source : m0; };
    auto out_row_end = [&]() -> int64_t { return kGrouped ? tile_rows.source + tile_rows.valid : rows; };
    float row_amax_of[kOwnedRows], col_amax_of[kVec];
    if constexpr (kStagedPatch) unstage_patch();
    if constexpr (kHadamard) hadamard_patch<InT>(patch);
    patch_block_amax<V, kRowwise, k2D>(patch, q, row_amax_of, col_amax_of);
    // The stage may take the next tile's patch: this lane read its own vectors out of it above, in program order
    // before these copies (the copies' asm is a compiler barrier for memory), and has used every one of them.
    if (kStagedPatch && has_next) stage_patch(next_source);

    // Block scales: sdec bytes to the stages, inverses r kept (rowwise: in shared memory, read per row pair).
    // Returns whether this lane's blocks meet fast_encode_ok. Two instances: with no special row or column
    // in the tile (see rows_special), and with __frcp_rn (and no fast encode) where there is one.
    float col_r[kColwise ? kVec : 1];
    float row_r_2d = 0.0f;  // 16x16 blocks: one rowwise r for the whole patch
    auto block_scales = [&](auto in_range) {
      constexpr bool kInRange = decltype(in_range)::value;
      bool fast_ok = kFastEncode && kInRange;
      if constexpr (kRowwise) {
        uint8_t* scale_dst = &row_scale_stage[warp][16 * group + q][tk % kUnitTiles * L::kTileBlocks + block];
#pragma unroll
        for (int j = 0; j < kOwnedRows; ++j, scale_dst += kBlockLanes * kScaleStageBytes) {
          const int i = kBlockLanes * j + q;
          const GlobalScale g = kRowScaled ? row_global[warp][16 * group + i] : tensor_row_global;
          const BlockEncoding enc = encode_block_scale<kInRange>(row_amax_of[j], g);
          if constexpr (kFastEncode) fast_ok = fast_ok & fast_encode_ok<kMinSubnormalExponent>(row_amax_of[j], enc.inverse);
          if constexpr (k2D) {
            row_r_2d = enc.inverse;
          } else {
            row_inverse[warp][block][16 * group + i] = enc.inverse;
          }
          *scale_dst = static_cast<uint8_t>(enc.scale_byte);
        }
      }
      if constexpr (kColwise) {
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          const GlobalScale g = kRowScaled ? col_global[warp][kc * kVec + c] : tensor_col_global;
          const BlockEncoding enc = encode_block_scale<kInRange>(col_amax_of[c], g);
          col_r[c] = enc.inverse;
          if constexpr (kFastEncode) fast_ok = fast_ok & fast_encode_ok<kMinSubnormalExponent>(col_amax_of[c], enc.inverse);
          col_scale_stage[kc * kVec + c][warp * (L::kTileRows / 16) + group] = static_cast<uint8_t>(enc.scale_byte);
        }
      }
      return fast_ok;
    };
    bool fast_ok;
    if constexpr (kBranchFreeScales) {
      const bool plain = __all_sync(0xFFFFFFFFu, !rows_special && !cols_special);
      fast_ok = plain ? block_scales(std::true_type{}) : block_scales(std::false_type{});
    } else {
      fast_ok = block_scales(std::false_type{});
    }
    if constexpr (kRowwise && !k2D) __syncwarp();  // row_inverse written by the rows' owners

    // Codes, two rows at a time, to the stages: a lane's kVec codes of a row; a columnwise byte holds rows
    // 2p and 2p+1 of a column, a columnwise word the half's 8 rows. Row i0 of the half is staged at
    // row_dst + (i0 - 8 * half) * kCodeStageBytes. The exact encode and the fast one (where every block of
    // the tile allows it) are two instances of this code; one runs per tile.
    auto encode_patch = [&](auto fast) {
      constexpr bool kFast = decltype(fast)::value;
      uint8_t* row_dst = &row_code_stage[warp][16 * group][tk % kCodeStageTiles * (kQuantTileCols / 2) + kc * kVec / 2];
      // The columnwise-only kernels unroll the halves (no patch moves between them; still 128 registers, no
      // spills; 0-0.6 us of row-scaled 8192x8192 / 16384x4096 on the H200, bench/RESULTS.md, a32b33d,
      // 2026-11-30); the others, not measured that way, keep one loop body.
#pragma unroll(kRowwise ? 1 : 2)
      for (int half = 0; half < 2; ++half, row_dst += 8 * kCodeStageBytes) {
        constexpr bool kEncodeCols = kColwise && !kTransposeCodes;
        uint32_t col_words[kEncodeCols ? kVec : 1], col_signs[kEncodeCols && kFast ? kVec : 1];
        [[maybe_unused]] uint32_t half_codes[kTransposeCodes ? 8 : 1];  // the half's rowwise codes, row by row
#pragma unroll
        for (int c = 0; c < (kEncodeCols ? kVec : 1); ++c) col_words[c] = code_word_start<kHardwareCvt, 8>();
#pragma unroll
        for (int c = 0; c < (kEncodeCols && kFast ? kVec : 1); ++c) col_signs[c] = 0u;
        // the fast encode takes the row pairs last to first: a column's sign nibbles are pushed from the top
#pragma unroll
        for (int step = 0; step < 4; ++step) {
          const int pp = kFast ? 3 - step : step;
          [[maybe_unused]] const int i0 = 8 * half + 2 * pp;  // rows i0, i0 + 1 of the patch (rowwise)
          const uint4 vec[2] = {patch[2 * pp], patch[2 * pp + 1]};  // rows i0, i0 + 1 (the halves' move below)
          float v[2][kVec];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < kVec; ++c) v[h][c] = Element<V>::word_element_to_float(&vec[h].x, c);
          if constexpr (kRowwise) {
            const float2 r = k2D ? make_float2(row_r_2d, row_r_2d)
                                 : *reinterpret_cast<const float2*>(&row_inverse[warp][block][16 * group + i0]);
            uint32_t codes[2];
            if constexpr (kFast) {
              codes[0] = encode_codes_fast(v[0], r.x), codes[1] = encode_codes_fast(v[1], r.y);
            } else {
              codes[0] = encode_codes<kHardwareCvt, kVec>(v[0], r.x), codes[1] = encode_codes<kHardwareCvt, kVec>(v[1], r.y);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              uint8_t* dst = row_dst + (2 * pp + h) * kCodeStageBytes;
              if constexpr (kVec == 8) {
                *reinterpret_cast<uint32_t*>(dst) = codes[h];
              } else {
                *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(codes[h]);
              }
              // (a row of kVec = 4 codes is the low half of a word: the transpose's upper columns stay zero)
              if constexpr (kTransposeCodes) half_codes[2 * pp + h] = kVec == 8 ? codes[h] : codes[h] & 0xFFFFu;
            }
          }
          if constexpr (kEncodeCols) {
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              if constexpr (kFast) {
                const float lo = fast_encode_product(v[0][c], col_r[c]), hi = fast_encode_product(v[1][c], col_r[c]);
                col_words[c] += (e2m1_unsaturated_magnitude_bits(lo) + (e2m1_unsaturated_magnitude_bits(hi) << 4))
                                << (8 * pp);
                col_signs[c] = push_sign_nibble(push_sign_nibble(col_signs[c], hi), lo);
              } else {
                col_words[c] += e2m1_byte<kHardwareCvt>(__fmul_rn(v[0][c], col_r[c]), __fmul_rn(v[1][c], col_r[c]))
                                << (8 * pp);
              }
            }
          }
        }
        if constexpr (kColwise) {
          // the column's bytes of the group's rows 8 * half ... + 7, within the CTA's rows
          const int offset = warp * (L::kTileRows / 2) + group * 8 + half * 4;
          if constexpr (kTransposeCodes) transpose_code_nibbles(half_codes);  // half_codes[c]: column c's codes
#pragma unroll
          for (int c = 0; c < kVec; ++c) {
            const int col = kc * kVec + c;
            if constexpr (kEncodeCols && kFast) col_words[c] |= col_signs[c] & kSignNibbleBits;
            *reinterpret_cast<uint32_t*>(&col_code_stage[col][col_code_piece(col, offset / 16) * 16 + offset % 16]) =
                kTransposeCodes ? half_codes[c] : col_words[c];
          }
        }
        // the second half's rows move to where the loop body reads the first half's
#pragma unroll
        for (int i = 0; i < 8; ++i) patch[i] = patch[i + 8];
      }
    };
    // Stochastic rounding, the only encode of its kernels, to the same stages. Each block draws its random words
    // in the lanes that encode it: a rowwise block's two lanes each draw one row of a row pair and swap the
    // halves the other needs; a columnwise block is its lane's, encoded a column at a time (the half's two words
    // of one draw), which keeps one column's words live instead of every column's (ptxas spilled with them all).
    auto encode_patch_stochastic = [&]() {
      if constexpr (kStochastic) {  // (compiled only into the stochastic kernels, whose lanes hold 8 elements)
        const uint64_t row_blocks = static_cast<uint64_t>(cols / 16), col_blocks = static_cast<uint64_t>(rows / 16);
        [[maybe_unused]] const uint64_t row_block0 =
            matrix_block0 + static_cast<uint64_t>(out_row0() + 16 * group) * row_blocks + k0 / 16 + block;
        [[maybe_unused]] const uint64_t col_block0 =
            matrix_block0 + static_cast<uint64_t>(k0 + kc * kVec) * col_blocks + m0 / 16 + group;
        uint8_t* row_dst = &row_code_stage[warp][16 * group][tk % kCodeStageTiles * (kQuantTileCols / 2) + kc * kVec / 2];
        // each column's words drawn once a tile; the second half's kept from the first (no both-copies stochastic
        // kernel is declared: it spilled, and measured slower than the rowwise-only and columnwise-only ones)
        [[maybe_unused]] uint2 second_half_words[kColwise ? kVec : 1];
#pragma unroll(kRowwise ? 1 : 2)
        for (int half = 0; half < 2; ++half, row_dst += 8 * kCodeStageBytes) {
          auto element = [&](int i, int c) { return Element<V>::word_element_to_float(&patch[i].x, c); };
          if constexpr (kRowwise) {
#pragma unroll
            for (int pp = 0; pp < 4; ++pp) {
              const int i0 = 8 * half + 2 * pp;  // rows i0, i0 + 1 of the patch
              const float2 r = *reinterpret_cast<const float2*>(&row_inverse[warp][block][16 * group + i0]);
              float v[2][kVec];
#pragma unroll
              for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int c = 0; c < kVec; ++c) v[h][c] = element(2 * pp + h, c);
              // this lane draws row i0 + q; its half of a block is words 2q and 2q + 1
              const uint4 b = block_random_bits(seed, row_draw, row_block0 + static_cast<uint64_t>(i0 + q) * row_blocks);
              const uint2 own = q ? make_uint2(b.z, b.w) : make_uint2(b.x, b.y);
              const uint2 give = q ? make_uint2(b.x, b.y) : make_uint2(b.z, b.w);
              const uint2 got = make_uint2(__shfl_xor_sync(0xFFFFFFFFu, give.x, 1), __shfl_xor_sync(0xFFFFFFFFu, give.y, 1));
              *reinterpret_cast<uint32_t*>(row_dst + 2 * pp * kCodeStageBytes) = encode_codes_stochastic(v[0], r.x, q ? got : own);
              *reinterpret_cast<uint32_t*>(row_dst + (2 * pp + 1) * kCodeStageBytes) =
                  encode_codes_stochastic(v[1], r.y, q ? own : got);
            }
          }
          if constexpr (kColwise) {
            const int offset = warp * (L::kTileRows / 2) + group * 8 + half * 4;  // as in encode_patch
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              uint2 words;  // the half's 8 rows' random bytes
              if (half == 0) {
                const uint4 b = block_random_bits(seed, col_draw, col_block0 + c * col_blocks);
                words = make_uint2(b.x, b.y), second_half_words[c] = make_uint2(b.z, b.w);
              } else {
                words = second_half_words[c];
              }
              float v[8];
#pragma unroll
              for (int i = 0; i < 8; ++i) v[i] = element(i, c);
              const int col = kc * kVec + c;
              *reinterpret_cast<uint32_t*>(&col_code_stage[col][col_code_piece(col, offset / 16) * 16 + offset % 16]) =
                  encode_codes_stochastic(v, col_r[c], words);
            }
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) patch[i] = patch[i + 8];
        }
      }
    };
    if constexpr (kStochastic) {
      encode_patch_stochastic();
    } else if constexpr (kFastEncode) {
      if (__all_sync(0xFFFFFFFFu, fast_ok)) {
        encode_patch(std::true_type{});
      } else {
        encode_patch(std::false_type{});
      }
    } else {
      encode_patch(std::false_type{});
    }
    if (kStackedFlat && unit_ends && has_next) flat_amax_units(next_unit);  // (patch is free until the next loads)
    if (!kStagedPatch && has_next) load_patch_rows(patch, next_source, 0), load_patch_rows(patch + 8, next_source, 8);
    // the CTA's columnwise outputs of this tile column leave together
    if constexpr (kColwise) {
      __syncthreads();
      // the CTA's first row within its matrix, and that matrix's columnwise copy
      const int64_t cta_m0 = m0 - int64_t{warp} * L::kTileRows - (kStackedFlat ? flat_matrix * col_rows : 0);
      uint8_t* const col_codes_out = kStackedFlat ? col_data + flat_matrix * cols * col_data_pitch : col_data;
      uint8_t* const col_scales_out = kStackedFlat ? col_scale + flat_matrix * cols * col_scale_pitch : col_scale;
      if (col_data_vec && k0 + kQuantTileCols <= cols && cta_m0 / 2 + kColCodeBytes <= col_data_pitch) {
        // whole: thread t stores piece t % kColCodePieces of columns t / kColCodePieces + kColsPerPass * k
        constexpr int kColsPerPass = kQuantThreads / kColCodePieces;
        const int c = threadIdx.x / kColCodePieces, piece = threadIdx.x % kColCodePieces;
        uint8_t* d = col_codes_out + (k0 + c) * col_data_pitch + cta_m0 / 2 + 16 * piece;
#pragma unroll
        for (int k = 0; k < kQuantTileCols / kColsPerPass; ++k) {
          const int col = c + k * kColsPerPass;
          const uint8_t* piece_bytes = &col_code_stage[col][col_code_piece(col, piece) * 16];
          store_output<kAfterRowPass>(reinterpret_cast<uint4*>(d + k * kColsPerPass * col_data_pitch),
                                      *reinterpret_cast<const uint4*>(piece_bytes));
        }
      } else {
        for (int id = threadIdx.x; id < kQuantTileCols * kColCodePieces; id += kQuantThreads) {
          const int col = id / kColCodePieces, piece = id % kColCodePieces;
          const int64_t offset = cta_m0 / 2 + 16 * piece;
          if (k0 + col < cols && offset < col_data_pitch)
            store_piece<16, kAfterRowPass>(col_codes_out + (k0 + col) * col_data_pitch + offset,
                                           &col_code_stage[col][col_code_piece(col, piece) * 16],
                                           static_cast<int>(std::min<int64_t>(col_data_pitch - offset, 16)));
        }
      }
      for (int col = threadIdx.x; col < kQuantTileCols; col += kQuantThreads) {
        const int64_t offset = cta_m0 / 16;
        if (col_scale_vec && k0 + kQuantTileCols <= cols && offset + kColScaleBytes <= col_scale_pitch) {
          using Piece = std::conditional_t<kColScaleBytes == 16, uint4, uint2>;
          store_output<kAfterRowPass>(reinterpret_cast<Piece*>(col_scales_out + (k0 + col) * col_scale_pitch + offset),
                                      *reinterpret_cast<const Piece*>(&col_scale_stage[col][0]));
        } else if (k0 + col < cols && offset < col_scale_pitch) {
          store_piece<kColScaleBytes, kAfterRowPass>(
              col_scales_out + (k0 + col) * col_scale_pitch + offset, &col_scale_stage[col][0],
              static_cast<int>(std::min<int64_t>(col_scale_pitch - offset, kColScaleBytes)));
        }
      }
      __syncthreads();  // the stages may be refilled
    }
    // staged rowwise outputs leave when their lines are whole: codes every kCodeStageTiles tiles, scales
    // at the end of the unit (either also at the end of the tile row)
    if constexpr (kRowwise) {
      if (tk % kCodeStageTiles == kCodeStageTiles - 1 || unit_ends)
        flush_rows(row_data, row_data_pitch, (k0 - tk % kCodeStageTiles * kQuantTileCols) / 2,
                   &row_code_stage[warp][0][0], std::integral_constant<int, kCodeStageBytes>{}, out_row0(), out_row_end(),
                   row_data_vec);
      if (unit_ends) {
        // The unit's scales: stage bytes from (its first tile % kUnitTiles) * 4 on, unit_tiles * 4 a row, in
        // 8-byte pieces (1, 2 or 4 a row; one loop for every unit width keeps the tile loop's code small).
        const int64_t first_byte = int64_t{unit_first_tk(unit)} * (kQuantTileCols / 16);
        const uint8_t* stage = &row_scale_stage[warp][0][unit_first_tk(unit) % kUnitTiles * L::kTileBlocks];
        const int piece_shift = unit_tiles / 4;  // log2 of the pieces a row: unit_tiles 2, 4, 8 -> 0, 1, 2
        __syncwarp();  // every lane's scales are staged
        for (int id = lane; id < L::kTileRows << piece_shift; id += 32) {
          const int r = id >> piece_shift, piece = id & ((1 << piece_shift) - 1);
          const int64_t offset = first_byte + 8 * piece;
          const int n = static_cast<int>(std::min<int64_t>(row_scale_pitch - offset, 8));
          if (out_row0() + r >= out_row_end() || n <= 0) continue;
          store_piece<8>(row_scale + (out_row0() + r) * row_scale_pitch + offset, stage + r * kScaleStageBytes + 8 * piece,
                         n);
        }
        __syncwarp();  // the stage may be refilled
      }
    }
    if (kRowScaled && has_next) publish_global_scales(kGrouped || next_tm != tm, kGrouped || next_tk != tk);
    unit = next_unit, tm = next_tm, tk = next_tk, tile_rows = next_tile_rows;
  }
}

template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHadamard, bool kStochastic>
int quantize_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                           const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data,
                           uint8_t* col_scale, const int64_t* rng_state) {
  constexpr int64_t kTileRows = QuantLane<InT>::kTileRows;
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if ((kColwise || k2D) && rows % 16 != 0) return kInvalidProblem;
  if (((rows + kTileRows - 1) / kTileRows) * quant_tiles_k(cols) > kMaxQuantTiles)
    return kInvalidProblem;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if (kRowwise && (row_amax == nullptr || row_data == nullptr || row_scale == nullptr)) return kInvalidProblem;
  if (kColwise && (col_amax == nullptr || col_data == nullptr || col_scale == nullptr)) return kInvalidProblem;
  if (kStochastic && rng_state == nullptr) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  if ((kRowwise && !aligned(row_data, 8)) || (kColwise && !aligned(col_data, 8))) return kMisaligned;
  return kOk;
}

// Launches quantize_kernel over rows x cols (a checked problem with work), as the programmatic dependent of the
// kernel before it on `stream` (the kernel waits for it before it reads the amaxes).
template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHadamard, bool kStochastic,
          bool kHardwareCvt, bool kGrouped = false, bool kStackedFlat = false>
int launch_quantize_kernel(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                           const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data,
                           uint8_t* col_scale, const int64_t* rng_state, const QuantRowGroups& row_groups,
                           cudaStream_t stream) {
  constexpr auto kernel =
      quantize_kernel<InT, kRowwise, kColwise, kRowScaled, k2D, kHardwareCvt, kHadamard, kStochastic, kGrouped,
                      kStackedFlat>;
  int device = 0, sms = 0, per_sm = 0;
  if (!current_device_multiprocessors(&device, &sms) || !cached_occupancy<kernel>(device, kQuantThreads, 0, &per_sm))
    return launch_status();
  constexpr int64_t kTileRows = QuantLane<InT>::kTileRows;
  const int64_t slots = static_cast<int64_t>(sms) * std::max(per_sm, 1), tiles_k = quant_tiles_k(cols);
  const int64_t tile_rows = (rows + kTileRows - 1) / kTileRows;
  const int unit_tiles = quant_after_row_pass<kRowwise, kColwise, kRowScaled, kGrouped>() ? 1
                         : kStackedFlat ? kCodeStageTiles  // (see kStackedFlatAmaxLead)
                                        : quant_unit_tiles_for(tile_rows, tiles_k, slots, kStochastic);
  const int64_t units = (tile_rows + kQuantWarps - 1) / kQuantWarps * ((tiles_k + unit_tiles - 1) / unit_tiles);
  int64_t grid = std::min<int64_t>(units, slots);
  if constexpr (quant_after_row_pass<kRowwise, kColwise, kRowScaled, kGrouped>()) {
    // a multiple of the tile columns, so that each CTA's tiles (dealt in turn) share one tile column and its
    // columns' global scales are made once: a grid of every slot measured 1.6-1.8 us slower on the row-scaled
    // call on the H200, and still slower with those scales made free (bench/RESULTS.md, a32b33d, 2026-11-30)
    if (grid >= tiles_k) grid = grid / tiles_k * tiles_k;
  }
  const bool dealt =
      quant_may_deal_units<kRowwise, kColwise, kRowScaled, kStochastic>() && quant_units_dealt(units, grid);
  return launch_programmatic_dependent(kernel, dim3(static_cast<unsigned>(grid)), dim3(kQuantThreads), 0, stream,
                                       static_cast<const InT*>(x), x_row_stride, rows, cols, row_amax, col_amax,
                                       row_data, row_scale, col_data, col_scale, rng_state, unit_tiles, dealt,
                                       row_groups);
}

template <class InT, bool kRowwise, bool kColwise, bool kRowScaled, bool k2D, bool kHadamard, bool kStochastic,
          bool kHardwareCvt>
int quantize_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, const float* row_amax,
                 const float* col_amax, uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale,
                 const int64_t* rng_state, cudaStream_t stream) {
  const int status = quantize_can_implement<InT, kRowwise, kColwise, kRowScaled, k2D, kHadamard, kStochastic>(
      x, x_row_stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data, col_scale, rng_state);
  if (status != kOk) return status;
  if (rows == 0 || cols == 0) return kOk;
  return launch_quantize_kernel<InT, kRowwise, kColwise, kRowScaled, k2D, kHadamard, kStochastic, kHardwareCvt>(
      x, x_row_stride, rows, cols, row_amax, col_amax, row_data, row_scale, col_data, col_scale, rng_state,
      QuantRowGroups{}, stream);
}

}  // namespace fp4gen
