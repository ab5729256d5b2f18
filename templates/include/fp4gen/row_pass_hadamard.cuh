// The row pass of row-scaled quantization whose columnwise copy takes the random Hadamard transform (16-bit
// inputs): from one DRAM read of x [M, K], the per-row amax [M], the rowwise NVFP4 copy of x and the per-column
// amax [K] of the transformed x.T (hadamard.cuh), which the columnwise-only quantize kernel with the transform
// then uses.
//
// Why not row_pass.cuh: the transform mixes 16 consecutive rows of a column, so a column's amax needs whole
// 16-row groups, and row_pass.cuh's panels are 2 rows. Here a panel is 16 rows, held in registers by a cluster
// of CTAs along the row: a lane holds a patch of 16 rows x 8 columns (one 16-byte vector per row, as in
// quantize.cuh), a CTA of up to kRhtCtaWarps warps 2048 columns, and a cluster of up to kRhtMaxCluster CTAs the
// whole row. Then, with x read once:
//  - the lanes' row maxima go to a CTA maximum per row, and the cluster's CTAs read each other's through
//    distributed shared memory (one cluster barrier) for the rows' amaxes;
//  - while that barrier completes, each lane transforms its 8 columns' 16-row group and sends their maxima
//    to col_amax with atomicMax (zeroed by the launcher; the maxima on |v| bit patterns propagate NaN, which
//    is canonicalized to 0x7FC0 as the reference does);
//  - the lanes encode their rows' blocks (a block is a lane pair, as in quantize.cuh) from registers.
// A cluster takes one panel and exits (2 CTAs of 128 registers a thread per SM). On the H200 (row-scaled
// 8192 x 8192 bf16, bench/RESULTS.md, 2026-12-01) this pass takes about 98 us against the plain row pass's 57;
// leaving out parts of it (wrong results, timing only) gave 72 us without the column atomics, 87 without the
// transform and 58 without the rowwise encode: a CTA's work follows its loads with nothing to overlap them.
// Measured slower and not kept: persistent clusters that prefetch the next panel into shared memory with
// cp.async (119 us; every panel then waits on the cluster barrier in lockstep), 3 CTAs per SM at 80 registers
// (100 us, spilling), reading col_amax to skip atomics that cannot raise it (108 us: the loads wait, the
// atomics did not), each panel's column maxima stored to a workspace and reduced by a kernel of its own
// instead of the atomics (91 + 6 us: the same), and (2026-12-03) as many clusters as are resident, each taking
// every so many panels and keeping its column maxima in shared memory for one round of atomics at the end:
// 3-4% faster with clusters of up to 4 CTAs (8192 x 8192 100 -> 96 us), 2.5% slower with 7 (8192 x 14336
// 176 -> 187 us), and launching 2 or 4 times the resident clusters did not make it faster everywhere.
// Numerics are those of quantize.cuh's rowwise copy: NaN-propagating row amaxes (packed bf16x2/f16x2 maxima,
// as row_pass.cuh), NaN-ignoring block amaxes, encode_block_scale, and on sm_90a the branch-free reciprocal
// and the fast encode wherever their conditions hold.
#pragma once

#include <algorithm>
#include <type_traits>

#include "fp4gen/abi.h"
#include "fp4gen/cluster.cuh"
#include "fp4gen/elements.cuh"
#include "fp4gen/hadamard.cuh"
#include "fp4gen/nvfp4.cuh"
#include "fp4gen/quantize.cuh"

