// The row pass of row-scaled quantization: per-row amax [M], the rowwise NVFP4 copy (codes [M, K/2], scales
// [M, K/16]) and, when asked, the per-column amax [K] of x [M, K], reading x from DRAM once (spec sections 2-4).
//
// Why a pass of its own: with row scaling, a rowwise block needs its row's amax and a columnwise block its
// column's, and each spans the whole tensor, so x is read twice. The one-pass quantize kernel (quantize.cuh)
// encodes both directions in the second read and is bound by instruction issue, while the amax pass before it
// is bound by DRAM and leaves the SMs idle. Here the rowwise encode moves into the first read: a CTA takes a
// panel of kRowPassPanelRows whole rows (panels are dealt to the CTAs in turn), reads it for the rows'
// amaxes (phase A), and encodes it (phase B). The columnwise copy is then the quantize family's
// columnwise-only kernel, whose read is the second one from DRAM.
//
// Work split: a warp's chunk is 32 rowwise blocks (512 elements) of each row of the panel, and chunks are
// dealt to the CTA's warps in turn. Lane l holds block l of the chunk, its 16 elements in kLoads 16-byte
// vectors, so a block's amax, scale and codes need no other lane; a lane stores 8 bytes of codes (a warp, 256
// contiguous bytes) and one scale byte.
//
// Where the CTA's lanes can hold the whole panel in registers (16-bit rows of up to 8192 elements: a lane
// holds RowPassLayout::kHeldChunks = 2 chunks, 8 vectors), phase A issues all of a warp's loads at once and
// phase B encodes from registers. The row pass waits on DRAM: twice the loads in flight per warp, and no
// re-read in phase B, took about 6 us off row-scaled 8192x8192 on the H200 (bench/RESULTS.md, afee2c7,
// 2026-11-30).
// Rows of up to 4096 elements take 4 warps a CTA (8 CTAs per SM), so that each warp still holds 2 chunks
// (about 10 us off 16384x4096). Wider rows, and fp32 rows, take 8 warps and rounds of kHeldChunks chunks a
// warp, and phase B reads each round again (from L1 or L2: a panel is at most 64 KB).
//
// Column amaxes: a CTA keeps running maxima of its columns over all its panels in shared memory, laid out
// like the phase-B loads ([chunk][vector][lane], packed like the input) so that each slot belongs to the one
// warp that reads that chunk: no atomics. At the end each CTA writes them to the workspace and
// column_amax_reduce_kernel takes the maximum over the CTAs, then drops the partials' lines from L2 unwritten
// (scratch: 8.7 MB on 8192x8192 that would otherwise go to DRAM during the columnwise pass). (Atomics from
// every CTA straight into col_amax cost 30-60 us on 8192x8192 on the H200: all CTAs end at once and update
// the same addresses.)
//
// Numerics are those of quantize.cuh's rowwise copy: maxima on |x| bit patterns (NaN-propagating row and
// column amaxes), block amaxes that ignore NaN, encode_block_scale, and on sm_90a the branch-free reciprocal
// and the fast encode wherever their conditions hold for every row of the panel and block of the step.
#pragma once

#include <algorithm>
#include <type_traits>

#include "fp4gen/abi.h"
#include "fp4gen/elements.cuh"
#include "fp4gen/nvfp4.cuh"
#include "fp4gen/stochastic.cuh"

namespace fp4gen {

constexpr int kRowPassPanelRows = 2;
constexpr int kRowPassWarpsPerSM = 32;  // asked of __launch_bounds__: 64 registers a thread, no spills
constexpr int kRowPassChunk = 32 * 16;  // elements of a row that a warp takes at a time: 32 blocks
constexpr int kRowPassHeldVectors = 8;  // 16-byte vectors a lane keeps from phase A to phase B (32 registers)
constexpr int kColumnReduceSplits = 8;  // CTAs over the partials of one column group

template <class InT>
struct RowPassLayout {
  static constexpr int kVec = Element<InT>::kPerVector;  // elements per 16-byte vector
  static constexpr int kLoads = 16 / kVec;               // vectors per block: 2 (16-bit) or 4 (fp32)
  // chunks of a panel that a lane holds in registers: 2 (16-bit) or 1 (fp32)
  static constexpr int kHeldChunks = kRowPassHeldVectors / (kRowPassPanelRows * kLoads);
  static_assert(kHeldChunks >= 1, "a lane holds at least one chunk of the panel");
  // bytes of shared memory (and of each CTA's workspace slice) for the column maxima of `cols` columns
  static int64_t column_bytes(int64_t cols) {
    return (cols + kRowPassChunk - 1) / kRowPassChunk * kRowPassChunk * static_cast<int64_t>(sizeof(InT));
  }
};

// Calls f(warps, whole_row), as std::integral_constants, with the CTA shape for rows of `cols` elements:
// whether the CTA's lanes hold the whole row (kHeldChunks chunks each; 16-bit inputs only: with fp32 that
// spills at 64 registers), and its warps: 4 where 4 can hold the row, else 8. Four warps at 8 CTAs per SM keep
// as many loads in flight as 8 at 4 on rows half as wide.
template <class InT, class F>
auto with_row_pass_shape(int64_t cols, F&& f) {
  if constexpr (sizeof(InT) == 2) {
    const int64_t chunks = (cols + kRowPassChunk - 1) / kRowPassChunk;
    constexpr int64_t kPerWarp = RowPassLayout<InT>::kHeldChunks;
    if (chunks <= 4 * kPerWarp) return f(std::integral_constant<int, 4>{}, std::true_type{});
    if (chunks <= 8 * kPerWarp) return f(std::integral_constant<int, 8>{}, std::true_type{});
  }
  return f(std::integral_constant<int, 8>{}, std::false_type{});
}

// kStochastic: the rowwise copy rounded stochastically (stochastic.cuh) with the seed and offset in rng_state (read
// on the device); a lane's block is its own, so each block is one Philox call.
template <class InT, bool kHardwareCvt, bool kStochastic, int kWarps, bool kWholeRow>
__global__ void __launch_bounds__(32 * kWarps, kRowPassWarpsPerSM / kWarps)
    row_pass_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                    float* __restrict__ row_amax, float* __restrict__ col_amax, uint4* __restrict__ col_partial,
                    uint8_t* __restrict__ row_data, uint8_t* __restrict__ row_scale,
                    const int64_t* __restrict__ rng_state) {
  using E = Element<InT>;
  using Layout = RowPassLayout<InT>;
  constexpr int kVec = Layout::kVec, kLoads = Layout::kLoads, kPanelRows = kRowPassPanelRows;
  constexpr int kThreads = 32 * kWarps, kHeld = Layout::kHeldChunks;
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(InT));
  constexpr bool kFastEncode = !kHardwareCvt && sizeof(InT) == 2 && !kStochastic;  // as in quantize.cuh
  constexpr bool kBranchFreeScales = !kHardwareCvt;
  extern __shared__ __align__(16) uint4 column_max[];  // [chunk][vector][lane]; only when col_amax != nullptr
  __shared__ uint32_t warp_row_max[kWarps][kPanelRows];
  __shared__ GlobalScale panel_global[kPanelRows];
  __shared__ bool panel_special[kPanelRows];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool columns = col_amax != nullptr;
  const int chunks = static_cast<int>((cols + kRowPassChunk - 1) / kRowPassChunk);
  // rounds of kHeld chunks a warp; chunk h of round k is warp + (k * kHeld + h) * kWarps
  const int rounds = kWholeRow ? 1 : (chunks + kHeld * kWarps - 1) / (kHeld * kWarps);
  const int column_slots = chunks * kLoads * 32;
  if (columns)
    for (int i = threadIdx.x; i < column_slots; i += kThreads) column_max[i] = make_uint4(0, 0, 0, 0);
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
  const int64_t data_pitch = cols / 2, scale_pitch = cols / 16;
  __syncthreads();

  // Launched as the programmatic dependent of the kernel before it on the stream (which may write x or read
  // the outputs): wait for it before touching global memory.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  uint64_t seed = 0, draw = 0;
  if constexpr (kStochastic) seed = static_cast<uint64_t>(rng_state[0]), draw = static_cast<uint64_t>(rng_state[1]);
  if (columns)  // column_amax_reduce_kernel accumulates into col_amax with atomicMax after this grid ends
    for (int64_t c = int64_t{blockIdx.x} * kThreads + threadIdx.x; c < cols; c += int64_t{gridDim.x} * kThreads)
      col_amax[c] = 0.0f;

  // Panels are dealt to the CTAs in turn, so the grid moves down x together and the last rows read, still in
  // L2 when the columnwise pass reaches them, are the bottom ones (quant_after_row_pass in quantize.cuh).
  for (int64_t panel = blockIdx.x; panel < panels; panel += gridDim.x) {
    const int64_t r0 = panel * kPanelRows;
    const int panel_rows = static_cast<int>(std::min<int64_t>(rows - r0, kPanelRows));
    const InT* lane_x = x + r0 * x_row_stride + lane * 16;  // block `lane` of chunk 0, row 0 of the panel
    // this lane's block of chunk `chunk` in each row of the panel (zeros outside the tensor: K is a multiple
    // of 16, so a block is wholly inside or outside)
    auto load_block = [&](int chunk, uint4 (&v)[kPanelRows][kLoads]) {
      const bool inside = int64_t{chunk} * kRowPassChunk + lane * 16 < cols;
      const InT* src = lane_x + int64_t{chunk} * kRowPassChunk;
#pragma unroll
      for (int p = 0; p < kPanelRows; ++p)
#pragma unroll
        for (int l = 0; l < kLoads; ++l)
          v[p][l] = inside && p < panel_rows ? *reinterpret_cast<const uint4*>(src + p * x_row_stride + l * kVec)
                                             : make_uint4(0, 0, 0, 0);
    };

    // the warp's chunks of round k, loaded together (chunks past the row read as zeros)
    uint4 held[kHeld][kPanelRows][kLoads];
    auto load_round = [&](int k) {
#pragma unroll
      for (int h = 0; h < kHeld; ++h) load_block(warp + (k * kHeld + h) * kWarps, held[h]);
    };

    // Phase A: the rows' amaxes (each warp's share, then across warps) and the columns' running maxima.
    uint32_t row_max[kPanelRows];  // packed like the input
#pragma unroll
    for (int p = 0; p < kPanelRows; ++p) row_max[p] = 0u;
    // Where the lanes hold the whole row (16-bit elements), phase A also keeps each held block's packed |x|
    // maximum for phase B's block scale (one register a block, no spills at 64; about 0.5 us of row-scaled
    // 8192x8192 on the H200, bench/RESULTS.md, c5135f3, 2026-11-30). These maxima propagate NaN, so phase B
    // uses them only in panels with no special row (no NaN); the others remake them, ignoring NaN.
    constexpr bool kKeepBlockMax = kWholeRow && kPerWord == 2;
    uint32_t block_max[kKeepBlockMax ? kHeld : 1][kPanelRows];
    auto accumulate_maxima = [&](int h, int chunk, const uint4 (&v)[kPanelRows][kLoads]) {
#pragma unroll
      for (int p = 0; p < kPanelRows; ++p) {
        uint32_t m = 0u;  // the block's |x| maximum, packed like the input
#pragma unroll
        for (int l = 0; l < kLoads; ++l) {
          const uint4 w = v[p][l];
          m = word_abs_max<InT>(word_abs_max<InT>(m, w.x), w.y);
          m = word_abs_max<InT>(word_abs_max<InT>(m, w.z), w.w);
        }
        if constexpr (kKeepBlockMax) block_max[h][p] = m;
        row_max[p] = abs_word_max<InT>(row_max[p], m);
      }
      if (columns) {
#pragma unroll
        for (int l = 0; l < kLoads; ++l) {
          uint4& slot = column_max[(chunk * kLoads + l) * 32 + lane];
          uint4 col = slot;
#pragma unroll
          for (int p = 0; p < kPanelRows; ++p) {
            const uint4 w = v[p][l];
            col = make_uint4(word_abs_max<InT>(col.x, w.x), word_abs_max<InT>(col.y, w.y),
                             word_abs_max<InT>(col.z, w.z), word_abs_max<InT>(col.w, w.w));
          }
          slot = col;
        }
      }
    };
    for (int k = 0; k < rounds; ++k) {
      load_round(k);
#pragma unroll
      for (int h = 0; h < kHeld; ++h) {
        const int chunk = warp + (k * kHeld + h) * kWarps;
        if (chunk < chunks) accumulate_maxima(h, chunk, held[h]);
      }
    }
#pragma unroll
    for (int p = 0; p < kPanelRows; ++p) {
      uint32_t m = word_element<InT>(row_max[p], 0);
      if constexpr (kPerWord == 2) m = max(m, word_element<InT>(row_max[p], 1));
      m = warp_max_bits(m);
      if (lane == 0) warp_row_max[warp][p] = m;
    }
    __syncthreads();
    // one thread per row: its amax and global scale, once for the CTA
    if (threadIdx.x < kPanelRows) {
      const int p = threadIdx.x;
      uint32_t m = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = max(m, warp_row_max[w][p]);
      const float amax = __uint_as_float(E::abs_bits_as_float_bits(m));
      const GlobalScale g = global_scale(amax);
      panel_global[p] = g;
      // as quantize.cuh's rows_special: NaN amax, or a global scale outside the branch-free reciprocal's range
      panel_special[p] = isnan(amax) || !block_reciprocals_in_range(g);
      if (p < panel_rows) row_amax[r0 + p] = amax;
    }
    __syncthreads();  // (also: warp_row_max is free for the next panel)
    GlobalScale g[kPanelRows];
    bool special = false;
#pragma unroll
    for (int p = 0; p < kPanelRows; ++p) g[p] = panel_global[p], special = special || panel_special[p];
    // read back before the next panel's first barrier, after which panel_global may change

    // Phase B: encode the panel (from registers where they hold the whole row). A step is one chunk of every
    // row of the panel: its block scales first (no branch between them), then one vote for the fast encode of
    // all of them. Codes and scales leave with .cs stores (first out of L2), which keeps more of x there for
    // the columnwise pass.
    // Output addresses: the panel's bases plus a lane's offset, 32-bit where the CTA holds whole rows (at most
    // 8192 elements). The compiler remade each store's address from r0 (about 12 instructions a store, 1.4 an
    // element of phase B) until the offsets were 32-bit and the scales' base came out of an asm statement,
    // which it keeps in registers instead of recomputing (about 1 us of row-scaled 8192x8192 on the H200,
    // bench/RESULTS.md, c5135f3, 2026-11-30).
    using Offset = std::conditional_t<kWholeRow, uint32_t, int64_t>;
    uint8_t* panel_data = row_data + r0 * data_pitch;
    uint8_t* panel_scale = row_scale + r0 * scale_pitch;
    asm("mov.b64 %0, %0;" : "+l"(panel_scale));
    auto encode_chunk = [&](int h, int chunk, const uint4 (&v)[kPanelRows][kLoads]) {
      const bool inside = int64_t{chunk} * kRowPassChunk + lane * 16 < cols;
      const Offset chunk_offset = static_cast<Offset>(chunk) * kRowPassChunk;  // in elements of a row
      auto encode_step = [&](auto in_range) {
        constexpr bool kInRange = decltype(in_range)::value;
        float r[kPanelRows];
        bool fast_ok = kFastEncode && kInRange;
#pragma unroll
        for (int p = 0; p < kPanelRows; ++p) {
          float block_amax;
          if constexpr (kKeepBlockMax && kInRange) {
            block_amax = xorsign_pair_to_amax<InT>(block_max[h][p]);
          } else if constexpr (kPerWord == 2) {
            auto am = [](uint32_t a, uint32_t b) { return abs_max_xorsign<InT>(a, b); };
            const uint4 a = v[p][0], b = v[p][1];
            const uint32_t m = am(am(am(a.x, a.y), am(a.z, a.w)), am(am(b.x, b.y), am(b.z, b.w)));
            block_amax = xorsign_pair_to_amax<InT>(m);
          } else {
            block_amax = 0.0f;  // fmaxf ignores NaN elements (0 if all are NaN)
#pragma unroll
            for (int l = 0; l < kLoads; ++l) {
              const uint4 w = v[p][l];
              block_amax = fmaxf(block_amax, fmaxf(fmaxf(fabsf(__uint_as_float(w.x)), fabsf(__uint_as_float(w.y))),
                                                   fmaxf(fabsf(__uint_as_float(w.z)), fabsf(__uint_as_float(w.w)))));
            }
          }
          const BlockEncoding enc = encode_block_scale<kInRange>(block_amax, g[p]);
          r[p] = enc.inverse;
          if constexpr (kFastEncode && kInRange)
            fast_ok = fast_ok & fast_encode_ok<E::kMinSubnormalExponent>(block_amax, enc.inverse);
          if (inside && p < panel_rows)
            __stcs(panel_scale + (p * static_cast<Offset>(scale_pitch) + chunk_offset / 16 + lane),
                   static_cast<uint8_t>(enc.scale_byte));
        }
        auto encode = [&](auto fast) {
          uint4 bits[kStochastic ? kPanelRows : 1];  // each row's block's random words
          if constexpr (kStochastic) {
#pragma unroll
            for (int p = 0; p < kPanelRows; ++p)
              bits[p] = block_random_bits(seed, draw, static_cast<uint64_t>(r0 + p) * static_cast<uint64_t>(scale_pitch) +
                                                          static_cast<uint64_t>(chunk_offset / 16 + lane));
          }
#pragma unroll
          for (int p = 0; p < kPanelRows; ++p) {
            uint32_t codes[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // 8 elements to a word
              float vals[8];
#pragma unroll
              for (int c = 0; c < 8; ++c)
                vals[c] = E::word_element_to_float(&v[p][(8 * half + c) / kVec].x, (8 * half + c) % kVec);
              if constexpr (kStochastic) {  // the block's words 2 half, 2 half + 1
                const uint4 b = bits[p];
                codes[half] = encode_codes_stochastic(vals, r[p], half ? make_uint2(b.z, b.w) : make_uint2(b.x, b.y));
              } else if constexpr (decltype(fast)::value) {
                codes[half] = encode_codes_fast(vals, r[p]);
              } else {
                codes[half] = encode_codes<kHardwareCvt, 8>(vals, r[p]);
              }
            }
            if (inside && p < panel_rows) {
              const Offset offset = p * static_cast<Offset>(data_pitch) + chunk_offset / 2 + lane * 8;
              __stcs(reinterpret_cast<uint2*>(panel_data + offset), make_uint2(codes[0], codes[1]));
            }
          }
        };
        if constexpr (kFastEncode && kInRange) {
          if (__all_sync(0xFFFFFFFFu, fast_ok)) {
            encode(std::true_type{});
            return;
          }
        }
        encode(std::false_type{});
      };
      if constexpr (kBranchFreeScales) {
        // a vote, so that the compiler sees a warp-uniform branch around the shuffles of __all_sync
        if (__any_sync(0xFFFFFFFFu, special)) {
          encode_step(std::false_type{});
        } else {
          encode_step(std::true_type{});
        }
      } else {
        encode_step(std::false_type{});
      }
    };
    for (int k = 0; k < rounds; ++k) {
      if (!kWholeRow) load_round(k);  // read again: holding a round across the barriers costs registers
#pragma unroll
      for (int h = 0; h < kHeld; ++h) {
        const int chunk = warp + (k * kHeld + h) * kWarps;
        if (chunk < chunks) encode_chunk(h, chunk, held[h]);
      }
    }
  }

  if (columns) {
    __syncthreads();
    uint4* partial = col_partial + int64_t{blockIdx.x} * column_slots;
    for (int i = threadIdx.x; i < column_slots; i += kThreads) partial[i] = column_max[i];
  }
  // The next kernel (column_amax_reduce_kernel or the columnwise pass) may launch; it waits for this grid.
  asm volatile("griddepcontrol.launch_dependents;");
}