namespace fp4gen {

constexpr int kRhtPanelRows = 16, kRhtCtaWarps = 8, kRhtMaxCluster = 8;
constexpr int kRhtLaneCols = 8;                                // a 16-byte vector of 16-bit elements
constexpr int kRhtCtaCols = kRhtCtaWarps * 32 * kRhtLaneCols;  // 2048
// Rows of up to this many elements: a portable cluster (8 CTAs) holds a 16-row panel.
constexpr int64_t kRhtMaxCols = int64_t{kRhtCtaCols} * kRhtMaxCluster;

template <class InT, bool kHardwareCvt>
__global__ void __launch_bounds__(32 * kRhtCtaWarps, 2)
    row_pass_hadamard_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                             float* __restrict__ row_amax, float* __restrict__ col_amax,
                             uint8_t* __restrict__ row_data, uint8_t* __restrict__ row_scale) {
  static_assert(sizeof(InT) == 2, "16-bit inputs: a lane's vector is 8 columns");
  using E = Element<InT>;
  constexpr bool kFastEncode = !kHardwareCvt;  // as in quantize.cuh (16-bit inputs)
  constexpr bool kBranchFreeScales = !kHardwareCvt;
  __shared__ uint32_t warp_rows[kRhtCtaWarps][kRhtPanelRows / 2];
  __shared__ uint32_t cta_rows[kRhtPanelRows / 2];  // read by the cluster's other CTAs
  __shared__ GlobalScale panel_global[kRhtPanelRows];
  __shared__ bool panel_special;
  __shared__ uint32_t column_max[kRhtCtaCols];  // the lanes' column maxima, for coalesced atomics

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32, q = lane % 2;
  const uint32_t rank = cluster_rank();
  const uint32_t ctas = cluster_ctas();
  const int64_t r0 = int64_t{blockIdx.x / ctas} * kRhtPanelRows;
  const int64_t cta_col0 = int64_t{rank} * (32 * warps * kRhtLaneCols);
  const int64_t col = cta_col0 + threadIdx.x * kRhtLaneCols;
  const bool inside = col < cols;  // K % 16 == 0: a lane's 8 columns are wholly inside or outside

  // Launched as the programmatic dependent of the kernel before it (which may write x): wait for it.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  uint4 patch[kRhtPanelRows];
  {
    const InT* src = x + r0 * x_row_stride + col;
#pragma unroll
    for (int i = 0; i < kRhtPanelRows; ++i)
      patch[i] = inside ? load_streaming<false>(src + i * x_row_stride) : make_uint4(0, 0, 0, 0);
  }

  // Row maxima: rows 2p and 2p + 1 packed in one word (low, high), NaN-propagating, over the lane's columns,
  // the warp, the CTA.
  uint32_t row_pairs[kRhtPanelRows / 2];
#pragma unroll
  for (int p = 0; p < kRhtPanelRows / 2; ++p) {
    uint32_t a = 0u, b = 0u;
    const uint4 u = patch[2 * p], v = patch[2 * p + 1];
    a = word_abs_max<InT>(word_abs_max<InT>(a, u.x), u.y), a = word_abs_max<InT>(word_abs_max<InT>(a, u.z), u.w);
    b = word_abs_max<InT>(word_abs_max<InT>(b, v.x), v.y), b = word_abs_max<InT>(word_abs_max<InT>(b, v.z), v.w);
    uint32_t m = abs_word_max<InT>(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = abs_word_max<InT>(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
    row_pairs[p] = m;
  }
  if (lane == 0) {
#pragma unroll
    for (int p = 0; p < kRhtPanelRows / 2; ++p) warp_rows[warp][p] = row_pairs[p];
  }
  if (threadIdx.x == 0) panel_special = false;
  __syncthreads();
  if (threadIdx.x < kRhtPanelRows / 2) {
    uint32_t m = 0u;
    for (int w = 0; w < warps; ++w) m = abs_word_max<InT>(m, warp_rows[w][threadIdx.x]);
    cta_rows[threadIdx.x] = m;
  }
  cluster_arrive();  // cta_rows is written (released to the cluster)

  // Columns, while the cluster's other CTAs get there: the transform of each of the lane's columns, and the
  // maximum of its |v| bits (NaN as 0x7FC0); the patch itself stays x for the rowwise encode.
#pragma unroll
  for (int w = 0; w < 4; ++w) {  // the lane's columns 2w, 2w + 1
    uint32_t maxima = 0u;  // the two columns' bf16 |v| bits
    hadamard_column_pair<InT>(patch, w, [&](int, uint32_t word) { maxima = max_u16x2(maxima, word & 0x7FFF7FFFu); });
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t bits = (maxima >> (16 * h)) & 0xFFFFu;
      if (bits > 0x7F80u) bits = 0x7FC0u;  // NaN: the canonical quiet NaN
      column_max[threadIdx.x * kRhtLaneCols + 2 * w + h] = bits << 16;
    }
  }
  __syncthreads();
  // coalesced: thread t takes columns t, t + blockDim.x, ... of the CTA's
  for (int c = threadIdx.x; c < 32 * warps * kRhtLaneCols; c += blockDim.x)
    if (cta_col0 + c < cols) atomicMax(reinterpret_cast<unsigned int*>(col_amax + cta_col0 + c), column_max[c]);

  cluster_wait();  // every CTA's cta_rows is visible
  if (threadIdx.x < kRhtPanelRows / 2) {
    uint32_t m = 0u;
    for (uint32_t r = 0; r < ctas; ++r) m = abs_word_max<InT>(m, load_cluster_shared(&cta_rows[threadIdx.x], r));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * threadIdx.x + h;
      const float amax = __uint_as_float(E::abs_bits_as_float_bits(word_element<InT>(m, h)));
      const GlobalScale g = global_scale(amax);
      panel_global[i] = g;
      if (isnan(amax) || !block_reciprocals_in_range(g)) panel_special = true;
      if (rank == 0) row_amax[r0 + i] = amax;
    }
  }
  cluster_arrive();  // done reading the other CTAs' shared memory (they wait for this before they exit)
  __syncthreads();

  // Rowwise: the lane pair (2k, 2k + 1) holds block k of each row; lane q computes the scales of rows
  // 2j + q and takes the other rows' inverse scales from its partner.
  float row_amax_of[8], col_unused[kRhtLaneCols];
  patch_block_amax<InT, true, false>(patch, q, row_amax_of, col_unused);
  const int64_t data_pitch = cols / 2, scale_pitch = cols / 16;
  auto encode_rows = [&](auto in_range) {
    constexpr bool kInRange = decltype(in_range)::value;
    float own[8];
    bool fast_ok = kFastEncode && kInRange;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = 2 * j + q;
      const BlockEncoding enc = encode_block_scale<kInRange>(row_amax_of[j], panel_global[i]);
      own[j] = enc.inverse;
      if constexpr (kFastEncode && kInRange) fast_ok = fast_ok & fast_encode_ok<E::kMinSubnormalExponent>(row_amax_of[j], enc.inverse);
      if (inside) __stcs(row_scale + (r0 + i) * scale_pitch + col / 16, static_cast<uint8_t>(enc.scale_byte));
    }
    auto encode = [&](auto fast) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float other = __shfl_xor_sync(0xFFFFFFFFu, own[j], 1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 2 * j + h;
          const float r = h == q ? own[j] : other;
          float vals[8];
#pragma unroll
          for (int c = 0; c < 8; ++c) vals[c] = E::word_element_to_float(&patch[i].x, c);
          uint32_t codes;
          if constexpr (decltype(fast)::value) {
            codes = encode_codes_fast(vals, r);
          } else {
            codes = encode_codes<kHardwareCvt, 8>(vals, r);
          }
          if (inside) __stcs(reinterpret_cast<uint32_t*>(row_data + (r0 + i) * data_pitch + col / 2), codes);
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
  if (kBranchFreeScales && !panel_special) {
    encode_rows(std::true_type{});
  } else {
    encode_rows(std::false_type{});
  }
  asm volatile("griddepcontrol.launch_dependents;");
  cluster_wait();  // the other CTAs are done reading this one's cta_rows
}

template <class InT>
int row_pass_hadamard_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                                    float* col_amax, uint8_t* row_data, uint8_t* row_scale, void* workspace,
                                    const int64_t* rng_state) {
  (void)workspace, (void)rng_state;  // no workspace; rounds to nearest
  if (rows < 0 || cols < 0 || cols % 16 != 0 || rows % kRhtPanelRows != 0) return kInvalidProblem;
  if (cols > kRhtMaxCols || rows / kRhtPanelRows * kRhtMaxCluster > 0x7FFFFFFF) return kInvalidProblem;  // gridDim.x
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if (row_amax == nullptr || col_amax == nullptr || row_data == nullptr || row_scale == nullptr) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  if (!aligned(row_data, 8)) return kMisaligned;  // as the plain row pass
  return kOk;
}

template <class InT, bool kHardwareCvt>
int row_pass_hadamard_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                          float* col_amax, uint8_t* row_data, uint8_t* row_scale, void* workspace,
                          const int64_t* rng_state, cudaStream_t stream) {
  const int status = row_pass_hadamard_can_implement<InT>(x, x_row_stride, rows, cols, row_amax, col_amax, row_data,
                                                          row_scale, workspace, rng_state);
  if (status != kOk) return status;
  if (cols > 0) {  // atomicMax accumulates into col_amax: it starts at +0 (also the amax of no rows)
    const cudaError_t err = cudaMemsetAsync(col_amax, 0, cols * sizeof(float), stream);
    if (err != cudaSuccess) return kCudaErrorBase + static_cast<int>(err);
  }
  if (rows == 0 || cols == 0) return kOk;
  // a cluster of CTAs along each 16-row panel; CTAs of up to kRhtCtaWarps warps, as few as cover the row
  const int64_t lane_vectors = (cols + kRhtLaneCols - 1) / kRhtLaneCols;
  const int ctas = static_cast<int>((lane_vectors + 32 * kRhtCtaWarps - 1) / (32 * kRhtCtaWarps));
  const int warps = static_cast<int>((lane_vectors + 32 * ctas - 1) / (32 * ctas));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(rows / kRhtPanelRows * ctas));
  config.blockDim = dim3(32 * warps);
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = ctas, attributes[0].val.clusterDim.y = 1, attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = 2;
  cudaLaunchKernelEx(&config, row_pass_hadamard_kernel<InT, kHardwareCvt>, static_cast<const InT*>(x), x_row_stride,
                     rows, cols, row_amax, col_amax, row_data, row_scale);
  return launch_status();
}

}  // namespace fp4gen