// col_amax = the maximum over the row pass's n_partials CTA slices (zeroed by the row pass, then atomicMax).
// CTA (group, split): 32 slots (one per lane) of partials split, split + kColumnReduceSplits, ..., its 32 warps
// taking those in turn.
template <class InT>
__global__ void __launch_bounds__(1024)
    column_amax_reduce_kernel(const uint4* __restrict__ col_partial, int n_partials, int slots, int64_t cols,
                              float* __restrict__ col_amax) {
  using E = Element<InT>;
  constexpr int kVec = RowPassLayout<InT>::kVec, kLoads = RowPassLayout<InT>::kLoads;
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(InT));
  __shared__ uint4 warp_max[32][32];
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the row pass's partials and zeroed col_amax
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = blockIdx.x * 32 + lane;
  auto combine = [](uint4 a, uint4 b) {
    return make_uint4(word_abs_max<InT>(a.x, b.x), word_abs_max<InT>(a.y, b.y), word_abs_max<InT>(a.z, b.z),
                      word_abs_max<InT>(a.w, b.w));
  };
  uint4 m = make_uint4(0, 0, 0, 0);
  if (slot < slots)
    for (int k = blockIdx.y * 32 + warp; k < n_partials; k += 32 * kColumnReduceSplits)
      m = combine(m, col_partial[int64_t{k} * slots + slot]);
  warp_max[warp][lane] = m;
  // The partials are scratch, dirty in L2: drop the lines this CTA read so that they are not written back
  // (1-1.5 us of row-scaled 8192x8192 on the H200, bench/RESULTS.md, b43f5ad, 2026-11-30). Each line is 8
  // lanes' slots of one k, all read by this warp, and their loads are complete (m, which holds them, has been
  // stored).
  // Only with a 128-byte aligned workspace, where no line reaches past its ends (slots is a multiple of 32,
  // so each k's slots are whole lines).
  if (reinterpret_cast<uintptr_t>(col_partial) % 128 == 0 && lane % 8 == 0 && slot < slots)
    for (int k = blockIdx.y * 32 + warp; k < n_partials; k += 32 * kColumnReduceSplits)
      asm volatile("discard.global.L2 [%0], 128;" ::"l"(col_partial + int64_t{k} * slots + slot) : "memory");
  __syncthreads();
  if (warp == 0 && slot < slots) {
#pragma unroll 4
    for (int w = 1; w < 32; ++w) m = combine(m, warp_max[w][lane]);
    // slot (chunk, vector, lane) holds columns chunk * kRowPassChunk + lane * 16 + vector * kVec + [0, kVec)
    const int64_t col0 = int64_t{slot / (32 * kLoads)} * kRowPassChunk + (slot % 32) * 16 + (slot / 32 % kLoads) * kVec;
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
      const int w = c / kPerWord;
      const uint32_t word = w == 0 ? m.x : w == 1 ? m.y : w == 2 ? m.z : m.w;
      if (col0 + c < cols)
        atomicMax(reinterpret_cast<unsigned int*>(col_amax + col0 + c),
                  E::abs_bits_as_float_bits(word_element<InT>(word, c % kPerWord)));
    }
  }
  asm volatile("griddepcontrol.launch_dependents;");
}

// The row pass's grid: CTAs that fit on the GPU at once, at most one per panel. 0 on a CUDA error.
template <class InT, bool kHardwareCvt, bool kStochastic, int kWarps, bool kWholeRow>
int64_t row_pass_grid(int64_t rows, int64_t cols, bool columns, size_t* shared_bytes) {
  constexpr auto kernel = row_pass_kernel<InT, kHardwareCvt, kStochastic, kWarps, kWholeRow>;
  *shared_bytes = columns ? static_cast<size_t>(RowPassLayout<InT>::column_bytes(cols)) : 0;
  int device = 0, sms = 0, per_sm = 0;
  if (!current_device_multiprocessors(&device, &sms)) return 0;
  // more than the 48 KB a kernel gets by default needs an opt-in (only rows of more than 48 KB of column maxima)
  constexpr size_t kDefaultSharedBytes = 48 * 1024;
  if (*shared_bytes > kDefaultSharedBytes && opt_in_shared_bytes<kernel>(device, *shared_bytes) != cudaSuccess) return 0;
  if (!cached_occupancy<kernel>(device, 32 * kWarps, *shared_bytes, &per_sm)) return 0;
  const int64_t panels = (rows + kRowPassPanelRows - 1) / kRowPassPanelRows;
  return std::max<int64_t>(1, std::min<int64_t>(panels, static_cast<int64_t>(sms) * std::max(per_sm, 1)));
}

// Shared memory for the column maxima of up to this many bytes of a row (the H200's limit per CTA, less the
// static arrays); wider rows are refused.
constexpr int64_t kRowPassMaxColumnBytes = 200 * 1024;

template <class InT, bool kStochastic>
int row_pass_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                           float* col_amax, uint8_t* row_data, uint8_t* row_scale, void* workspace,
                           const int64_t* rng_state) {
  (void)workspace;  // checked by row_pass_run, where its size is known
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if (row_amax == nullptr || row_data == nullptr || row_scale == nullptr) return kInvalidProblem;
  if (kStochastic && rng_state == nullptr) return kInvalidProblem;
  if (col_amax != nullptr && RowPassLayout<InT>::column_bytes(cols) > kRowPassMaxColumnBytes) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  if (!aligned(row_data, 8)) return kMisaligned;
  return kOk;
}

// Workspace: each CTA's column maxima (none without col_amax).
template <class InT, bool kStochastic, bool kHardwareCvt>
size_t row_pass_workspace_size(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                               float* col_amax, uint8_t* row_data, uint8_t* row_scale, void* workspace,
                               const int64_t* rng_state) {
  (void)x, (void)x_row_stride, (void)row_amax, (void)row_data, (void)row_scale, (void)workspace, (void)rng_state;
  if (col_amax == nullptr || rows <= 0 || cols <= 0) return 0;
  size_t shared_bytes = 0;
  const int64_t grid = with_row_pass_shape<InT>(cols, [&](auto warps, auto whole_row) {
    return row_pass_grid<InT, kHardwareCvt, kStochastic, warps(), whole_row()>(rows, cols, true, &shared_bytes);
  });
  return static_cast<size_t>(grid) * shared_bytes;
}

template <class InT, bool kStochastic, bool kHardwareCvt>
int row_pass_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax, float* col_amax,
                 uint8_t* row_data, uint8_t* row_scale, void* workspace, const int64_t* rng_state, cudaStream_t stream) {
  const int status = row_pass_can_implement<InT, kStochastic>(x, x_row_stride, rows, cols, row_amax, col_amax,
                                                              row_data, row_scale, workspace, rng_state);
  if (status != kOk) return status;
  if (rows == 0 || cols == 0) return kOk;
  const bool columns = col_amax != nullptr;
  if (columns && (workspace == nullptr || !aligned(workspace, 16))) return kInvalidProblem;
  size_t shared_bytes = 0;
  int64_t grid = 0;
  const int launched = with_row_pass_shape<InT>(cols, [&](auto warps, auto whole_row) {
    grid = row_pass_grid<InT, kHardwareCvt, kStochastic, warps(), whole_row()>(rows, cols, columns, &shared_bytes);
    if (grid == 0) return launch_status();
    return launch_programmatic_dependent(
        row_pass_kernel<InT, kHardwareCvt, kStochastic, warps(), whole_row()>, dim3(static_cast<unsigned>(grid)),
        dim3(32 * warps()), shared_bytes, stream, static_cast<const InT*>(x), x_row_stride, rows, cols, row_amax,
        col_amax, static_cast<uint4*>(workspace), row_data, row_scale, rng_state);
  });
  if (launched != kOk || !columns) return launched;
  const int slots = static_cast<int>(shared_bytes / sizeof(uint4));
  return launch_programmatic_dependent(column_amax_reduce_kernel<InT>,
                                       dim3(static_cast<unsigned>((slots + 31) / 32), kColumnReduceSplits), dim3(1024),
                                       0, stream, static_cast<const uint4*>(workspace), static_cast<int>(grid), slots,
                                       cols, col_amax);
}

}  // namespace fp4gen
